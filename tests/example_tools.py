"""Tools for the tool-call tests (tests/test_tool_calls.py): one that raises, one that hangs, an async one. A user's
module of tools looks the same: typed functions with Google-style docstrings, named "module:function"."""

from __future__ import annotations

import asyncio
import time


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: what the error says
    """
    raise RuntimeError(reason)


def hang(seconds: float) -> str:
    """Sleeps past any sensible limit.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke up"


async def add(a: int, b: int) -> int:
    """Adds two integers, asynchronously.

    Args:
        a: the first
        b: the second
    """
    await asyncio.sleep(0)
    return a + b
