"""Where each held-out evaluation's rows are: train-sft and train-rm evaluate before and after training (labels
``step-0`` and ``step-N``), store one row per held-out example (wire.SFT_EVAL_ROWS, wire.RM_EVAL_ROWS) and write
``runs/<name>/evals/<label>.json`` after the evaluate task, so `rollout runs samples --eval` can read them back
(runlog/eval_samples.py):

    {"kind": ..., "label": "step-2", "step": 2, "algorithm": "sft" | "rm", "rows": id, "data": id}

train-rl evaluates an env's held-out prompts before step 1, every `eval.every` steps and after the last; one
record per step holds every env evaluated then, ``runs/<name>/evals/rl-step-<step>.json``:

    {"kind": ..., "step": 2, "envs": {"<env>": {"scored": id, "rewards": id, "prompts": id}}}

(``scored``: the held-out rollouts with their rewards, wire.ROLLOUTS; ``rewards``: each row's reward results,
rl/score.rewards_json; ``prompts``: the held-out prompts, wire.PROMPTS), read by runlog/samples.read_eval_samples.

``data``: the eval dataset's table as loaded (wire.EXAMPLES or wire.PAIRS), whose text the reader shows beside each
row. ``rows``: null where the evaluate task returned none (a result from before evaluations kept rows; the task's
key holds its code version, so a flow meets one only from older code's store). A replayed run writes its records
again. Like the step records, the objects named are not gc roots.
"""

from __future__ import annotations

import logging
import re

from rollout_lib.runlog.metrics_file import run_dir
from rollout_lib.runlog.step_tables import numbered_records, read_record, write_record
from rollout_lib.store import ObjectStore

EVALS_DIR = "evals"  # runs/<name>/evals/<label>.json
EVAL_TABLES_KIND = "rollout.eval_tables/v1"
RL_EVAL_TABLES_KIND = "rollout.rl_eval_tables/v1"
_LABEL_RE = re.compile(r"step-(\d+)\.json")
_RL_LABEL_RE = re.compile(r"rl-step-(\d+)\.json")
log = logging.getLogger(__name__)


def record_eval_tables(store: ObjectStore, run_name: str, step: int, algorithm: str, rows_id: str | None,
                       data_id: str) -> None:
    """Write the record of the evaluation at ``step``. Never raises: its failure is logged, not the run's."""
    _write(store, run_name, f"step-{int(step)}.json", "the evaluation", step,
           {"kind": EVAL_TABLES_KIND, "label": f"step-{int(step)}", "step": int(step), "algorithm": algorithm,
            "rows": rows_id, "data": data_id})


def recorded_evals(store: ObjectStore, run_name: str) -> list[int]:
    """The steps of the run with an evaluation record, sorted."""
    return numbered_records(store, f"{run_dir(store, run_name)}/{EVALS_DIR}", _LABEL_RE)


def read_eval_tables(store: ObjectStore, run_name: str, step: int) -> dict | None:
    """The record of the evaluation at ``step``, or None when it has none."""
    return _read(store, run_name, f"step-{int(step)}.json", EVAL_TABLES_KIND)


def record_rl_eval_tables(store: ObjectStore, run_name: str, step: int, envs: dict[str, dict[str, str]]) -> None:
    """Write the record of train-rl's evaluation at ``step``: ``envs`` maps each env evaluated to the ids of its
    scored rollouts, reward results and prompts. Never raises: its failure is logged, not the run's."""
    _write(store, run_name, f"rl-step-{int(step)}.json", "the held-out samples", step,
           {"kind": RL_EVAL_TABLES_KIND, "step": int(step), "envs": envs})


def recorded_rl_evals(store: ObjectStore, run_name: str) -> list[int]:
    """The steps of an RL run with a recorded evaluation, sorted."""
    return numbered_records(store, f"{run_dir(store, run_name)}/{EVALS_DIR}", _RL_LABEL_RE)


def read_rl_eval_tables(store: ObjectStore, run_name: str, step: int) -> dict | None:
    """The record of train-rl's evaluation at ``step``, or None when it has none."""
    return _read(store, run_name, f"rl-step-{int(step)}.json", RL_EVAL_TABLES_KIND)


def _write(store: ObjectStore, run_name: str, name: str, what: str, step: int, record: dict) -> None:
    try:
        write_record(store, f"{run_dir(store, run_name)}/{EVALS_DIR}", name, record)
    except Exception:  # noqa: BLE001 - recording never fails a run
        log.warning("run %r: recording %s of step %d failed", run_name, what, step, exc_info=True)


def _read(store: ObjectStore, run_name: str, name: str, kind: str) -> dict | None:
    return read_record(store, f"{run_dir(store, run_name)}/{EVALS_DIR}/{name}", kind)
