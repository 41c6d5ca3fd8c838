"""Where each RL step's tables are: the content ids of what a step sampled, scored, shipped and trained on, kept
beside the run's metrics so `rollout runs samples` can read a step's samples back (runlog/samples.py).

The tables themselves are objects of the store, named by their content; nothing but a task's cached result named
them before, and Prefect's results are no library's to read. So train-rl writes one small JSON object per step,
``runs/<name>/steps/<step, 9 digits>.json``, once the step trained:

    {"step": 3, "prompts": {"<env>": id}, "rollouts": id, "scored": id, "rewards": id | null, "samples": id,
     "micro_batches": id, "sampled_from_state": id, "state": id}

``rewards``: the per-row RewardResults (each function's reward) of a streamed step (rl/score.rewards_json); null
when the step scored staged, whose table keeps only the total. A replayed step writes its record again (the same
ids, from cache). The objects it names are not gc roots: after `rollout gc` past its grace period a record may
name tables that are gone, and the reader says so.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid

from rollout_lib.runlog.metrics_file import is_local, run_dir
from rollout_lib.store import ObjectStore

STEPS_DIR = "steps"  # runs/<name>/steps/<step>.json
STEP_TABLES_KIND = "rollout.rl.step_tables/v1"
_STEP_RE = re.compile(r"(\d+)\.json")
log = logging.getLogger(__name__)


def record_step_tables(store: ObjectStore, run_name: str, step: int, tables: dict) -> None:
    """Write step ``step``'s record (``tables``: the ids above). Never raises: a record is for reading a run later,
    and its failure is logged, not the run's."""
    try:
        directory = f"{run_dir(store, run_name)}/{STEPS_DIR}"
        write_record(store, directory, f"{int(step):09d}.json",
                     {"kind": STEP_TABLES_KIND, "step": int(step), **tables})
    except Exception:  # noqa: BLE001 - recording never fails a run
        log.warning("run %r: recording the tables of step %d failed", run_name, step, exc_info=True)


def write_record(store: ObjectStore, directory: str, name: str, record: dict) -> None:
    """``record`` as JSON at ``directory/name``, whole or not at all (runlog/eval_tables.py writes its own too)."""
    data = json.dumps(record, sort_keys=True).encode()
    path = f"{directory}/{name}"
    if is_local(store):  # a reader sees the old record or the new one, never half of one
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:  # one PUT is all-or-nothing
        store.fs.pipe_file(path, data)


def recorded_steps(store: ObjectStore, run_name: str) -> list[int]:
    """The steps of the run that have a record, sorted."""
    return numbered_records(store, f"{run_dir(store, run_name)}/{STEPS_DIR}", _STEP_RE)


def numbered_records(store: ObjectStore, directory: str, name: re.Pattern) -> list[int]:
    """The numbers (``name``'s first group) of the records in ``directory`` whose file names match, sorted."""
    store.fs.invalidate_cache(directory)
    try:
        names = [path.rsplit("/", 1)[-1] for path in store.fs.ls(directory, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(int(match.group(1)) for match in map(name.fullmatch, names) if match)


def read_step_tables(store: ObjectStore, run_name: str, step: int) -> dict | None:
    """Step ``step``'s record, or None when it has none."""
    return read_record(store, f"{run_dir(store, run_name)}/{STEPS_DIR}/{int(step):09d}.json", STEP_TABLES_KIND)


def read_record(store: ObjectStore, path: str, kind: str) -> dict | None:
    """The record at ``path`` if there is one of that ``kind`` (runlog/eval_tables.py reads its own too)."""
    try:
        record = json.loads(store.fs.cat_file(path))
    except FileNotFoundError:
        return None
    return record if record.get("kind") == kind else None
