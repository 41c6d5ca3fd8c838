"""Sync, k-lag and partial rollouts side by side on a long-tailed task: step time and learning (issue 43).

rl-smollm2 (SmolLM2-135M, GRPO, the policy on a vLLM server) with `max_tokens` raised to 256: most answers are a few
tokens, but at temperature 0.7 some samples ramble to the limit, so a synchronous step waits for its longest
completion. Three runs of the same config, each in a store of its own, one after the other:

    sync      max_off_policy_steps = 0: sample, then train, each step
    k-lag     max_off_policy_steps = 1: step n+1 samples (with the state before step n) while step n trains
    partial   k = 1 and partial_rollouts = { token_budget = B }: each policy version continues every request for at
              most B new tokens, carrying the rest to the next version (rl/partial.py), so a stage waits for B
              tokens, not for the longest completion

Per run: the wall time of each step (from the metrics file's wall_time stamps: the time between consecutive steps'
lines, step 1 measured from the run's start), its median over steps 2..N, the whole run's wall, the training reward
per step, the held-out reward (greedy, the config's eval set) before step 1 and at the end, and `staleness_max`.
A step-time comparison means something only on a quiet machine: state the load with the figures.

    .venv/bin/python bench/bench_partial_rollouts.py [--steps 10] [--budget 32] [--max-tokens 256]
                                                     [--modes sync,k-lag,partial] [--out bench-partial.md]
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


def modes(budget: int) -> dict[str, list[str]]:
    return {
        "sync": ["algorithm.rl.max_off_policy_steps=0"],
        "k-lag": ["algorithm.rl.max_off_policy_steps=1"],
        "partial": ["algorithm.rl.max_off_policy_steps=1",
                    f"algorithm.rl.partial_rollouts={{ token_budget = {budget} }}"],
    }


def run(mode: str, overrides: list[str], steps: int, max_tokens: int) -> dict:
    """One run of `mode`: its per-step records and wall times."""
    sampling = f"{{ group_size = 8, temperature = 0.7, max_tokens = {max_tokens} }}"
    return timed_rl_run(CONFIG, f"bench-partial-{mode}", steps,
                        [*overrides, "algorithm.rl.max_seq_len=384", f"algorithm.rl.envs[0].sampling={sampling}",
                         f"algorithm.rl.envs[0].eval.every={steps}"])


def staleness(records: list[dict]) -> str:
    """The largest staleness of a trained token (partial rollouts' staleness_max), else the schedule's lag."""
    if any("staleness_max" in record for record in records):
        return str(max(record.get("staleness_max", 0) for record in records))
    return f"{max(record.get('staleness_mean', 0) for record in records):g} (lag)"


def held_out(record: dict) -> float | None:
    return next((value for key, value in record.items() if key.startswith("eval/") and key.endswith("/reward_mean")),
                None)


def report(results: dict[str, dict]) -> str:
    lines = ["| mode | median step (s), steps 2.. | run wall (s) | reward, first -> last step | held-out, before -> "
             "end | staleness, max |", "|---|---|---|---|---|---|"]
    for mode, result in results.items():
        records = result["records"]
        rewards = [record.get("reward_mean") for record in records]
        before = next((held_out(record) for record in result["before"]), None)
        lines.append(f"| {mode} | {statistics.median(result['step_s'][1:] or result['step_s']):.1f} | "
                     f"{result['wall']:.0f} | {rewards[0]:.3f} -> {rewards[-1]:.3f} | "
                     f"{before if before is not None else '-'} -> {held_out(records[-1]) or '-'} | "
                     f"{staleness(records)} |")
    curve = ["", "training reward per step:", "", "| mode | " + " | ".join(
        str(step) for step in range(1, len(next(iter(results.values()))["records"]) + 1)) + " |"]
    for mode, result in results.items():
        curve.append(f"| {mode} | " + " | ".join(f"{record.get('reward_mean', float('nan')):.3f}"
                                               for record in result["records"]) + " |")
    return "\n".join(lines + curve)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget", type=int, default=32, help="partial rollouts' token_budget")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--modes", default="sync,k-lag,partial")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    chosen = modes(args.budget)
    load_before = os.getloadavg()[0]
    results = {}
    for mode in args.modes.split(","):
        results[mode] = run(mode, chosen[mode], args.steps, args.max_tokens)
        print(report(results), flush=True)  # the table so far
    text = (f"{CONFIG}, max_tokens {args.max_tokens}, {args.steps} steps, partial token_budget {args.budget}; "
            f"load average before {load_before:.2f}, after {os.getloadavg()[0]:.2f}\n\n{report(results)}\n")
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
