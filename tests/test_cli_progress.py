"""`rollout train`'s terminal output: the progress bars fed by step_events and the summary (rollout_cli/progress.py)."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
from rich.console import Console

from rollout_cli.progress import TrainingProgress, flow_run_url, stdout_to_stderr, summary_lines, tracebacks_hidden
from rollout_lib import step_events

URL = "http://127.0.0.1:4200/runs/flow-run/abc"


def budget(max_steps: int) -> SimpleNamespace:
    return SimpleNamespace(settings=SimpleNamespace(budget=SimpleNamespace(max_steps=max_steps)))


def terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=140, color_system=None), out


def test_flow_run_url_is_the_api_url_without_api():
    assert flow_run_url("http://127.0.0.1:4200/api", "abc") == URL
    assert flow_run_url("http://127.0.0.1:4200/api/", "abc") == URL


def test_rm_summary_held_out_accuracy_before_after():
    result = {"checkpoint": "ck-rm", "eval_before": {"accuracy": 0.5, "pairs": 4},
              "eval_after": {"accuracy": 0.75, "pairs": 4}, "last_metrics": {"accuracy": 1.0}}
    assert summary_lines("rm", result, URL) == [
        "held-out accuracy: 0.500 -> 0.750", "final checkpoint: ck-rm", f"flow run: {URL}"]


def test_rm_summary_without_held_out_is_train_accuracy_first_to_last():
    result = {"checkpoint": "ck-rm", "eval_before": None, "eval_after": None, "last_metrics": {"accuracy": 1.0}}
    observed = {"rm": ({"accuracy": 0.25}, {"accuracy": 1.0})}
    assert summary_lines("rm", result, URL, observed)[0] == "train accuracy (first -> last step): 0.250 -> 1.000"
    assert summary_lines("rm", result, None)[0] == "train accuracy (first -> last step): last 1.000"  # all cached
    assert summary_lines("rm", result, None)[-1] == "final checkpoint: ck-rm"


def test_sft_summary_held_out_loss():
    result = {"checkpoint": "ck-sft", "eval_before": {"loss": 2.5, "tokens": 32},
              "eval_after": {"loss": 1.25, "tokens": 32}, "last_metrics": {"loss": 1.0}}
    assert summary_lines("sft", result, URL)[0] == "held-out loss: 2.5000 -> 1.2500"


def test_rl_summary_reward_and_held_out_curves():
    result = {"checkpoint": "ck-rl", "reward_curve": [0.1, 0.2, 0.4],
              "eval_curves": {"eval/math/reward_mean": [[0, 0.3], [2, 0.35], [3, 0.5]]}}
    assert summary_lines("rl", result, URL) == [
        "mean reward (first -> last step): 0.100 -> 0.400",
        "held-out eval/math/reward_mean (step 0 -> 3): 0.300 -> 0.500",
        "final checkpoint: ck-rl", f"flow run: {URL}"]


def test_rlhf_summary_names_each_stage():
    result = {"checkpoint": "ck-rl", "reward_curve": [0.0, 0.5], "eval_curves": {},
              "stages": {"sft": {"checkpoint": "ck-sft"}, "rm": {"checkpoint": "ck-rm", "eval_after": {"accuracy": 1.0}},
                         "rl": {"checkpoint": "ck-rl"}}}
    observed = {"sft": ({"loss": 3.0}, {"loss": 2.0})}
    assert summary_lines("rlhf", result, URL, observed) == [
        "sft: train loss (first -> last step): 3.0000 -> 2.0000", "rm: held-out accuracy after 1.000",
        "rl: mean reward (first -> last step): 0.000 -> 0.500", "final checkpoint: ck-rl", f"flow run: {URL}"]


def test_the_bar_follows_published_steps():
    console, out = terminal()
    with TrainingProgress("rl", budget(4), console=console) as watching:
        step_events.publish(1, {"reward_mean": 0.25, "loss": 0.5, "tokens": 100})
        step_events.publish(2, {"reward_mean": 0.5, "loss": 0.25, "tokens": 100})
        task = watching.progress.tasks[0]
        assert (task.completed, task.total) == (2, 4)
        assert task.fields["metric"] == "reward 0.500 loss 0.2500"
        assert task.fields["rate"].endswith("tok/s")
    assert watching.observed() == {"rl": ({"reward_mean": 0.25, "loss": 0.5, "tokens": 100},
                                          {"reward_mean": 0.5, "loss": 0.25, "tokens": 100})}
    text = out.getvalue()
    assert "2/4" in text and "reward 0.500 loss 0.2500" in text
    step_events.publish(3, {"loss": 0.0})  # unsubscribed on exit
    assert watching.progress.tasks[0].completed == 2


def test_rlhf_gets_a_bar_per_stage_when_steps_start_again():
    config = SimpleNamespace(stage_config=lambda stage: budget({"sft": 2, "rm": 3, "rl": 2}[stage]))
    console, out = terminal()
    with TrainingProgress("rlhf", config, console=console) as watching:
        for stage_steps, metrics in ((2, {"loss": 1.0}), (3, {"loss": 0.5, "accuracy": 0.75}),
                                     (2, {"reward_mean": 0.5, "loss": 0.1})):
            for step in range(1, stage_steps + 1):
                step_events.publish(step, metrics)
    assert [(task.description, task.completed, task.total) for task in watching.progress.tasks] == [
        ("sft", 2, 2), ("rm", 3, 3), ("rl", 2, 2)]
    assert "acc 0.75" in out.getvalue() and "reward 0.500" in out.getvalue()


def test_a_plain_stream_gets_no_live_bar_and_nothing_breaks():
    out = io.StringIO()
    with TrainingProgress("rm", budget(2), console=Console(file=out)) as watching:
        step_events.publish(1, {"loss": 0.7, "accuracy": 0.5})
        step_events.publish(2, {"loss": 0.6, "accuracy": 1.0})
    assert "\x1b[" not in out.getvalue()  # no cursor movement, no colour
    assert watching.observed()["rm"][1]["accuracy"] == 1.0


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_console_handlers_print_no_traceback_while_other_handlers_keep_it():
    out = io.StringIO()
    console_handler = logging.StreamHandler(out)
    console_handler.console = Console(file=io.StringIO())  # what marks Prefect's console handlers
    api_handler = ListHandler()  # the API's: the UI's copy of the record
    logger = logging.getLogger("test-tracebacks-hidden")
    logger.propagate = False
    for handler in (api_handler, console_handler):
        logger.addHandler(handler)
    try:
        with tracebacks_hidden():
            try:
                raise ValueError("loss is nan")
            except ValueError:
                logger.exception("Task run failed with exception: %r", "boom")
        assert out.getvalue() == "Task run failed with exception: 'boom'\n"
        assert api_handler.records[0].exc_info is not None  # the record itself is untouched
        try:
            1 / 0
        except ZeroDivisionError:
            logger.exception("after")  # the formatter is restored on exit
        assert "Traceback" in out.getvalue().split("'boom'\n", 1)[1]
    finally:
        for handler in (api_handler, console_handler):
            logger.removeHandler(handler)


def test_what_the_run_prints_goes_to_stderr_even_from_child_processes(capfd):
    with stdout_to_stderr():
        print("from a reward function")
        subprocess.run([sys.executable, "-c", "print('from a child process')"], check=True)
    print("{}")
    out, err = capfd.readouterr()
    assert out == "{}\n"
    assert err == "from a reward function\nfrom a child process\n"


@pytest.mark.slow
def test_train_prints_bar_and_summary_on_stderr_and_json_on_stdout(prefect_server, tmp_path):
    from clirun import final_result, run_rollout

    done = run_rollout("train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={tmp_path / 'store'}")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # stdout is one JSON document, nothing else
    assert result == final_result(done)
    summary = done.stderr.splitlines()
    url = f"{prefect_server['ui_url']}/runs/flow-run/{result['flow_run_id']}"
    assert summary.count(f"final checkpoint: {result['checkpoint']}") == 1 and summary.count(f"flow run: {url}") == 1
    assert summary[-1] == f"flow run: {url}"  # the summary ends the output
    assert "Loading weights" not in done.stderr and "it/s]" not in done.stderr  # no transformers tqdm bar
    assert any(line.startswith("train accuracy (first -> last step): ") for line in done.stderr.splitlines())
    assert "2/2" in done.stderr  # the bar as it ended, printed once: stderr is no terminal

    quiet = run_rollout("train", "rm", "--config", "configs/rm-tiny.toml", "--set",
                        f"run.store={tmp_path / 'store'}", "--quiet")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert final_result(quiet)["checkpoint"] == result["checkpoint"]
    assert "flow run: " not in quiet.stderr


def test_a_tripped_reward_breaker_ends_the_run_with_its_top_cause_on_the_one_line(capsys):
    import asyncio
    import pickle

    from prefect.states import exception_to_failed_state

    from rollout_cli.main import _report
    from rollout_lib.reward.results import RewardResult, TooManyRewardsMissingError, raise_if_too_many_missing

    top = "compute_score: TypeError: compute_score() missing 1 required positional argument: 'ground_truth'"
    results = ([RewardResult(1.0)] * 20 + [RewardResult(None, top)] * 9
               + [RewardResult(None, "compute_score: ValueError: not a number")] * 3)
    with pytest.raises(TooManyRewardsMissingError) as tripped:
        raise_if_too_many_missing(results, 0.25, setting="algorithm.rl.reward_loop.max_missing_fraction")
    failure = pickle.loads(pickle.dumps(tripped.value))  # as a failed task's persisted exception comes back
    assert failure.error_counts == tripped.value.error_counts and str(failure) == str(tripped.value)
    state = asyncio.run(exception_to_failed_state(failure))
    assert _report("rl", state, URL, None, verbose=False) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "rollout: error: flow run failed: 12 of 32 rewards missing (38%), more than "
        f"algorithm.rl.reward_loop.max_missing_fraction = 0.25 allows; top cause (9x): {top} (logs and tracebacks: "
        f"{URL}, or rerun with --verbose)"]


@pytest.mark.slow
def test_a_failing_run_ends_with_one_line_and_no_traceback_unless_verbose(prefect_server, tmp_path):
    from clirun import run_rollout

    # An absurd learning rate: step 1 is finite, its update blows the weights up, step 2's loss is NaN.
    args = ["train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={tmp_path / 'store'}",
            "--set", "algorithm.rm.optimizer.lr=1e30", "--max-steps", "3"]
    failed = run_rollout(*args)
    assert (failed.returncode, failed.stdout) == (1, ""), failed.stderr[-3000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("rollout: error: flow run failed: train step 2: NonFiniteLossError: loss is nan"), last
    assert f"logs and tracebacks: {prefect_server['ui_url']}/runs/flow-run/" in last and "--verbose" in last
    assert "Traceback" not in failed.stderr and len(failed.stderr.splitlines()) < 30, failed.stderr

    verbose = run_rollout(*args, "--verbose")
    assert verbose.returncode == 1
    assert "Traceback" in verbose.stderr
    assert verbose.stderr.strip().splitlines()[-1].startswith("rollout: error: flow run failed: train step 2")
