"""`rollout follow RUN | --latest`, as scripts/run-main-job.sh uses it: a deployment's run seen through the API as the
flow's own log lines (a line per step, segment reports), then the summary `rollout train` prints; its exit code is
the run's."""

from __future__ import annotations

import os
import subprocess

import pytest

from clirun import run_cli

pytestmark = pytest.mark.slow


def follow(worker_stack, *args: str, server_from_env: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": worker_stack.api_url}
    if not server_from_env:  # found from the stack record of rollout's home, as a user's shell would
        del env["PREFECT_API_URL"]
    return run_cli(["follow", *args, "--poll", "0.5"], env=env, stdin=subprocess.DEVNULL)


def test_a_deployment_run_followed_by_its_run_name_to_its_summary(worker_stack, failed_row_run, tmp_path):
    """The run followed by its run name, then by --latest: the newest started run is this one (it was submitted
    after the failed run of `failed_row_run`, the session's older one), so --latest gives its summary and exit 0."""
    flow_run_id = worker_stack.submit(config="configs/rm-tiny.toml", max_steps=3,
                                      overrides=[f"run.store={tmp_path}", "run.name=followed"])
    worker_stack.wait(flow_run_id)  # named and tagged once it starts: a finished run is followed as a live one
    done = follow(worker_stack, "followed", server_from_env=False)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = done.stderr
    assert "step 1/3: loss " in shown and "step 3/3: loss " in shown  # the flow's own per-step lines
    assert "step 3/3 loss " in shown  # the bar: step and loss
    assert "steps 1-1: mean loss" in shown  # the segment lines
    checkpoint = (tmp_path / "refs" / "runs" / "followed" / "latest").read_text().strip()
    # The summary `rollout train` prints, in plain text; the checkpoint id and the run's page once each.
    assert "train accuracy (first -> last step): " in shown
    assert shown.count(checkpoint) == 1 and f"final checkpoint: {checkpoint}" in shown
    assert shown.count(f"/runs/flow-run/{flow_run_id}") == 1
    assert "# train-rm" not in shown  # no raw Markdown
    # Prefect's routine lines stay in the UI's log, not on the terminal.
    assert "Finished in state" not in shown and "Beginning flow run" not in shown and "submitting" not in shown
    assert "entered state" not in shown  # no raw state-change events
    latest = follow(worker_stack, "--latest")
    assert latest.returncode == 0, latest.stdout + latest.stderr
    assert f"final checkpoint: {checkpoint}" in latest.stderr
    assert latest.stderr.count(f"/runs/flow-run/{flow_run_id}") == 1


def test_a_failed_run_is_followed_to_its_error(worker_stack, failed_row_run):
    done = follow(worker_stack, failed_row_run["flow_run"]["id"])
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rollout: error: flow run bad-row-") and " failed: " in last
    assert f"{failed_row_run['data'].name}:{failed_row_run['line']}: invalid JSON" in done.stderr


def test_an_unknown_flow_run(worker_stack):
    done = follow(worker_stack, "00000000-0000-0000-0000-000000000000")
    assert done.returncode == 2 and "no flow run 00000000" in done.stderr
    done = follow(worker_stack, "no-such-run")
    assert done.returncode == 2 and "no flow run named or tagged 'no-such-run'" in done.stderr
