"""`train-rm/default` run the way users run it: `prefect deployment run` against a real server, through the
`rollout-process` work pool and a real process worker started by `rollout stack start`; checked through the API.

One server (`prefect_server`) and one worker (`worker_stack`) serve the whole session.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from clirun import run_cli
from conftest import SESSION_DIR, TINY_PAIRS, write_pairs

pytestmark = pytest.mark.slow

STEPS = 8
RUN_NAME = "deploy-tiny"
DATA_DIR = SESSION_DIR / "deploy-pairs"


def params(store: Path, max_steps: int = STEPS, *extra: str) -> dict:
    """The tiny config with its data and store replaced; `max_steps` goes in as its own deployment parameter."""
    return {
        "config": "configs/rm-tiny.toml",
        "overrides": [f"algorithm.rm.dataset.path={DATA_DIR / 'train.jsonl'}",
                      f"algorithm.rm.eval_dataset.path={DATA_DIR / 'eval.jsonl'}",
                      f"run.store={store}", f"run.name={RUN_NAME}", *extra],
        "max_steps": max_steps,
    }


def by_name(task_runs: list[dict], attempt: int | None = None) -> dict[str, dict]:
    """Task runs by name (`init-model-3fa` style generated names folded to their task name)."""
    named = {}
    for task_run in task_runs:
        if attempt is not None and task_run["flow_run_run_count"] != attempt:
            continue
        name = task_run["name"]
        for fixed in ("init-model",):
            if name.startswith(fixed + "-"):
                name = fixed
        named[name] = task_run
    return named


def final_checkpoint(store: Path) -> str:
    from rollout_lib.store import ObjectStore

    return ObjectStore(str(store)).get_ref(f"runs/{RUN_NAME}/latest")


def stored_checkpoint_steps(store: Path) -> set[int]:
    """Steps of the checkpoints (JSON manifests) the store holds so far."""
    steps = set()
    for path in (store / "objects").rglob("*") if (store / "objects").is_dir() else ():
        try:
            if path.is_file() and path.stat().st_size < 65536:
                record = json.loads(path.read_bytes())
                if isinstance(record, dict) and record.get("kind") == "rollout.checkpoint/v1":
                    steps.add(record["step"])
        except (OSError, ValueError):
            continue  # not JSON (a small tensor file), or being written
    return steps


def expected_task_names(steps: int) -> set[str]:
    names = {"load-pairs-train", "tokenize-pairs-train", "load-pairs-eval", "tokenize-pairs-eval",
             "init-model", "evaluate-step-0", f"evaluate-step-{steps}"}
    # The tiny config snapshots every step: a segment task per step.
    return names | {f"train-steps-{i}-{i}" for i in range(1, steps + 1)}


def run_created(worker_stack, **params) -> dict:
    """A run created through the API (DeploymentStack.create), once it has ended: for the tests of what the worker
    and the flow do with a run. `prefect deployment run` itself is the reference run's and the bad row's."""
    return worker_stack.wait(worker_stack.create(**params), timeout=600)


@pytest.fixture(scope="module")
def reference_run(worker_stack) -> dict:
    """An uninterrupted run of the tiny config: the run every resumed run must end identical to."""
    write_pairs(DATA_DIR / "train.jsonl", TINY_PAIRS)
    write_pairs(DATA_DIR / "eval.jsonl", TINY_PAIRS[:4])
    store = SESSION_DIR / "stores" / "reference"
    flow_run = worker_stack.run(**params(store))
    return {"flow_run": flow_run, "store": store}


def test_deployment_run_completes_with_tasks_artifacts_and_checkpoint(worker_stack, reference_run):
    flow_run, store = reference_run["flow_run"], reference_run["store"]
    assert flow_run["state"]["type"] == "COMPLETED", flow_run["cli"]["output"]
    assert flow_run["cli"]["returncode"] == 0  # `--watch` exits 0 on Completed
    assert flow_run["parameters"]["max_steps"] == STEPS  # --param reached the flow run ...

    task_runs = by_name(worker_stack.task_runs(flow_run["id"]))
    assert set(task_runs) == expected_task_names(STEPS)  # ... and the flow: exactly STEPS training steps
    assert {t["state"]["type"] for t in task_runs.values()} == {"COMPLETED"}

    checkpoint = final_checkpoint(store)
    from rollout_lib.store import ObjectStore
    from rollout_lib.checkpoint import read_manifest

    manifest = read_manifest(ObjectStore(str(store)), checkpoint)
    assert manifest["step"] == STEPS
    assert task_runs[f"train-steps-{STEPS}-{STEPS}"]["state"]["type"] == "COMPLETED"

    artifacts = {a["key"]: a for a in worker_stack.artifacts(flow_run["id"]) if a["key"]}
    assert {f"{RUN_NAME}-progress", f"{RUN_NAME}-metrics", f"{RUN_NAME}-summary"} <= set(artifacts)
    metrics = artifacts[f"{RUN_NAME}-metrics"]["data"]
    columns = json.loads(metrics) if isinstance(metrics, str) else metrics  # stored column by column
    rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert set(rows[0]) == {"step", "loss", "accuracy", "mean_margin", "lr", "grad_norm", "pairs_per_s"}
    assert all(isinstance(row["loss"], float) and row["pairs_per_s"] > 0 for row in rows)
    assert checkpoint in artifacts[f"{RUN_NAME}-summary"]["data"]
    assert f"final checkpoint {checkpoint}" in worker_stack.logs(flow_run["id"])


def test_stack_status_reports_server_worker_and_deployments(worker_stack):
    done = run_cli(["stack", "status"], env=dict(os.environ), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["running"] and report["worker"]["online"] and report["server"]["healthy"]
    assert report["server"]["owned"] is False  # the session's server: `rollout stack stop` leaves it alone
    assert "train-rm/default" in report["deployments"]


def test_nightly_schedule_creates_runs_and_one_run_at_a_time(worker_stack):
    deployment = worker_stack.api("GET", "/deployments/name/train-rm/default")
    [schedule] = deployment["schedules"]
    assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["schedule"]["timezone"] == "UTC"
    assert deployment["global_concurrency_limit"]["limit"] == 1
    assert deployment["concurrency_options"]["collision_strategy"] == "ENQUEUE"
    assert deployment["parameters"] == {"config": "configs/rm-default.toml", "overrides": []}
    assert not schedule["active"]  # the session's stack was started with --no-schedule
    # Only train-rm/default is scheduled: the others run when asked for.
    for other in ("train-sft/default", "train-rl/default", "rlhf/default"):
        assert worker_stack.api("GET", f"/deployments/name/{other}")["schedules"] == [], other

    path = f"/deployments/{deployment['id']}/schedules/{schedule['id']}"
    query = {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}, "state": {"type": {"any_": ["SCHEDULED"]}}}}
    nightly = []
    try:
        worker_stack.api("PATCH", path, {"active": True})
        deadline = time.monotonic() + 60
        while not nightly and time.monotonic() < deadline:
            nightly = [r for r in worker_stack.api("POST", "/flow_runs/filter", query) if r["auto_scheduled"]]
            time.sleep(0.5)
    finally:
        worker_stack.api("PATCH", path, {"active": False})
        for run in nightly + [r for r in worker_stack.api("POST", "/flow_runs/filter", query) if r["auto_scheduled"]]:
            try:
                worker_stack.api("DELETE", f"/flow_runs/{run['id']}")
            except OSError:
                pass  # deleted already (pausing a schedule removes its future runs)
    assert nightly, "the server's scheduler created no run from the nightly schedule (see its log)"
    assert all(run["expected_start_time"].endswith("T02:00:00Z") for run in nightly)
    assert all(run["parameters"] == deployment["parameters"] for run in nightly)


def test_bad_data_row_fails_the_load_task_naming_path_and_line(worker_stack, failed_row_run):
    flow_run, data, line = failed_row_run["flow_run"], failed_row_run["data"], failed_row_run["line"]
    assert flow_run["state"]["type"] == "FAILED"
    assert flow_run["cli"]["returncode"] == 1  # `--watch` exits 1 on Failed
    failed = [t for t in worker_stack.task_runs(flow_run["id"]) if t["state"]["type"] == "FAILED"]
    assert [t["name"] for t in failed] == ["load-pairs-train"]
    assert f"{data}:{line}:" in failed[0]["state"]["message"]
    assert f"{data}:{line}:" in flow_run["state"]["message"]
    logs = worker_stack.logs(flow_run["id"])
    assert "Traceback (most recent call last)" in logs and "DataError" in logs


def test_bad_parameter_fails_the_run_with_the_config_locator(worker_stack):
    store = SESSION_DIR / "stores" / "bad-param"
    flow_run = run_created(worker_stack, **params(store, 2, "algorithm.rm.optimizer.lr=-1"))
    assert flow_run["state"]["type"] == "FAILED"
    assert "algorithm.rm.optimizer.lr: must be > 0" in flow_run["state"]["message"]
    assert worker_stack.task_runs(flow_run["id"]) == []  # rejected before any work


def test_nan_loss_fails_the_training_step(worker_stack):
    # An absurd learning rate: step 1 is finite, its update blows the weights up, step 2's loss is NaN.
    store = SESSION_DIR / "stores" / "nan"
    flow_run = run_created(worker_stack, **params(store, 3, "algorithm.rm.optimizer.lr=1e30"))
    assert flow_run["state"]["type"] == "FAILED"
    task_runs = by_name(worker_stack.task_runs(flow_run["id"]))
    assert task_runs["train-steps-1-1"]["state"]["type"] == "COMPLETED"
    failed = task_runs["train-steps-2-2"]["state"]
    assert failed["type"] == "FAILED" and "train step 2: NonFiniteLossError" in failed["message"]
    assert "non-finite" in failed["message"]
    assert "train-steps-3-3" not in task_runs
    assert final_checkpoint(store) is None  # nothing published


def test_retry_after_fixing_the_cause_resumes_from_cache(worker_stack, reference_run):
    """Failed at the held-out data (after the training data was loaded and planned); fix the file, `prefect
    flow-run retry`: the finished tasks come back Cached and the run ends on the reference checkpoint."""
    store = SESSION_DIR / "stores" / "retry"
    eval_path = DATA_DIR / "eval.jsonl"
    good = eval_path.read_text()
    try:
        write_pairs(eval_path, TINY_PAIRS[:4], bad_line=2)
        failed = run_created(worker_stack, **params(store))
        assert failed["state"]["type"] == "FAILED"
        first = by_name(worker_stack.task_runs(failed["id"]), attempt=1)
        assert first["load-pairs-eval"]["state"]["type"] == "FAILED"
        assert f"{eval_path}:2:" in first["load-pairs-eval"]["state"]["message"]
        done_before = {name for name, t in first.items() if t["state"]["type"] == "COMPLETED"}
        assert {"load-pairs-train", "tokenize-pairs-train"} <= done_before  # the training data came first
    finally:
        eval_path.write_text(good)

    retry = worker_stack.prefect("flow-run", "retry", failed["id"])
    assert retry.returncode == 0, retry.stdout + retry.stderr
    worker_stack.wait(failed["id"], timeout=60, states=("SCHEDULED", "PENDING", "RUNNING", "COMPLETED"))
    flow_run = worker_stack.wait(failed["id"], timeout=600)
    assert flow_run["state"]["type"] == "COMPLETED" and flow_run["run_count"] == 2

    second = by_name(worker_stack.task_runs(failed["id"]), attempt=2)
    assert set(second) == expected_task_names(STEPS)
    assert {name for name, t in second.items() if t["state"]["name"] == "Cached"} == done_before
    assert final_checkpoint(store) == final_checkpoint(reference_run["store"])


def _flow_run_process(flow_run_id: str, worker_pid: int) -> int | None:
    """The worker's child process that executes this flow run."""
    from rollout_cli.processes import flow_run_processes

    return next((pid for pid, run_id in flow_run_processes(worker_pid).items() if run_id == flow_run_id), None)


