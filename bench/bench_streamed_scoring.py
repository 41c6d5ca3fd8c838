"""Scoring while sampling (`algorithm.rl.reward_loop.streamed`), measured: an rl-tiny-shaped step's wall time
streamed vs staged, side by side, for a reward that takes --sync-s seconds a call in a worker process (sync) and
one that awaits --async-s seconds (async, a judge's request), the policy sampling on the engine (vLLM's CPU build,
`policy_sampler.type = "vllm"`) or embedded (--sampler hf).

A step is what train-rl's tasks run, called in this process without Prefect (their `.fn`). Each step's sample and
score stages run both ways from the same state, one right after the other (which goes first alternates), so that
load drifting on this shared machine hits both alike: staged, sample then score (after the last rollout);
streamed, sample-and-score (each rollout scored as it comes back) then score-merge. The policy server's reload of
the state is paid by whichever runs first; it is taken out of both and counted once, as a real step pays it. Then
advantages, pack and the train step run once: a step's time either way is its own sample+score plus that rest (the
tables are the same either way). Step 1 (the engine's and the workers' warm-up) is not counted; figures are medians
over steps 2..N. `best`: the ratio with nothing but the rewards costing time (best_ratio), from the staged step's own
sampling and rest; then each way's sampling by which way ran first (the first samples right after the reload).

    .venv/bin/python bench/bench_streamed_scoring.py [--sampler vllm|hf] [--steps 10] [--prompts 4] [--group 8]
        [--max-tokens 112] [--engine-concurrency 8] [--sync-s 0.2] [--sync-workers 8] [--async-s 0.5]
        [--async-concurrency 16] [--rewards sync,async] [--json FILE]

`--engine-concurrency`: requests the engine serves at once (`policy_sampler.concurrency`); below the step's
rollouts, completions come back in waves, as on an engine whose KV cache holds part of a step. `--sync-workers` and
`--async-concurrency` (`reward_loop.sync_workers`, `.concurrency`) make scoring throughput-bound, about as long as
sampling: a reward with room for every rollout at once costs one call's latency after sampling either way.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
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
    from rollout_lib.config import RlConfig
    from rollout_lib.plan_checks import load_config

    sleep_s = args.sync_s if reward == "sync" else args.async_s
    function = "streamed_rewards:slow_target_length" if reward == "sync" else \
        "streamed_rewards:async_slow_target_length"
    sampler = (f'{{ type = "vllm", concurrency = {args.engine_concurrency}, timeout_s = 600 }}'
               if args.sampler == "vllm" else f'{{ type = "hf", batch_size = {args.hf_batch} }}')
    return load_config(RlConfig, ROOT / "configs/rl-tiny.toml", [
        f"run.store={store}", f"algorithm.rl.policy_sampler={sampler}",
        f"algorithm.rl.max_seq_len={args.max_tokens + 48}",  # rl-tiny's prompts are under 48 tokens
        f"algorithm.rl.envs[0].prompts_per_step={args.prompts}",
        f"algorithm.rl.envs[0].sampling={{ group_size = {args.group}, temperature = 1.0, "
        f"max_tokens = {args.max_tokens} }}",
        f'algorithm.rl.envs[0].rewards=[{{ function = "{function}", kwargs = {{ sleep_s = {sleep_s}, '
        f'target = 12 }} }}]',
        f"algorithm.rl.reward_loop.sync_workers={args.sync_workers}",
        *([f"algorithm.rl.reward_loop.concurrency={args.async_concurrency}"] if reward == "async" else []),
    ])


def run_paired(cfg, steps: int, resident, served, loops) -> list[dict]:
    """`steps` steps from the initial policy, as train-rl's tasks run them, each step's sample and score stages run
    both ways from the same state (staged: sample, then score; streamed: sample-and-score, then score-merge; which
    goes first alternates), then its advantages, pack and train step once. Per step: each way's seconds to its
    scored table less the policy server's reload (paid once per state, by whichever ran first: `hold_s`), when
    its sampling ended, the rest of the step, and whether both ways scored the same rewards."""
    from rollout_lib.rl.prompts import load_prompts
    from tasks.common import open_store
    from tasks.rl import (
        RunResources,
        advantages_task,
        init_policy_task,
        pack_task,
        sample_and_score_task,
        sample_task,
        score_merge_task,
        score_task,
        train_step_task,
    )

    def staged(step: int) -> dict:
        sampled = sample_task.fn(cfg, prompts_ids=prompts, policy_state=state, step=step,
                                 resources=RunResources(resident, served, loops))
        return {"sampled": sampled, "scored": score_task.fn(cfg, prompts, sampled["rollouts"], step, loops)}

    def streamed(step: int) -> dict:
        sampled = sample_and_score_task.fn(cfg, prompts_ids=prompts, policy_state=state, step=step,
                                           resources=RunResources(resident, served, loops))
        return {"sampled": sampled, "scored": score_merge_task.fn(cfg, sampled["rollouts"], step, [sampled["rewards"]])}

    store = open_store(cfg)
    prompts = {env.name: store.put_table(load_prompts(env)) for env in cfg.settings.envs}
    state = init_policy_task.fn(cfg, prompts, resident)["checkpoint"]
    records = []
    for step in range(1, steps + 1):
        record, ways = {}, {"staged": staged, "streamed": streamed}
        order = sorted(ways, reverse=step % 2 == 0)
        for way in order:
            began = time.perf_counter()
            done = ways[way](step)
            seconds = time.perf_counter() - began
            metrics = done["sampled"]["metrics"]
            reload_s = metrics.get("policy_server/reload_s", 0.0)
            record[way] = {"seconds": seconds - reload_s, "sampled": metrics["sample_s"] - reload_s,
                           "rewards": done["scored"]["metrics"]["reward_mean"], "scored": done["scored"]}
            record["hold_s"] = max(record.get("hold_s", 0.0), reload_s)
        began = time.perf_counter()
        scored = record["staged"]["scored"]["rollouts"]
        resources = RunResources(resident, served, loops)
        samples = advantages_task.fn(cfg, prompts_ids=prompts, policy_state=state, scored_id=scored, step=step,
                                     resources=resources)
        packed = pack_task.fn(cfg, samples["samples"], step)
        state = train_step_task.fn(cfg, prompts_ids=prompts, policy_state=state, step=step, resources=resources,
                                   micro_batches_id=packed["micro_batches"])["state"]
        rest = time.perf_counter() - began + record["hold_s"]
        records.append({
            "staged_step_s": record["staged"]["seconds"] + rest, "streamed_step_s": record["streamed"]["seconds"] + rest,
            "staged_sampled_s": record["staged"]["sampled"], "streamed_sampled_s": record["streamed"]["sampled"],
            "staged_scored_s": record["staged"]["seconds"], "streamed_scored_s": record["streamed"]["seconds"],
            "same_rewards": record["staged"]["rewards"] == record["streamed"]["rewards"], "first": order[0]})
    return records


def median(records: list[dict], key: str) -> float:
    return statistics.median(record[key] for record in records)


def best_ratio(sampled_s: float, rest_s: float, rollouts: int, engine_concurrency: int, slots: int,
               call_s: float) -> float:
    """The streamed / staged step ratio at best, from the staged step's own sampling and rest: completions back
    in even waves of `engine_concurrency` over `sampled_s` (as the engine returns 112-token completions of a
    random policy), each reward `call_s` on the first of `slots` free, nothing else costing time. Staged, the
    rewards start after the last completion."""
    waves = math.ceil(rollouts / engine_concurrency)
    free = [0.0] * slots
    for row in range(rollouts):
        arrival = sampled_s * (row // engine_concurrency + 1) / waves
        heapq.heappush(free, max(arrival, heapq.heappop(free)) + call_s)
    staged = sampled_s + math.ceil(rollouts / slots) * call_s
    return (max(free) + rest_s) / (staged + rest_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sampler", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=112)
    parser.add_argument("--engine-concurrency", type=int, default=8)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--sync-s", type=float, default=0.2)
    parser.add_argument("--async-s", type=float, default=0.5)
    parser.add_argument("--sync-workers", type=int, default=8)
    parser.add_argument("--async-concurrency", type=int, default=16)
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
            with ResidentTrainer() as resident, run_reward_loops(cfg, served) as loops:
                records = run_paired(cfg, args.steps, resident, served, loops)
            for step, r in enumerate(records, 1):
                print(f"{reward} step {step}: staged {r['staged_step_s']:.2f} s (sampled at {r['staged_sampled_s']:.2f},"
                      f" scored at {r['staged_scored_s']:.2f}), streamed {r['streamed_step_s']:.2f} s (sampled at "
                      f"{r['streamed_sampled_s']:.2f}, scored at {r['streamed_scored_s']:.2f})", flush=True)
            steady = records[1:]  # step 1 warms the engine and the reward workers up
            figures[reward] = {key: median(steady, key) for key in steady[0]
                               if key not in ("same_rewards", "first")}
            figures[reward]["ratio"] = statistics.median(r["streamed_step_s"] / r["staged_step_s"] for r in steady)
            figures[reward]["same_rewards"] = all(r["same_rewards"] for r in records)
            # The way that runs first samples right after the server's reload: its sampling, by order, shows
            # whether that costs more than the reload the figures take out.
            for first in ("staged", "streamed"):
                steps = [r for r in steady if r["first"] == first]
                figures[reward][f"{first}_first_steps"] = len(steps)
                for way in ("staged", "streamed"):
                    figures[reward][f"{way}_sampled_s_{first}_first"] = median(steps, f"{way}_sampled_s") \
                        if steps else None
            slots = args.sync_workers if reward == "sync" else args.async_concurrency
            f = figures[reward]
            f["best_ratio"] = best_ratio(
                f["staged_sampled_s"], f["staged_step_s"] - f["staged_scored_s"],
                args.prompts * args.group, args.engine_concurrency if args.sampler == "vllm" else args.hf_batch,
                slots, args.sync_s if reward == "sync" else args.async_s)
    print(f"\nsampler: {args.sampler}; {args.prompts} prompts x {args.group} samples x {args.max_tokens} tokens; "
          f"medians over steps 2..{args.steps} (ratio: the median of each step's streamed / staged)")
    print(f"{'reward':<28} {'staged step':>12} {'streamed step':>14} {'ratio':>6} {'best':>5}   (sampled at, scored at: "
          "staged; streamed)")
    for reward, f in figures.items():
        label = f"sync {args.sync_s} s ({args.sync_workers} workers)" if reward == "sync" else \
            f"async {args.async_s} s ({args.async_concurrency} at once)"
        print(f"{label:<28} {f['staged_step_s']:>11.2f}s {f['streamed_step_s']:>13.2f}s {f['ratio']:>6.2f} "
              f"{f['best_ratio']:>5.2f}   "
              f"({f['staged_sampled_s']:.2f}, {f['staged_scored_s']:.2f} s; {f['streamed_sampled_s']:.2f}, "
              f"{f['streamed_scored_s']:.2f} s){'' if f['same_rewards'] else '  REWARDS DIFFER'}")
    for reward, f in figures.items():
        print(f"{reward}: sampled at, by which way ran first (staged; streamed): staged first "
              f"({f['staged_first_steps']} steps) {f['staged_sampled_s_staged_first'] or 0:.2f}; "
              f"{f['streamed_sampled_s_staged_first'] or 0:.2f} s, streamed first ({f['streamed_first_steps']} steps) "
              f"{f['staged_sampled_s_streamed_first'] or 0:.2f}; {f['streamed_sampled_s_streamed_first'] or 0:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
