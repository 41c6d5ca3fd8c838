"""Example reward functions for the tests and benchmarks, kept out of the library: `command_succeeds` runs a
command taken from a dataset row, which no library path may do.

A user's own module looks the same: module-level functions taking a RewardInput, referenced in config as
"my_pkg.rewards:name". Sync ones run in worker processes, which import them by name: pytest puts tests/ on
sys.path (the workers inherit it); a CLI subprocess gets `PYTHONPATH=tests` and the reference
"example_rewards:name"; bench/ adds tests/ itself.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

from rollout_lib.reward.functions import RewardInput


def sleep_then_one(inp: RewardInput) -> float:
    """Sync, latency-bound: sleeps info["sleep_s"] seconds (default 0.05), then 1.0. 1000 s = a hung call."""
    time.sleep(float(inp.info.get("sleep_s", 0.05)))
    return 1.0


async def async_sleep_then_one(inp: RewardInput) -> float:
    """The async twin of sleep_then_one, the shape of a call to an LLM judge or a sandbox."""
    await asyncio.sleep(float(inp.info.get("sleep_s", 0.05)))
    return 1.0


def always_zero(inp: RewardInput) -> float:
    """0 for every completion: every group's rewards equal, so no rl signal (the collapse guard's test)."""
    return 0.0


def always_fails(inp: RewardInput) -> float:
    """Raises: the loop records a missing reward with this error text."""
    raise ValueError(f"cannot score completion of length {len(inp.completion_text)}")


def crash_worker(inp: RewardInput) -> float:
    """Ends its process abruptly, as a segfaulting extension would."""
    os._exit(3)


def completion_length(inp: RewardInput) -> float:
    """Sync and instant: the completion's length in characters."""
    return float(len(inp.completion_text))


def worker_pid(inp: RewardInput) -> float:
    """Which process ran the call (sync functions run in worker processes, never in the caller)."""
    return float(os.getpid())


def command_succeeds(inp: RewardInput) -> float:
    """Sandbox-style: 1.0 when the argv in info["command"] exits 0, else 0.0. On timeout the whole worker
    process group is killed, so the command dies with it."""
    return float(subprocess.run(inp.info["command"], stdin=subprocess.DEVNULL).returncode == 0)


def words_unless_length_divides_by_4(inp: RewardInput) -> float:
    """A completion's word count / 16, except that it raises for a completion whose length in characters is a
    multiple of 4: a reward that fails for some samples and not others (tests/test_run_samples.py)."""
    if len(inp.completion_text) % 4 == 0:
        raise ValueError(f"refusing a completion of {len(inp.completion_text)} characters")
    return len(inp.completion_text.split()) / 16


def words_unless_prompt_words_even(inp: RewardInput) -> float:
    """A completion's word count / 16, except 0.0 for every completion of a prompt with an even number of words:
    a reward whose groups are uniform for some prompts (tests/test_dynamic_sampling.py)."""
    if len(inp.prompt[-1]["content"].split()) % 2 == 0:
        return 0.0
    return len(inp.completion_text.split()) / 16
