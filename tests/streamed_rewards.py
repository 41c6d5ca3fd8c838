"""Reward functions for the streamed-scoring tests and bench (tests/test_streamed_scoring.py,
bench/bench_streamed_scoring.py): rl-tiny's target_length, taking its time as a sandbox or a judge would, and one
that notes when each call started. Module-level, so the sync ones run in reward worker processes."""

from __future__ import annotations

import asyncio
import os
import time

from rollout_lib.reward.functions import RewardInput, target_length

STARTED: list[float] = []  # time.monotonic() of each recorded_target_length call, in this process


def slow_target_length(inp: RewardInput, *, sleep_s: float = 0.2, target: int = 12, unit: str = "words") -> float:
    """Sync: blocks `sleep_s` seconds, then target_length. With STREAMED_REWARD_CALLS set, each call that returns
    adds a line to that file (a test counts them to SIGKILL a run mid-stage)."""
    time.sleep(sleep_s)
    if os.environ.get("STREAMED_REWARD_CALLS"):
        with open(os.environ["STREAMED_REWARD_CALLS"], "a") as calls:
            calls.write("call\n")
    return target_length(inp, target=target, unit=unit)


async def async_slow_target_length(inp: RewardInput, *, sleep_s: float = 0.5, target: int = 12,
                                   unit: str = "words") -> float:
    """Async: awaits `sleep_s` seconds (a judge's request), then target_length."""
    await asyncio.sleep(sleep_s)
    return target_length(inp, target=target, unit=unit)


async def recorded_target_length(inp: RewardInput, *, target: int = 12, unit: str = "words") -> float:
    STARTED.append(time.monotonic())
    await asyncio.sleep(0.05)
    return target_length(inp, target=target, unit=unit)
