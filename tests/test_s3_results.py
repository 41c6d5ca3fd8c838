"""A run on an s3:// store keeps its Prefect task results in the same bucket, under the store's prefix: a rerun
comes back Cached from them, and wiping the store wipes the cache with it (nothing stale is left on local disk)."""

from __future__ import annotations

import uuid

import fsspec
import pytest

from clirun import final_result, run_rollout, task_run_states
from rollout_lib.store import ObjectStore
from s3server import BUCKET

pytestmark = pytest.mark.slow


def toml_inline(value) -> str:
    """A TOML value for --set (storage options: strings and nested tables)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}={toml_inline(item)}" for key, item in value.items()) + "}"
    return f'"{value}"'


def test_train_rm_on_s3_keeps_task_results_in_the_bucket(prefect_server, s3_options):
    store_url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    args = ["train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={store_url}",
            "--set", f"run.storage_options={toml_inline(s3_options)}"]
    bucket = fsspec.filesystem("s3", skip_instance_cache=True, **s3_options)
    results_dir = f"{store_url.removeprefix('s3://')}/prefect-results"

    first = run_rollout(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = final_result(first)["checkpoint"]
    assert ObjectStore(store_url, s3_options).get_ref("runs/rm-tiny/latest") == checkpoint
    results = bucket.find(results_dir)
    assert len(results) == len(task_run_states(final_result(first)["flow_run_id"])) >= 4, results  # one per task
    assert any(checkpoint in bucket.cat_file(path).decode() for path in results)

    rerun = run_rollout(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    result = final_result(rerun)
    assert result["checkpoint"] == checkpoint
    assert set(task_run_states(result["flow_run_id"]).values()) == {"Cached"}  # read back from the bucket

    bucket.rm(store_url.removeprefix("s3://"), recursive=True)  # wipe the store: its cache goes with it
    after_wipe = run_rollout(*args)
    assert after_wipe.returncode == 0, after_wipe.stderr[-3000:]
    result = final_result(after_wipe)
    assert result["checkpoint"] == checkpoint
    assert set(task_run_states(result["flow_run_id"]).values()) == {"Completed"}
