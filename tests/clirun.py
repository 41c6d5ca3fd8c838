"""Run the `rollout` CLI as a user would: a subprocess against the session's Prefect server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rollout_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]


def cli_env(**extra: str) -> dict:
    return {**os.environ, "PREFECT_LOGGING_LEVEL": "INFO", **extra}


def run_rollout(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(rollout_command(*args), cwd=ROOT, env=cli_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def final_result(completed: subprocess.CompletedProcess) -> dict:
    """The JSON block the CLI prints on success."""
    out = completed.stdout
    start = out.index("{\n")
    return json.loads(out[start:out.index("\n}", start) + 2])
