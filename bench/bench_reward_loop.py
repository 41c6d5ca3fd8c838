"""Throughput of the reward loop on a latency-bound reward (each call waits 50 ms, like an LLM judge).

Sequential (one call at a time) vs the loop at --concurrency, in one run; target: >= 20x at concurrency 32.
Then the same with a sync 50 ms function through the killable process pool, reported only (its speed-up is
bounded by --sync-workers, not by the concurrency).

    .venv/bin/python bench/bench_reward_loop.py [--n 256] [--concurrency 32] [--sleep-s 0.05] [--sync-workers 8]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

# The latency-bound rewards live with the tests' example rewards (tests/example_rewards.py), outside the library;
# worker processes inherit this path and import them from there.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from example_rewards import async_sleep_then_one, sleep_then_one  # noqa: E402

from rollout_lib.reward.functions import RewardInput  # noqa: E402
from rollout_lib.reward.loop import RewardLoop  # noqa: E402


def _items(n: int, sleep_s: float) -> list[RewardInput]:
    return [RewardInput(prompt=[], completion_text=f"c{i}", info={"sleep_s": sleep_s}) for i in range(n)]


async def _sequential(items: list[RewardInput]) -> None:
    for item in items:
        await async_sleep_then_one(item)


def _timed_loop(loop: RewardLoop, items: list[RewardInput]) -> float:
    start = time.perf_counter()
    results = loop.score(items)
    elapsed = time.perf_counter() - start
    missing = sum(r.reward is None for r in results)
    if missing:
        raise SystemExit(f"{missing} rewards missing, e.g. {next(r.error for r in results if r.error)}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sleep-s", type=float, default=0.05)
    parser.add_argument("--sync-workers", type=int, default=8)
    parser.add_argument("--skip-sync", action="store_true")
    args = parser.parse_args()
    items = _items(args.n, args.sleep_s)

    start = time.perf_counter()
    asyncio.run(_sequential(items))
    sequential_s = time.perf_counter() - start
    with RewardLoop([(async_sleep_then_one, 1.0)], concurrency=args.concurrency, timeout_s=10) as loop:
        loop_s = _timed_loop(loop, items)
    ratio = sequential_s / loop_s
    print(f"async {args.sleep_s * 1000:.0f} ms reward, n={args.n}")
    print(f"  sequential:          {args.n / sequential_s:8.1f} rollouts/s ({sequential_s:.2f} s)")
    print(f"  loop concurrency={args.concurrency}: {args.n / loop_s:8.1f} rollouts/s ({loop_s:.2f} s)")
    print(f"  speed-up:            {ratio:8.1f}x  (target >= 20x: {'ok' if ratio >= 20 else 'MISSED'})")

    if args.skip_sync:
        return
    with RewardLoop(
        [(sleep_then_one, 1.0)], concurrency=args.concurrency, timeout_s=10, sync_workers=args.sync_workers
    ) as loop:
        warm_s = _timed_loop(loop, items[: args.sync_workers * 2])  # start the worker processes untimed
        sync_s = _timed_loop(loop, items)
    print(f"sync {args.sleep_s * 1000:.0f} ms reward through the process pool, {args.sync_workers} workers")
    print(f"  worker start-up:     {warm_s:8.2f} s (once per RewardLoop)")
    print(f"  loop concurrency={args.concurrency}: {args.n / sync_s:8.1f} rollouts/s ({sync_s:.2f} s), "
          f"{sequential_s / sync_s:.1f}x sequential")


if __name__ == "__main__":
    main()
