"""What orchestration costs over a long run: the train-rm flow on the tiny reward model against the same loop bare.

Cheap steps (the tiny Qwen2 reward model, ~10 ms a step on this CPU) make orchestration visible: before training
in segments every step was a task run, and the flow ran at about 0.2x its bare loop. Now a task covers the steps
from one snapshot to the next. One run of this script measures, side by side on one machine:

    flow/bare        optimizer steps per second of the flow's training loop over the bare loop's (target >= 0.9)
    library/bare     the same for the flow's trainer, segments and snapshots run without Prefect: what of the gap
                     is the library's step (per-step collation, metrics, snapshots) and what is orchestration
    server CPU       CPU seconds of the Prefect server (all its processes) per 1,000 steps   (target <= 2 s)
    database growth  bytes of the server's SQLite database in use, grown per 1,000 steps     (target <= 1 MB)
    flatness         seconds per step over the first and the last 500 steps, from the segment task runs'
                     end times on the server (target: within 10%)

The server is a fresh project-local one (its own PREFECT_HOME in a temporary directory, the settings rollout
gives every server it starts), so its database holds only this run. The bare loop and the flow each run in a
fresh process (model loading and data tasks untimed), alternating `--repeats` times, bare first.

    .venv/bin/python bench/bench_orchestration.py [--steps 2000] [--checkpoint-interval 100] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
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

CONFIG = "configs/rm-tiny.toml"


def overrides(steps: int, interval: int, store: str) -> list[str]:
    return [f"algorithm.rm.budget.max_steps={steps}", f"algorithm.rm.checkpoint_interval={interval}",
            f"run.store={store}", "run.name=bench-orchestration"]


def measure_bare(steps: int, interval: int) -> dict:
    from bench.bench_rm import bare_loop
    from rollout_lib.config import RmConfig
    from rollout_lib.plan_checks import load_config

    with tempfile.TemporaryDirectory() as store:
        return {"seconds": bare_loop(load_config(RmConfig, CONFIG, overrides(steps, interval, store)), steps)}


def measure_library(steps: int, interval: int) -> dict:
    """The flow's training without Prefect: the same trainer, segments and snapshots, in a plain loop."""
    from rollout_lib.config import RmConfig
    from rollout_lib.plan_checks import load_config
    from rollout_lib.data import load_pairs
    from rollout_lib.model.loading import load_tokenizer, resolve_model
    from rollout_lib.rm.pairs import tokenize_pairs
    from rollout_lib.rm.trainer import RewardModelTrainer
    from rollout_lib.store import ObjectStore
    from rollout_lib.trainer.base import TrainingInputs
    from rollout_lib.identity.training import training_identity
    from rollout_lib.trainer.segment import SnapshotSchedule, train_segment

    with tempfile.TemporaryDirectory() as store_root:
        config = load_config(RmConfig, CONFIG, overrides(steps, interval, store_root))
        store = ObjectStore(store_root)
        settings = config.settings
        tokenizer = load_tokenizer(resolve_model(settings.base_model))
        tokenized = tokenize_pairs(load_pairs(settings.dataset.path), tokenizer, settings.max_seq_len)
        inputs = TrainingInputs(store, config, training_identity(config), {"tokenized": store.put_table(tokenized)})
        trainer = RewardModelTrainer.initial(inputs)
        started = time.perf_counter()
        for segment in SnapshotSchedule(interval, steps).segments():
            train_segment(trainer, segment)
        return {"seconds": time.perf_counter() - started}


def measure_flow(steps: int, interval: int) -> dict:
    from flows.train_rm import train_rm

    with tempfile.TemporaryDirectory() as store:
        state = train_rm(config=CONFIG, overrides=overrides(steps, interval, store), return_state=True)
        return {"seconds": state.result()["train_seconds"], "flow_run_id": str(state.state_details.flow_run_id)}


