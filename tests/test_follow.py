"""`rollout follow FLOW_RUN_ID`, as scripts/run-main-job.sh uses it: a deployment's run seen through the API as the
flow's own log lines (a line per step, segment reports), then its summary and UI page; its exit code is the run's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from clirun import ROOT

pytestmark = pytest.mark.slow


def follow(worker_stack, flow_run_id: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_cli", "follow", flow_run_id, "--poll", "0.5"], cwd=ROOT,
                          env={**os.environ, "PREFECT_API_URL": worker_stack.api_url}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=600)


def test_a_deployment_run_followed_to_its_summary(worker_stack, tmp_path):
    flow_run_id = worker_stack.submit(config="configs/rm-tiny.toml", max_steps=3,
                                      overrides=[f"run.store={tmp_path}", "run.name=followed"])
    done = follow(worker_stack, flow_run_id)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = done.stderr
    assert "step 1/3: loss " in shown and "step 3/3: loss " in shown  # the flow's own per-step lines
    assert "# train-rm `followed`" in shown and "final checkpoint" in shown  # the summary artifact
    assert "curves: artifact followed-curves" in shown
    assert f"/runs/flow-run/{flow_run_id}" in shown and ": Completed" in shown
    assert "entered state" not in shown  # no raw state-change events


def test_a_failed_run_is_followed_to_its_error(worker_stack, failed_row_run):
    done = follow(worker_stack, failed_row_run["flow_run"]["id"])
    assert done.returncode == 1
    assert f"{failed_row_run['data'].name}:{failed_row_run['line']}: invalid JSON" in done.stderr
    assert ": Failed" in done.stderr


def test_an_unknown_flow_run(worker_stack):
    done = follow(worker_stack, "00000000-0000-0000-0000-000000000000")
    assert done.returncode == 2 and "no flow run 00000000" in done.stderr
