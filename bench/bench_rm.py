"""Reward-model training throughput: the train-rm flow against a bare hand-written torch loop, side by side.

Both train the same model from the same initial weights on the same batches with the same optimizer and
learning-rate schedule. The flow's time covers its whole training loop (a Prefect task run per segment of
`checkpoint_interval` steps, each ending with a snapshot, and the progress artifact); the bare loop is
forward, Bradley-Terry loss, backward, clip, step, nothing else, plus one final save. Prints pairs/s of each and
the ratio (target: flow >= 0.95x bare, issue 15).

Each measurement runs in a fresh process (model loading and the flow's data tasks are not timed), and the two
kinds alternate `--repeats` times, bare first: on a shared 2-core machine a single pair of runs swings by +-8%
with the neighbours' load, so the figure to read is the median of the per-pair ratios.

    .venv/bin/python bench/bench_rm.py [--config configs/rm-default.toml] [--steps N] [--repeats 3]

By default it trains the config's whole budget (rm-default: 150 steps x 8 pairs, snapshots at 50, 100, 150),
about 10 minutes in all on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def bare_loop(config, steps: int) -> float:
    """The loop you would write by hand; returns seconds spent training (after model and data are ready)."""
    import torch

    from rollout_lib.identity.training import training_identity
    from rollout_lib.data import load_pairs
    from rollout_lib.losses import bradley_terry_batch_mean
    from rollout_lib.model.loading import load_tokenizer, resolve_model
    from rollout_lib.rm.pairs import collate_pairs, forward_pairs, tokenize_pairs
    from rollout_lib.rm.trainer import RewardModelTrainer
    from rollout_lib.store import ObjectStore
    from rollout_lib.trainer.base import TrainingInputs
    from rollout_lib.determinism import plan_batches, seed_for_step
    from rollout_lib.trainer.optim import lr_at, set_lr

    settings = config.settings
    tokenizer = load_tokenizer(resolve_model(settings.base_model))
    tokenized = tokenize_pairs(load_pairs(settings.dataset.path), tokenizer, settings.max_seq_len)
    plan = plan_batches(tokenized.num_rows, settings.minibatch_size, steps, config.run.seed)
    # Same initial weights as the flow's init-model task: base model + the seeded head.
    store = ObjectStore("memory://bench-bare")
    inputs = TrainingInputs(store, config, training_identity(config),
                            {"tokenized": store.put_table(tokenized), "plan": store.put_table(plan)})
    trainer = RewardModelTrainer.from_checkpoint(inputs, RewardModelTrainer.initial(inputs).checkpoint_id)
    model, optimizer = trainer.model, trainer.optimizer
    batches = [collate_pairs(tokenized, plan.column("row_indices")[i].as_py(), tokenizer.pad_token_id)
               for i in range(steps)]

    started = time.perf_counter()
    model.train()
    for step, batch in enumerate(batches, start=1):
        set_lr(optimizer, lr_at(step, settings.optimizer, steps))
        torch.manual_seed(seed_for_step(config.run.seed, step))
        r_chosen, r_rejected = forward_pairs(model, batch)
        loss = bradley_terry_batch_mean(r_chosen, r_rejected, batch.margin, settings.center_rewards_coefficient)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.optimizer.max_grad_norm)
        optimizer.step()
    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import save_file
        from rollout_lib.checkpoint import model_weights

        save_file(model_weights(model), f"{tmp}/model.safetensors")
    return time.perf_counter() - started


def flow_loop(config_path: str, overrides: list[str]) -> float:
    """The train-rm flow against the project's Prefect server; returns its training-loop seconds."""
    from rollout_cli.local_server import use_prefect_api

    use_prefect_api()
    from flows.train_rm import train_rm

    return train_rm(config=config_path, overrides=overrides)["train_seconds"]


def measure(kind: str, config_path: str, steps: int, checkpoint_interval: int | None) -> float:
    """One measurement, in this process, in a store of its own (so nothing comes back from cache)."""
    from rollout_lib.config import RmConfig
    from rollout_lib.plan_checks import load_config

    with tempfile.TemporaryDirectory() as store:
        overrides = [f"algorithm.rm.budget.max_steps={steps}", f"run.store={store}", "run.name=bench-rm"]
        if checkpoint_interval:
            overrides.append(f"algorithm.rm.checkpoint_interval={checkpoint_interval}")
        if kind == "bare":
            return bare_loop(load_config(RmConfig, config_path, overrides), steps)
        return flow_loop(config_path, overrides)


def measure_in_subprocess(kind: str, args) -> float:
    command = [sys.executable, __file__, "--measure", kind, "--config", args.config, "--steps", str(args.steps)]
    if args.checkpoint_interval:
        command += ["--checkpoint-interval", str(args.checkpoint_interval)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench: the {kind} measurement failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/rm-default.toml")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the config's max_steps)")
    parser.add_argument("--repeats", type=int, default=3, help="bare/flow pairs, alternating")
    parser.add_argument("--checkpoint-interval", type=int, default=None,
                        help="snapshot interval for the flow (default: the config's)")
    parser.add_argument("--measure", choices=("bare", "flow"), help=argparse.SUPPRESS)  # one child measurement
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.steps is None:
        from rollout_lib.config import RmConfig
        from rollout_lib.plan_checks import load_config

        args.steps = load_config(RmConfig, args.config).settings.budget.max_steps
    if args.measure:
        print(json.dumps({"seconds": measure(args.measure, args.config, args.steps, args.checkpoint_interval)}))
        return

    from rollout_cli.local_server import use_prefect_api
    from rollout_lib.config import RmConfig
    from rollout_lib.plan_checks import load_config

    config = load_config(RmConfig, args.config, [f"algorithm.rm.budget.max_steps={args.steps}"])
    settings = config.settings
    pairs = args.steps * settings.minibatch_size
    use_prefect_api()  # started once here, so no flow measurement includes a server start
    print(f"model {settings.base_model.uri}, {args.steps} steps x {settings.minibatch_size} pairs, snapshot every "
          f"{args.checkpoint_interval or settings.checkpoint_interval} steps, {args.repeats} alternating pairs",
          flush=True)
    ratios, rates = [], {"bare": [], "flow": []}
    for repeat in range(1, args.repeats + 1):
        seconds = {kind: measure_in_subprocess(kind, args) for kind in ("bare", "flow")}
        for kind in rates:
            rates[kind].append(pairs / seconds[kind])
        ratios.append(rates["flow"][-1] / rates["bare"][-1])
        print(f"  pair {repeat}: bare {rates['bare'][-1]:6.1f} pairs/s ({seconds['bare']:.1f} s), "
              f"flow {rates['flow'][-1]:6.1f} pairs/s ({seconds['flow']:.1f} s), ratio {ratios[-1]:.3f}", flush=True)
    print(f"  bare torch loop : {statistics.median(rates['bare']):8.1f} pairs/s (median)")
    print(f"  train-rm flow   : {statistics.median(rates['flow']):8.1f} pairs/s (median)")
    print(f"  ratio flow/bare : {statistics.median(ratios):8.3f}  (median of pairs; target >= 0.95)")


if __name__ == "__main__":
    main()