def in_subprocess(kind: str, args, env: dict) -> dict:
    command = [sys.executable, __file__, "--measure", kind, "--steps", str(args.steps),
               "--checkpoint-interval", str(args.checkpoint_interval)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"bench: the {kind} measurement failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def server_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of the server process and all its descendants (uvicorn, services)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def database_bytes(prefect_home: Path) -> int:
    """Bytes of the server's SQLite database in use (pages not on the free list), read through SQLite so that
    what still sits in the write-ahead log counts and file-size jumps from page preallocation do not."""
    import sqlite3

    with sqlite3.connect(f"file:{prefect_home / 'prefect.db'}?mode=ro", uri=True) as db:
        pages, free, size = (db.execute(f"PRAGMA {name}").fetchone()[0]
                             for name in ("page_count", "freelist_count", "page_size"))
    return (pages - free) * size


def segment_ends(flow_run_id: str) -> list[tuple[int, float]]:
    """(last step, end time) of every train-steps-a-b task run of the flow run, in step order; init-model's end
    is step 0's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    ends = [(0 if run.name == "init-model" else int(run.name.rsplit("-", 1)[1]), run.end_time.timestamp())
            for run in runs if run.name.startswith("train-steps-") or run.name == "init-model"]
    return sorted(ends)


def seconds_per_step(ends: list[tuple[int, float]], first: int, last: int) -> float:
    """Mean seconds per step over steps first..last, from the end times of the segments that bound them."""
    by_step = dict(ends)
    if first - 1 not in by_step or last not in by_step:
        raise ValueError(f"steps {first}..{last} do not start and end at segment boundaries: {sorted(by_step)}")
    return (by_step[last] - by_step[first - 1]) / (last - first + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--checkpoint-interval", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--measure", choices=("bare", "library", "flow"), help=argparse.SUPPRESS)  # one child
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.measure:
        measure = {"bare": measure_bare, "library": measure_library, "flow": measure_flow}[args.measure]
        print(json.dumps(measure(args.steps, args.checkpoint_interval)))
        return
    if args.steps % args.checkpoint_interval or args.steps < 1000 or 500 % args.checkpoint_interval:
        sys.exit("bench: --steps must be >= 1000 and a multiple of --checkpoint-interval, which must divide 500")

    with tempfile.TemporaryDirectory() as state:
        os.environ["ROLLOUT_STATE_DIR"] = state
        os.environ.pop("PREFECT_API_URL", None)
        from rollout_cli.local_server import start_server, stop_server

        server = start_server()
        env = {**os.environ, "PREFECT_API_URL": server["api_url"], "PREFECT_HOME": server["prefect_home"]}
        os.environ.update(PREFECT_API_URL=server["api_url"], PREFECT_HOME=server["prefect_home"])
        home = Path(server["prefect_home"])
        try:
            print(f"tiny RM, {args.steps} steps x 2 pairs, a segment (and a snapshot) every "
                  f"{args.checkpoint_interval} steps, {args.repeats} alternating bare/flow pairs", flush=True)
            ratios, library_ratios, cpu, growth, flat = [], [], [], [], []
            for repeat in range(1, args.repeats + 1):
                bare = in_subprocess("bare", args, env)
                library = in_subprocess("library", args, env)
                time.sleep(2)  # let the server's batched writes of the last run settle before the baseline
                cpu_before, db_before = server_cpu_seconds(server["pid"]), database_bytes(home)
                flow = in_subprocess("flow", args, env)
                time.sleep(3)  # the task-run recorder flushes every second: count what this run wrote
                cpu.append((server_cpu_seconds(server["pid"]) - cpu_before) * 1000 / args.steps)
                growth.append((database_bytes(home) - db_before) * 1000 / args.steps)
                ends = segment_ends(flow["flow_run_id"])
                head = seconds_per_step(ends, 1, 500)
                tail = seconds_per_step(ends, args.steps - 499, args.steps)
                flat.append(tail / head)
                ratios.append(bare["seconds"] / flow["seconds"])
                library_ratios.append(bare["seconds"] / library["seconds"])
                print(f"  pair {repeat}: bare {args.steps / bare['seconds']:6.1f} steps/s ({bare['seconds']:.1f} s), "
                      f"library {args.steps / library['seconds']:6.1f} steps/s, "
                      f"flow {args.steps / flow['seconds']:6.1f} steps/s ({flow['seconds']:.1f} s), ratio "
                      f"{ratios[-1]:.3f}; server {cpu[-1]:.2f} CPU s and {growth[-1] / 1e6:.3f} MB per 1000 steps; "
                      f"per step {1000 * head:.2f} ms (first 500) vs {1000 * tail:.2f} ms (last 500)", flush=True)
        finally:
            stop_server()
    print(f"  ratio library/bare (no Prefect) : {statistics.median(library_ratios):7.3f}  (median; the trainer's own cost)")
    print(f"  ratio flow/bare                 : {statistics.median(ratios):7.3f}  (median; target >= 0.9)")
    print(f"  server CPU s per 1000 steps     : {statistics.median(cpu):7.3f}  (median; target <= 2)")
    print(f"  server DB MB per 1000 steps     : {statistics.median(growth) / 1e6:7.3f}  (median; target <= 1)")
    print(f"  per-step time last/first 500    : {statistics.median(flat):7.3f}  (median; target within 0.9-1.1)")


if __name__ == "__main__":
    main()
