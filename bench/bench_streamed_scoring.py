"""Scoring while sampling (`algorithm.rl.reward_loop.streamed`), measured: an rl-tiny-shaped step's wall time
streamed vs staged, side by side, for a reward that takes --sync-s seconds a call in a worker process (sync) and
one that awaits --async-s seconds (async, a judge's request), the policy sampling on the engine (vLLM's CPU build,
`policy_sampler.type = "vllm"`) or embedded (--sampler hf).

A step is what train-rl's tasks run, called in this process without Prefect (their `.fn`): staged, sample then
score (after the last rollout) then advantages, pack, train; streamed, sample-and-score (each rollout scored as it
comes back) then score-merge, advantages, pack, train. Each variant runs --steps steps from the initial policy, on
one policy server started once; step 1 (the engine's warm-up) is not counted; the figures are medians over steps
2.. and the variants alternate (--repeats times) so that load drifting on the machine hits both alike.

    .venv/bin/python bench/bench_streamed_scoring.py [--sampler vllm|hf] [--steps 4] [--repeats 2]
        [--prompts 4] [--group 8] [--max-tokens 16] [--engine-concurrency 8] [--sync-s 0.2] [--async-s 0.5]
        [--sync-workers 8]

`--engine-concurrency`: requests the engine serves at once (`policy_sampler.concurrency`); below the step's
rollouts, completions come back in waves, as on an engine whose KV cache holds part of a step (the tiny random
policy never stops early, so with every request in one batch all completions land at the same decode step and
there is nothing to overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/: the slow reward functions (streamed_rewards.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def bench_config(args, store: str, reward: str):
    from rollout_lib.config import RlConfig, load_config

    sleep_s = args.sync_s if reward == "sync" else args.async_s
    function = "streamed_rewards:slow_target_length" if reward == "sync" else \
        "streamed_rewards:async_slow_target_length"
    sampler = (f'{{ type = "vllm", concurrency = {args.engine_concurrency}, timeout_s = 600 }}'
               if args.sampler == "vllm" else f'{{ type = "hf", batch_size = {args.hf_batch} }}')
    return load_config(RlConfig, ROOT / "configs/rl-tiny.toml", [
        f"run.store={store}", f"algorithm.rl.policy_sampler={sampler}",
        f"algorithm.rl.envs[0].prompts_per_step={args.prompts}",
        f"algorithm.rl.envs[0].sampling={{ group_size = {args.group}, temperature = 1.0, "
        f"max_tokens = {args.max_tokens} }}",
        f'algorithm.rl.envs[0].rewards=[{{ function = "{function}", kwargs = {{ sleep_s = {sleep_s}, '
        f'target = 12 }} }}]',
        f"algorithm.rl.reward_loop.sync_workers={args.sync_workers}",
    ])


def run_variant(cfg, steps: int, streamed: bool, resident, served, loops) -> list[dict]:
    """`steps` steps from the initial policy, as train-rl's tasks run them: each step's wall time and stage times."""
    from rollout_lib.rl.prompts import load_prompts
    from tasks.common import open_store
    from tasks.rl import (
        advantages_task,
        init_policy_task,
        pack_task,
        sample_and_score_task,
        sample_task,
        score_merge_task,
        score_task,
        train_step_task,
    )

    store = open_store(cfg)
    prompts = {env.name: store.put_table(load_prompts(env)) for env in cfg.settings.envs}
    state = init_policy_task.fn(cfg, prompts, resident)["checkpoint"]
    records = []
    for step in range(1, steps + 1):
        began = time.perf_counter()
        if streamed:
            sampled = sample_and_score_task.fn(cfg, prompts, state, step, resident, served, loops)
            scored = score_merge_task.fn(cfg, sampled["rollouts"], step, [sampled["rewards"]])
        else:
            sampled = sample_task.fn(cfg, prompts, state, step, resident, served)
            scored = score_task.fn(cfg, prompts, sampled["rollouts"], step, loops)
        scoring_done = time.perf_counter()
        samples = advantages_task.fn(cfg, prompts, state, scored["rollouts"], step, resident, served)
        packed = pack_task.fn(cfg, samples["samples"], step)
        trained = train_step_task.fn(cfg, prompts, state, packed["micro_batches"], step, resident)
        state = trained["state"]
        records.append({"step_s": time.perf_counter() - began, "sample_score_s": scoring_done - began,
                        "sample_s": sampled["metrics"]["sample_s"], "scored": scored["rollouts"],
                        "reward_mean": scored["metrics"]["reward_mean"]})
    return records


def median(records: list[dict], key: str) -> float:
    return statistics.median(record[key] for record in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sampler", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engine-concurrency", type=int, default=8)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--sync-s", type=float, default=0.2)
    parser.add_argument("--async-s", type=float, default=0.5)
    parser.add_argument("--sync-workers", type=int, default=8)
    parser.add_argument("--rewards", default="sync,async")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    os.chdir(ROOT)

    import torch

    from rollout_lib.rl.score import run_reward_loops
    from rollout_lib.serving.served import ServedModels
    from rollout_lib.trainer.resident import ResidentTrainer

    torch.set_num_threads(2)
    figures = {}
    with tempfile.TemporaryDirectory(prefix="bench-streamed-") as store, ServedModels(store) as served:
        for reward in args.rewards.split(","):
            cfg = bench_config(args, store, reward)
            runs: dict[str, list[dict]] = {"staged": [], "streamed": []}
            with ResidentTrainer() as resident, run_reward_loops(cfg, served) as loops:
                for repeat in range(args.repeats):
                    for variant in ("staged", "streamed") if repeat % 2 == 0 else ("streamed", "staged"):
                        records = run_variant(cfg, args.steps, variant == "streamed", resident, served, loops)
                        runs[variant].extend(records[1:])  # step 1 warms the engine (and the workers) up
                        print(f"{reward} {variant:>8} repeat {repeat}: steps "
                              + " ".join(f"{r['step_s']:.2f}" for r in records) + " s (sample+score "
                              + " ".join(f"{r['sample_score_s']:.2f}" for r in records) + ")", flush=True)
            staged, streamed = runs["staged"], runs["streamed"]
            same_rewards = [r["reward_mean"] for r in staged[:args.steps - 1]] == \
                [r["reward_mean"] for r in streamed[:args.steps - 1]]
            figures[reward] = {
                "staged_step_s": median(staged, "step_s"), "streamed_step_s": median(streamed, "step_s"),
                "staged_sample_score_s": median(staged, "sample_score_s"),
                "streamed_sample_score_s": median(streamed, "sample_score_s"),
                "sample_s": median(staged, "sample_s"),
                "ratio": median(streamed, "step_s") / median(staged, "step_s"),
                "same_rewards": same_rewards,
            }
    print(f"\nsampler: {args.sampler}; {args.prompts} prompts x {args.group} samples x {args.max_tokens} tokens; "
          f"medians over steps 2..{args.steps}, {args.repeats} runs of each variant")
    print(f"{'reward':<28} {'staged step':>12} {'streamed step':>14} {'ratio':>6}   (sampling alone; sample+score "
          "staged / streamed)")
    for reward, f in figures.items():
        label = f"sync {args.sync_s} s ({args.sync_workers} workers)" if reward == "sync" else \
            f"async {args.async_s} s"
        print(f"{label:<28} {f['staged_step_s']:>11.2f}s {f['streamed_step_s']:>13.2f}s {f['ratio']:>6.2f}   "
              f"({f['sample_s']:.2f} s; {f['staged_sample_score_s']:.2f} / {f['streamed_sample_score_s']:.2f} s)"
              f"{'' if f['same_rewards'] else '  REWARDS DIFFER'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
