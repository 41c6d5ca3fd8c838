"""One timed `rollout train rl` run for the RL benches (bench_partial_rollouts.py, bench_tis_k1.py): the CLI in a
fresh store, its per-step records read back and each step's wall time from the metrics file's stamps."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed_rl_run(config: str, name: str, steps: int, overrides: list[str]) -> dict:
    """`records` (steps >= 1), `before` (the step-0 held-out record), `wall` (the command's seconds) and `step_s`
    (each step's seconds: between consecutive steps' stamps, step 1 from the command's start)."""
    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.store import ObjectStore

    with tempfile.TemporaryDirectory() as store:
        command = [sys.executable, "-m", "rollout_cli", "train", "rl", "--config", config, "--max-steps", str(steps)]
        for override in [*overrides, f"run.store={store}", f"run.name={name}"]:
            command += ["--set", override]
        started = time.time()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = time.time() - started
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
        every = read_metrics(ObjectStore(store), name)
    records = [record for record in every if record["step"] >= 1]
    stamps = [started] + [record["wall_time"] for record in records]
    return {"records": records, "before": [record for record in every if record["step"] == 0], "wall": wall,
            "step_s": [b - a for a, b in zip(stamps, stamps[1:])]}
