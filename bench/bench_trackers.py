"""Step time of rm-tiny with MLflow off, on (a live `mlflow server`) and on with the server dead (nothing listens at
its URI) (docs/runs.md, "Trackers"; target: on and dead <= 1.02x off, issue 41).

Two figures, since the first alone cannot resolve 2% here:
- **Wall**: a step's time is the gap between consecutive records of the run's metrics file (each written as its
  step completes), over one segment (no snapshot inside it), the first step left out (it pays the segment's start);
  median over steps. The three modes alternate `--repeats` times in one process, in an order rotated at each repeat;
  the figure is the median of the per-repeat ratios with a 90% bootstrap interval. On a 2-core VM a whole run's
  median step moves by +-20% from one run to the next in the same mode (measured: 6.9-11.8 ms for "off" alone), so
  the interval is wide.
- **Bound**: what the trackers can take from the training loop at most, per step: the loop's own time handing the
  step over (the recorder's `tracking_seconds`) plus all the CPU of the tracker's thread while steps came (if every
  microsecond of it held the GIL against the loop), median over the repeats, over the fastest step with trackers
  off (a slow repeat would hide the cost). Measured in CPU and perf-counter time of the process itself, it barely
  moves with the run-to-run noise.
Both run on a Prefect server and an MLflow server (SQLite, one worker, from .venv-mlflow: `bash scripts/setup.sh
--test`) started for the bench. Note the machine's load (printed) beside the figures.

    .venv/bin/python bench/bench_trackers.py [--steps 200] [--repeats 9]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
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


class TrackerCosts(logging.Handler):
    """The closing debug lines of a run with a tracker: the tracker thread's CPU seconds while steps came
    (trackers/thread.py) and the training loop's seconds handing steps over (runlog/recorder.py)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.thread_cpu: list[float] = []
        self.handoff: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "of CPU on its thread while steps came" in message:
            self.thread_cpu.append(record.args[1])
        elif "on the training loop handing" in message:
            self.handoff.append(record.args[1])

    def clear(self) -> None:
        self.thread_cpu.clear()
        self.handoff.clear()


def measure(steps: int, trackers: list[str], costs: TrackerCosts) -> tuple[float, float | None]:
    """(median step seconds, the trackers' cost to the loop per step at most, or None without a tracker)."""
    from flows.train_rm import train_rm

    costs.clear()
    with tempfile.TemporaryDirectory() as store:
        overrides = [f"run.store={store}", f"algorithm.rm.budget.max_steps={steps}",
                     f"algorithm.rm.checkpoint_interval={steps}", *trackers]
        state = train_rm(config=CONFIG, overrides=overrides, return_state=True)
        state.result()
        cost = (sum(costs.thread_cpu) + sum(costs.handoff)) / steps if costs.thread_cpu else None
        return step_seconds(store, "rm-tiny"), cost


def bootstrap_interval(ratios: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 90% interval of the median of `ratios`, by resampling them (seeded: the same ratios, the same interval)."""
    generator = random.Random(0)
    medians = sorted(statistics.median(generator.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
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
            costs = TrackerCosts()
            for name in ("rollout_lib.runlog.trackers.thread", "rollout_lib.runlog.recorder"):
                logging.getLogger(name).addHandler(costs)
                logging.getLogger(name).setLevel(logging.DEBUG)
            measure(4, [], costs)  # warm: the tiny model's files, the first flow run's imports
            seconds: dict[str, list[float]] = {mode: [] for mode in modes}
            cost: dict[str, list[float]] = {mode: [] for mode in modes}
            for repeat in range(1, args.repeats + 1):
                names = list(modes)
                order = names[repeat % 3:] + names[:repeat % 3]  # rotated: no mode always runs first
                for mode in order:
                    step, cost_per_step = measure(args.steps, modes[mode], costs)
                    seconds[mode].append(step)
                    if cost_per_step is not None:
                        cost[mode].append(cost_per_step)
                print(f"repeat {repeat}: " + ", ".join(f"{mode} {values[-1] * 1000:.1f} ms/step"
                                                      for mode, values in seconds.items()), flush=True)
            off = statistics.median(seconds["off"])
            for mode in ("mlflow on", "mlflow dead"):
                ratios = [on / off_step for on, off_step in zip(seconds[mode], seconds["off"])]
                low, high = bootstrap_interval(ratios)
                # The bound over the fastest step with trackers off (a slow repeat's step would hide the cost)
                bound = 1 + statistics.median(cost[mode]) / min(seconds["off"])
                print(f"{mode}: wall: median step {statistics.median(seconds[mode]) * 1000:.2f} ms vs off "
                      f"{off * 1000:.2f} ms, median ratio {statistics.median(ratios):.3f}x (90% interval "
                      f"{low:.3f}-{high:.3f}; per repeat {', '.join(f'{ratio:.2f}' for ratio in ratios)}); bound: "
                      f"{statistics.median(cost[mode]) * 1000:.3f} ms a step (median of the repeats: "
                      f"{', '.join(f'{value * 1000:.3f}' for value in cost[mode])}) over the fastest step off "
                      f"{min(seconds['off']) * 1000:.2f} ms = {bound:.4f}x", flush=True)
            print(f"load after: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
        finally:
            stop_process_group(mlflow.pid)
            stop_server()


if __name__ == "__main__":
    main()
