"""An RL prompt set of N rows (default 1M) as parquet and as the same rows in JSONL: plan time (what `--dry-run`
and the load-prompts task do: read, check, build the PROMPTS table; for parquet also its content digest, first
and cached) and per-step prompt overhead (what each step's stages do with the prompts: read the table back from
the store, draw a step's prompts, turn the drawn ones into the rewards' messages), with peak RSS
(docs/data.md). Run it on a quiet machine; note the load:

    .venv/bin/python bench/bench_data_sources.py [--rows 1000000] [--steps 20]

Each format runs in a fresh process, so peak RSS is that format's alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_sets(rows: int, folder: Path) -> tuple[Path, Path]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    a = pa.array(np.arange(rows) % 997).cast(pa.string())
    b = pa.array(np.arange(rows)).cast(pa.string())
    question = pc.binary_join_element_wise("Use the calculator. What is ", a, " * ", b, "?", "")
    answer = pa.array((np.arange(rows) % 997) * np.arange(rows)).cast(pa.string())
    parquet = folder / "prompts.parquet"
    pq.write_table(pa.table({"prompt": question, "answer": answer}), parquet)
    jsonl = folder / "prompts.jsonl"
    with jsonl.open("w") as fh:
        for q, x in zip(question.to_pylist(), answer.to_pylist()):
            fh.write(json.dumps({"prompt": q, "answer": x}) + "\n")
    return parquet, jsonl


def measure(kind: str, path: str, steps: int, store_root: str) -> dict:
    """In this process: plan (twice for parquet: the digest is cached after the first) and `steps` steps."""
    from types import SimpleNamespace

    from rollout_lib.data.prompts import load_jsonl_prompts, table_prompts
    from rollout_lib.identity.digests import content_digest, file_digest
    from rollout_lib.reward.tables import prompt_messages
    from rollout_lib.rl.prompts import check_distinct_examples, select_prompts
    from rollout_lib.store import ObjectStore
    from rollout_lib import wire

    def plan():
        started = time.perf_counter()
        if kind == "parquet":
            source = SimpleNamespace(type="parquet", path=path, split=None, columns={})
            content_digest(source)
            table = table_prompts(source, "calc", None, "bench")
        else:
            file_digest(path)
            table = load_jsonl_prompts(path, "calc")
        check_distinct_examples({"calc": table})
        return table, time.perf_counter() - started

    table, first_plan_s = plan()
    table, second_plan_s = plan()
    store = ObjectStore(store_root)
    prompts_id = store.put_table(table)
    del table
    def step_times(read_each_time: bool) -> list[float]:
        kept = None if read_each_time else store.get_table(prompts_id, wire.PROMPTS)
        times = []
        for step in range(steps):
            started = time.perf_counter()
            # A task's read: from the store each time, or the table its process kept (tasks/rl.py _stored_prompts)
            prompts = store.get_table(prompts_id, wire.PROMPTS) if read_each_time else kept
            drawn = select_prompts(prompts, 16, seed=1, step=step, env_index=0)
            prompt_messages(prompts, drawn.column("example_id").to_pylist())
            times.append(time.perf_counter() - started)
        return sorted(times)

    reread, kept = step_times(True), step_times(False)
    return {"format": kind, "plan_first_s": round(first_plan_s, 3), "plan_again_s": round(second_plan_s, 3),
            "read_and_draw_median_s": round(reread[len(reread) // 2], 4),
            "draw_from_kept_median_s": round(kept[len(kept) // 2], 4),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--measure", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args.steps, args.store)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-data-") as folder:
        folder = Path(folder)
        os.environ["ROLLOUT_CACHE_DIR"] = str(folder / "cache")
        parquet, jsonl = make_sets(args.rows, folder)
        print(f"rows {args.rows}: parquet {parquet.stat().st_size / 2**20:.1f} MiB, "
              f"jsonl {jsonl.stat().st_size / 2**20:.1f} MiB; load: {os.getloadavg()}")
        for kind, path in (("parquet", parquet), ("jsonl", jsonl)):
            done = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--measure", kind, str(path),
                                   "--store", str(folder / f"store-{kind}")], capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
            print(done.stdout.strip())


if __name__ == "__main__":
    main()
