"""Step time of rm-tiny with MLflow off, on (a live `mlflow server`) and on with the server dead (nothing listens at
its URI), median over steps (docs/runs.md, "Trackers"; target: on and dead <= 1.02x off, issue 41).

A step's time is the gap between consecutive records of the run's metrics file (each written as its step
completes), over one segment (no snapshot inside it), the first step left out (it pays the segment's start). The
three modes alternate `--repeats` times in one process, in an order rotated at each repeat, on a Prefect server
and an MLflow server (SQLite, one worker, from .venv-mlflow: `bash scripts/setup.sh --test`) started for the bench;
the figure to read is the
median of the per-repeat ratios. Note the machine's load (`uptime`) beside the figures.

    .venv/bin/python bench/bench_trackers.py [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
CONFIG = str(ROOT / "configs/rm-tiny.toml")


def start_mlflow(directory: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    from rollout_cli.local_server import free_port

    port = free_port()
    process = subprocess.Popen(
        [str(ROOT / ".venv-mlflow/bin/mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers",
         "1", "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}", "--artifacts-destination",
         str(directory / "artifacts")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                return process, uri
        except httpx.HTTPError:
            time.sleep(0.5)
    sys.exit("bench: the MLflow server did not start")


def step_seconds(store: str, run_name: str) -> float:
    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.store import ObjectStore

    times = [record["wall_time"] for record in read_metrics(ObjectStore(store), run_name) if record["step"] >= 1]
    return statistics.median(b - a for a, b in zip(times[1:], times[2:]))


class TrackerCpu(logging.Handler):
    """The tracker thread's CPU seconds while steps came (after it opened its run, before the run's end), from its
    closing debug line (trackers/thread.py): what the tracker costs the training loop's process, a figure the
    machine's load does not blur as it blurs step times."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seconds: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "of CPU on its thread while steps came" in record.getMessage():
            self.seconds.append(record.args[1])


def measure(steps: int, trackers: list[str], cpu: TrackerCpu) -> tuple[float, float | None]:
    """(median step seconds, the tracker thread's CPU seconds per step or None without a tracker)."""
    from flows.train_rm import train_rm

    cpu.seconds.clear()
    with tempfile.TemporaryDirectory() as store:
        overrides = [f"run.store={store}", f"algorithm.rm.budget.max_steps={steps}",
                     f"algorithm.rm.checkpoint_interval={steps}", *trackers]
        state = train_rm(config=CONFIG, overrides=overrides, return_state=True)
        state.result()
        return step_seconds(store, "rm-tiny"), (cpu.seconds[0] / steps if cpu.seconds else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.chdir(ROOT)
    from rollout_cli.local_server import free_port
    from rollout_cli.processes import stop_process_group

    with tempfile.TemporaryDirectory() as work:
        os.environ["ROLLOUT_STATE_DIR"] = work
        os.environ.pop("PREFECT_API_URL", None)
        from rollout_cli.local_server import start_server, stop_server

        server = start_server()
        os.environ.update(PREFECT_API_URL=server["api_url"], PREFECT_HOME=server["prefect_home"])
        mlflow, uri = start_mlflow(Path(work))
        dead = f"http://127.0.0.1:{free_port()}"
        modes = {"off": [],
                 "mlflow on": ['run.trackers=["mlflow"]', f'run.mlflow={{tracking_uri = "{uri}"}}'],
                 "mlflow dead": ['run.trackers=["mlflow"]', f'run.mlflow={{tracking_uri = "{dead}"}}']}
        try:
            print(f"rm-tiny, {args.steps} steps in one segment, {args.repeats} repeats; load: "
                  f"{os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}", flush=True)
            cpu = TrackerCpu()
            thread_log = logging.getLogger("rollout_lib.runlog.trackers.thread")
            thread_log.addHandler(cpu)
            thread_log.setLevel(logging.DEBUG)
            measure(4, [], cpu)  # warm: the tiny model's files, the first flow run's imports
            seconds: dict[str, list[float]] = {mode: [] for mode in modes}
            tracker_cpu: dict[str, list[float]] = {mode: [] for mode in modes}
            for repeat in range(1, args.repeats + 1):
                names = list(modes)
                order = names[repeat % 3:] + names[:repeat % 3]  # rotated: no mode always runs first
                for mode in order:
                    step, cpu_per_step = measure(args.steps, modes[mode], cpu)
                    seconds[mode].append(step)
                    if cpu_per_step is not None:
                        tracker_cpu[mode].append(cpu_per_step)
                print(f"repeat {repeat}: " + ", ".join(f"{mode} {values[-1] * 1000:.1f} ms/step"
                                                      for mode, values in seconds.items()), flush=True)
            for mode in ("mlflow on", "mlflow dead"):
                ratios = [on / off for on, off in zip(seconds[mode], seconds["off"])]
                print(f"{mode}: median step {statistics.median(seconds[mode]) * 1000:.1f} ms vs off "
                      f"{statistics.median(seconds['off']) * 1000:.1f} ms: {statistics.median(ratios):.3f}x "
                      f"(per repeat {', '.join(f'{ratio:.3f}' for ratio in ratios)}); the tracker's thread: "
                      f"{statistics.median(tracker_cpu[mode]) * 1000:.3f} ms of CPU per step")
            print(f"load after: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
        finally:
            stop_process_group(mlflow.pid)
            stop_server()


if __name__ == "__main__":
    main()
