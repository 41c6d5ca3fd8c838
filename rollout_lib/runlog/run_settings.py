"""A run's resolved settings, kept beside its metrics so a later command can rebuild what the run trained.

The Prefect UI shows them as the `<run>-settings` artifact and the trackers as their params, but neither is the
store's, and a reader of the store (`rollout runs samples --trainer-logprobs`, which rebuilds a policy state to
compute its logprobs) needs the settings the run trained with, not the ones in a config file today. So every
training flow writes ``runs/<name>/settings.json`` as it starts:

    {"kind": "rollout.run_settings/v1", "flow": "train-rl", "identity": <training identity>,
     "settings": <the config as resolved, JSON; never run.storage_options (credentials)>}

A rerun writes it again (a run name holds one training identity, so the settings that matter are the same).
"""

from __future__ import annotations

import json
import logging

from rollout_lib.runlog.metrics_file import run_dir
from rollout_lib.runlog.step_tables import write_record
from rollout_lib.store import ObjectStore

RUN_SETTINGS_KIND = "rollout.run_settings/v1"
SETTINGS_FILE = "settings.json"
log = logging.getLogger(__name__)


def record_run_settings(store: ObjectStore, run_name: str, flow_name: str, identity: str, settings: dict) -> None:
    """Write the run's record (`settings`: the config's `model_dump(mode="json")`). Never raises: the record is for
    reading the run later, and its failure is logged, not the run's."""
    kept = json.loads(json.dumps(settings))
    kept.get("run", {}).pop("storage_options", None)  # credentials stay out of the store
    try:
        write_record(store, run_dir(store, run_name), SETTINGS_FILE,
                     {"kind": RUN_SETTINGS_KIND, "flow": flow_name, "identity": identity, "settings": kept})
    except Exception:  # noqa: BLE001 - recording never fails a run
        log.warning("run %r: recording its settings failed", run_name, exc_info=True)


def read_run_settings(store: ObjectStore, run_name: str) -> dict | None:
    """The run's record, or None when it has none (a run started before rollout kept them)."""
    try:
        record = json.loads(store.fs.cat_file(f"{run_dir(store, run_name)}/{SETTINGS_FILE}"))
    except FileNotFoundError:
        return None
    return record if isinstance(record, dict) and record.get("kind") == RUN_SETTINGS_KIND else None
