"""k = 1 with the sampler's logprobs ("fast") against k = 1 with the trainer's recompute + TIS: step time and learning
(issue 43).

rl-smollm2 (SmolLM2-135M, GRPO, the policy on a vLLM server, as the config has it) at `max_off_policy_steps = 1`,
two runs of the same config, each in a store of its own, one after the other:

    sampler       behaviour_logprobs = "sampler": the ratio's denominator is the engine's report, no recompute (the
                  DPPO trust region on π_θ / μ_sampler; not bit-stable on resume: the engine's bits vary with batch
                  composition)
    trainer-tis   behaviour_logprobs = "trainer" + correction tis (cap 2): π_old is the trainer's recompute under the
                  weights that sampled (one no-grad forward a step, overlapped with sampling), each token reweighted
                  by min(exp(π_old - μ_sampler), 2)
    trainer       (optional) the recompute without a correction: rollout's default at k = 1

Per run: the wall time of each step (the metrics file's wall_time stamps: the time between consecutive steps' lines,
step 1 measured from the run's start), its median over steps 2..N, the whole run's wall, the training reward per
step, the held-out reward (greedy, the config's eval set, every 5 steps), and the mean per step of the mismatch
diagnostics the run reports (`mismatch/kl`, `mismatch/clipped_fraction`; `behaviour/sampler_kl` where the trainer
recomputes). A step-time comparison means something only on a quiet machine: state the load with the figures.

    .venv/bin/python bench/bench_tis_k1.py [--steps 25] [--modes sampler,trainer-tis] [--out bench-tis.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rl_runs import timed_rl_run  # noqa: E402 - bench/, on the path just above

CONFIG = "configs/rl-smollm2.toml"
K1 = "algorithm.rl.max_off_policy_steps=1"
MODES = {
    "sampler": [K1, 'algorithm.rl.behaviour_logprobs="sampler"'],
    "trainer-tis": [K1, 'algorithm.rl.behaviour_logprobs="trainer"',
                    'algorithm.rl.loss.correction={ type = "tis", cap = 2.0 }'],
    "trainer": [K1, 'algorithm.rl.behaviour_logprobs="trainer"'],
}
DIAGNOSTICS = ("mismatch/kl", "mismatch/ratio_max", "mismatch/clipped_fraction", "behaviour/sampler_kl")


def run(mode: str, steps: int) -> dict:
    """One run of `mode`: its per-step records, its step-0 records and wall times."""
    return timed_rl_run(CONFIG, f"bench-tis-{mode}", steps,
                        [*MODES[mode], f"algorithm.rl.envs[0].eval.every={min(5, steps)}"])


def held_out(record: dict) -> float | None:
    return next((value for key, value in record.items() if key.startswith("eval/") and key.endswith("/reward_mean")),
                None)


def _mean(records: list[dict], name: str) -> str:
    values = [record[name] for record in records if name in record]
    return f"{statistics.mean(values):.2e}" if values else "-"


def report(results: dict[str, dict]) -> str:
    lines = ["| mode | median step (s), steps 2.. | run wall (s) | reward, first -> last step | "
             + " | ".join(f"{name}, mean" for name in DIAGNOSTICS) + " |",
             "|---|---|---|---|" + "---|" * len(DIAGNOSTICS)]
    for mode, result in results.items():
        records = result["records"]
        rewards = [record.get("reward_mean") for record in records]
        lines.append(f"| {mode} | {statistics.median(result['step_s'][1:] or result['step_s']):.1f} | "
                     f"{result['wall']:.0f} | {rewards[0]:.3f} -> {rewards[-1]:.3f} | "
                     + " | ".join(_mean(records, name) for name in DIAGNOSTICS) + " |")
    steps = len(next(iter(results.values()))["records"])
    evaluated = [0, *[record["step"] for record in next(iter(results.values()))["records"]
                      if held_out(record) is not None]]
    held = ["", "held-out reward (greedy):", "", "| mode | " + " | ".join(f"step {step}" for step in evaluated) + " |",
            "|---|" + "---|" * len(evaluated)]
    curve = ["", "training reward per step:", "", "| mode | " + " | ".join(str(s) for s in range(1, steps + 1)) + " |",
             "|---|" + "---|" * steps]
    for mode, result in results.items():
        by_step = {0: next((held_out(record) for record in result["before"]), None),
                   **{record["step"]: held_out(record) for record in result["records"]}}
        held.append(f"| {mode} | " + " | ".join(f"{by_step.get(step):.3f}" if by_step.get(step) is not None else "-"
                                               for step in evaluated) + " |")
        curve.append(f"| {mode} | " + " | ".join(f"{record.get('reward_mean', float('nan')):.3f}"
                                               for record in result["records"]) + " |")
    return "\n".join(lines + held + curve)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--modes", default="sampler,trainer-tis", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    chosen = args.modes.split(",")
    unknown = [mode for mode in chosen if mode not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; one of {', '.join(MODES)}")
    load_before = os.getloadavg()[0]
    results = {}
    for mode in chosen:
        results[mode] = run(mode, args.steps)
        print(report(results), flush=True)  # the table so far
    text = (f"{CONFIG}, max_off_policy_steps = 1, {args.steps} steps; load average before {load_before:.2f}, after "
            f"{os.getloadavg()[0]:.2f}\n\n{report(results)}\n")
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
