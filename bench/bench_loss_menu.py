"""The rl loss menu on a real model: held-out accuracy of rl-smollm2 under grpo and each loss variant.

Each run is 25 steps of SmolLM2-135M on a vLLM policy server (~15-25 minutes on a 2-core CPU), so the whole table
is hours of CPU; what has been run (which variants, which seeds, on which machine) is in docs/algorithms.md ("The
rl loss menu"), and nothing else about the variants' learning is claimed.

Runs `rollout train rl --config configs/rl-smollm2.toml` once per (variant, seed), each in a store of its own, and
prints (and writes, `--out`) a markdown table of the held-out reward (`eval/<env>/reward_mean`, the config's
greedy held-out set, evaluated before step 1 and every 5 steps) at steps 0/5/.../25:

    variant     grpo (std off, tokens normaliser: the default), 2 seeds to show the seed-to-seed spread
                gspo, cispo            `algorithm.rl.loss.type`, their default knobs
                dr_grpo                grpo + `algorithm.rl.loss.normalizer = { constant = 24 }` (the max_tokens)
                dapo                   grpo + `envs[0].dynamic_sampling = { max_rounds = 3 }` (streamed scoring)
                grpo_k1, gspo_k1,      the same with `max_off_policy_steps = 1`
                cispo_k1

    .venv/bin/python bench/bench_loss_menu.py [--seeds 42,43] [--steps 25] [--variants grpo,gspo,cispo,dr_grpo,dapo]
                                              [--out bench-loss-menu.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONFIG = "configs/rl-smollm2.toml"
VARIANTS = {
    "grpo": [],
    "gspo": ["algorithm.rl.loss.type=gspo"],
    "cispo": ["algorithm.rl.loss.type=cispo"],
    "dr_grpo": ["algorithm.rl.loss.normalizer={ constant = 24 }"],
    # DAPO's dynamic sampling: a group whose rewards are all equal is replaced by a fresh prompt's (3 rounds at
    # most); scored streamed, as when the bench was first run (every scoring runs the rounds now).
    "dapo": ["algorithm.rl.reward_loop.streamed=true", "algorithm.rl.envs[0].dynamic_sampling={ max_rounds = 3 }"],
    # Off-policy (k = 1: each batch sampled one policy version back), where the ratios move and the losses differ.
    "grpo_k1": ["algorithm.rl.max_off_policy_steps=1"],
    "gspo_k1": ["algorithm.rl.loss.type=gspo", "algorithm.rl.max_off_policy_steps=1"],
    "cispo_k1": ["algorithm.rl.loss.type=cispo", "algorithm.rl.max_off_policy_steps=1"],
}


def held_out_curve(variant: str, seed: int, steps: int) -> dict[int, float]:
    """step -> held-out reward of one run of `variant` at `seed`."""
    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.store import ObjectStore

    name = f"loss-menu-{variant}-{seed}"
    with tempfile.TemporaryDirectory() as store:
        overrides = [*VARIANTS[variant], f"run.seed={seed}", f"run.store={store}", f"run.name={name}"]
        command = [sys.executable, "-m", "rollout_cli", "train", "rl", "--config", CONFIG, "--max-steps", str(steps)]
        for override in overrides:
            command += ["--set", override]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{variant} seed {seed} failed:\n{done.stderr[-3000:]}")
        records = read_metrics(ObjectStore(store), name)
    return {record["step"]: value for record in records
            for key, value in record.items() if key.startswith("eval/") and key.endswith("/reward_mean")}


def table(curves: dict[str, dict[int, float]], steps: int) -> str:
    columns = list(range(0, steps + 1, 5))
    lines = ["| run | " + " | ".join(f"step {step}" for step in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for run, curve in curves.items():
        lines.append(f"| {run} | " + " | ".join(f"{curve[step]:.3f}" if step in curve else "-" for step in columns)
                     + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="42,43", help="grpo runs every seed; the variants the first")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    curves: dict[str, dict[int, float]] = {}
    for variant in args.variants.split(","):
        for seed in seeds if variant == "grpo" else seeds[:1]:
            curves[f"{variant} (seed {seed})"] = held_out_curve(variant, seed, args.steps)
            print(table(curves, args.steps), flush=True)  # the table so far: a long bench shows progress
    report = f"held-out reward, {CONFIG}, {args.steps} steps\n\n{table(curves, args.steps)}\n"
    if args.out is not None:
        args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
