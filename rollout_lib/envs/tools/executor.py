"""Running one tool call: the function with the model's arguments, in a thread of its own, for at most
`timeout_s` seconds. Whatever goes wrong (arguments the function does not take, an exception, the time limit) is
the result the model reads, `error: ...`, never an episode's failure.

A sync function runs in a daemon thread and an async one on its own event loop in such a thread, so the episode
driver (sync, maybe inside a sampler's event loop) waits on neither for longer than the limit. A sync function
past its limit cannot be stopped: its thread is left to finish (or hang) on its own; an async one is cancelled."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from dataclasses import dataclass
from typing import Any

from rollout_lib.envs.tools.toolbox import Tool


@dataclass(frozen=True)
class CallResult:
    content: str  # what the tool message says
    failed: bool


def run_call(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> CallResult:
    try:
        inspect.signature(tool.function).bind(**arguments)
    except TypeError as exc:
        return CallResult(f"error: {tool.name}: bad arguments ({exc})", True)
    except ValueError:  # no signature to check against (some builtins): the call itself says
        pass
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            if tool.is_async:
                outcome["value"] = asyncio.run(asyncio.wait_for(tool.function(**arguments), timeout_s))
            else:
                outcome["value"] = tool.function(**arguments)
        except BaseException as exc:  # the tool's failure is the model's to read
            outcome["error"] = exc

    thread = threading.Thread(target=call, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() or isinstance(outcome.get("error"), asyncio.TimeoutError):
        return CallResult(f"error: {tool.name} timed out after {timeout_s:g} s", True)
    if "error" in outcome:
        exc = outcome["error"]
        return CallResult(f"error: {tool.name} raised {type(exc).__name__}: {exc}", True)
    return CallResult(as_text(outcome["value"]), False)


def as_text(value: Any) -> str:
    """A tool's return value as the tool message's content: a string as it is, anything else as JSON (or str)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)