def test_sigkilled_flow_run_is_crashed_and_the_next_run_resumes(worker_stack, reference_run):
    store = SESSION_DIR / "stores" / "crash"
    flow_run = {"id": worker_stack.create(**params(store))}
    deadline = time.monotonic() + 300
    killed = None
    while killed is None and time.monotonic() < deadline:
        # The store, not the API: the server records task runs in batches, up to a second late.
        if 3 in stored_checkpoint_steps(store):
            pid = _flow_run_process(flow_run["id"], worker_stack.worker["pid"])
            assert pid is not None, "flow run process not found among the worker's children"
            os.kill(pid, signal.SIGKILL)
            killed = pid
        time.sleep(0.05)
    assert killed, "the run never reached the snapshot of step 3"
    crashed = worker_stack.wait(flow_run["id"], timeout=120)
    assert crashed["state"]["type"] == "CRASHED", crashed["state"]
    completed = {name: t for name, t in by_name(worker_stack.task_runs(flow_run["id"])).items()
                 if (t["state"] or {}).get("type") == "COMPLETED"}
    # Killed mid-training: the train-steps-3-3 task itself may or may not have reported before the kill.
    assert "train-steps-1-1" in completed and "evaluate-step-8" not in completed
    # The flow calls its tasks one after another (flows/common.py: train_in_segments), and a called task returns
    # only after Prefect commits its cache record. Step 3's snapshot was in the store, so train-steps-3-3 was
    # running: every task called before it had committed. (Prefect reports COMPLETED before the commit, so a
    # task that completed in the kill's last moment may be recomputed: the API's end times cannot say which.)
    done_before = expected_task_names(2) - {"evaluate-step-2"}
    rerun = run_created(worker_stack, **params(store))  # the same run again; the crashed run released its slot
    assert rerun["state"]["type"] == "COMPLETED", rerun["state"]
    cached = {name for name, t in by_name(worker_stack.task_runs(rerun["id"])).items()
              if t["state"]["name"] == "Cached"}
    assert done_before <= cached
    assert final_checkpoint(store) == final_checkpoint(reference_run["store"])
