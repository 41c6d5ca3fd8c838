"""The collapse guard in a real train-rl run (rollout_lib/rl/collapse.py; the guard itself: tests/test_collapse.py).
The tiny policy's reward is 0 whatever it writes, so from step 1 every group's rewards are equal: no rl signal.
With `action = "fail"` the CLI run stops at the step that makes the collapse `patience` steps long, in one
`rollout: error:` line and exit code 1, with those steps in the store; a rerun with `action = "warn"` (not part of
the training identity: the same run name, every finished stage from cache) trains on and says the collapse once,
as a WARNING log line of its flow run and in its summary."""

from __future__ import annotations

import logging

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    LogFilter,
    LogFilterFlowRunId,
)

from clirun import ROOT, final_result, run_rollout, settled, task_run_states
from rollout_lib.runlog import read_metrics
from rollout_lib.store import ObjectStore

pytestmark = pytest.mark.slow  # it trains the tiny model (3 steps) and talks to a Prefect server

COLLAPSED = ("rl collapsed at step 1: reward 0.0 for 2 steps: every group's rewards are equal, no rl signal; check "
             "the reward and the prompts' difficulty")


def flow_run_logs(flow_run_id: str) -> list[tuple[int, str]]:
    def read() -> list[tuple[int, str]]:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return sorted((log.level, log.message) for log in logs)

    return settled(read)


def test_a_collapsed_run_fails_in_one_line_and_its_rerun_with_warn_trains_on_saying_it_once(prefect_server,
                                                                                              tmp_path):
    config = tmp_path / "zero.toml"
    config.write_text((ROOT / "configs/rl-tiny.toml").read_text()
                      .replace('"data/rl-tiny-prompts.jsonl"', f'"{ROOT / "data/rl-tiny-prompts.jsonl"}"')
                      .replace('function = "target_length"', 'function = "example_rewards:always_zero"')
                      .replace('kwargs = { target = 12, unit = "words" }', ""))
    store = tmp_path / "store"
    args = ["train", "rl", "--config", str(config), "--store", str(store), "--max-steps", "3",
            "--set", "algorithm.rl.envs[0].prompts_per_step=2", "--set", "algorithm.rl.envs[0].sampling.group_size=4",
            "--set", "algorithm.rl.envs[0].sampling.max_tokens=8", "--set", "algorithm.rl.collapse.patience=2"]

    failed = run_rollout(*args, "--set", "algorithm.rl.collapse.action=fail",
                         PYTHONPATH=str(ROOT / "tests"))  # where example_rewards lives, outside the library
    assert failed.returncode == 1, failed.stderr[-3000:]
    error_lines = [line for line in failed.stderr.splitlines() if line.startswith("rollout: error:")]
    assert len(error_lines) == 1, failed.stderr[-3000:]
    assert error_lines[0].startswith(f"rollout: error: flow run failed: {COLLAPSED}; stopped by "
                                     "algorithm.rl.collapse.action = \"fail\": the trained steps are kept, a rerun "
                                     "with action \"warn\" trains on")
    assert "sample-and-score-step-3" not in failed.stdout + failed.stderr
    assert [record["step"] for record in read_metrics(ObjectStore(str(store)), "rl-tiny")] == [1, 2]

    # The rerun with the guard's other setting: the same training (its name's claim holds), steps 1-2 from cache. A
    # CLI process, so that what its terminal shows is what is checked.
    rerun = run_rollout(*args, "--set", "algorithm.rl.collapse.action=warn", PYTHONPATH=str(ROOT / "tests"))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = final_result(rerun)
    terminal = [line for line in rerun.stderr.splitlines() if "rl collapsed" in line]
    assert len(terminal) == 1 and "WARNING | Flow run 'rl-tiny-" in terminal[0], rerun.stderr[-3000:]
    assert len(resumed["reward_curve"]) == 3 and set(resumed["reward_curve"]) == {0.0}
    states = task_run_states(resumed["flow_run_id"])
    assert [states[f"train-step-{k}"] for k in (1, 2, 3)] == ["Cached", "Cached", "Completed"], states
    said = [(level, message) for level, message in flow_run_logs(resumed["flow_run_id"]) if "rl collapsed" in message]
    assert len(said) == 1 and said[0][0] == logging.WARNING and said[0][1].startswith(COLLAPSED), said
    assert terminal[0].endswith(f" - {said[0][1]}")
    with get_client(sync_client=True) as client:
        summary, = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["rl-tiny-summary"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[resumed["flow_run_id"]])))
    assert f"- **warning**: {said[0][1]}" in summary.data
    print(error_lines[0], terminal[0], sep="\n")
