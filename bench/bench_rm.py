"""Reward-model training throughput: the train-rm flow against a bare hand-written torch loop, side by side.

Both train the same model from the same initial weights on the same batches with the same optimizer and
learning-rate schedule. The flow's time covers its whole training loop (every Prefect task run, the per-step
pending records, the snapshots every `checkpoint_interval` steps and the progress artifact); the bare loop is
forward, Bradley-Terry loss, backward, clip, step, nothing else, plus one final save. Prints pairs/s of each and
the ratio (target: flow >= 0.9x bare).

    .venv/bin/python bench/bench_rm.py [--config configs/rm-default.toml] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
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

    from rollout_lib.config import training_hash
    from rollout_lib.data import load_pairs
    from rollout_lib.losses import bradley_terry_batch_mean
    from rollout_lib.model.loading import load_tokenizer, resolve_model
    from rollout_lib.rm import RewardModelTrainer, RmRun, collate_pairs, forward_pairs, plan_batches, tokenize_pairs
    from rollout_lib.store import ObjectStore
    from rollout_lib.trainer.determinism import seed_for_step
    from rollout_lib.trainer.optim import lr_at, set_lr

    settings = config.settings
    tokenizer = load_tokenizer(resolve_model(settings.base_model))
    tokenized = tokenize_pairs(load_pairs(settings.dataset.path), tokenizer, settings.max_seq_len)
    plan = plan_batches(tokenized.num_rows, settings.minibatch_size, steps, config.run.seed)
    # Same initial weights as the flow's init-model task: base model + the seeded head.
    store = ObjectStore("memory://bench-bare")
    run = RmRun(store, config, training_hash(config), store.put_table(tokenized), store.put_table(plan))
    trainer = RewardModelTrainer.from_checkpoint(run, RewardModelTrainer.initial_checkpoint(run))
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
        from rollout_lib.trainer.checkpoint import model_weights

        save_file(model_weights(model), f"{tmp}/model.safetensors")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/rm-default.toml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-interval", type=int, default=None,
                        help="snapshot interval for the flow (default: the config's)")
    args = parser.parse_args()
    os.chdir(ROOT)

    from rollout_lib.config import RmConfig, load_config

    with tempfile.TemporaryDirectory() as store:
        overrides = [f"algorithm.rm.budget.max_steps={args.steps}", f"run.store={store}", "run.name=bench-rm"]
        if args.checkpoint_interval:
            overrides.append(f"algorithm.rm.checkpoint_interval={args.checkpoint_interval}")
        config = load_config(RmConfig, args.config, overrides)
        pairs = args.steps * config.settings.minibatch_size

        bare_seconds = bare_loop(config, args.steps)

        from flows.local_server import use_prefect_api

        use_prefect_api()
        from flows.train_rm import train_rm

        result = train_rm(config=args.config, overrides=overrides)
        flow_seconds = result["train_seconds"]

    bare_rate, flow_rate = pairs / bare_seconds, pairs / flow_seconds
    print(f"model {config.settings.base_model.uri}, {args.steps} steps x {config.settings.minibatch_size} pairs, "
          f"snapshot every {config.settings.checkpoint_interval} steps")
    print(f"  bare torch loop : {bare_rate:8.1f} pairs/s ({bare_seconds:.1f} s)")
    print(f"  train-rm flow   : {flow_rate:8.1f} pairs/s ({flow_seconds:.1f} s)")
    print(f"  ratio flow/bare : {flow_rate / bare_rate:8.3f}  (target >= 0.9)")


if __name__ == "__main__":
    main()
