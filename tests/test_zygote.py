"""tests/zygote.py, the pre-imported parent of the tests' CLI processes: its child is the CLI a plain interpreter
runs, in the caller's directory, environment and PYTHONPATH, with the same output and exit code; a run whose
environment changes what the preloaded libraries read at import is started as a plain interpreter instead."""

from __future__ import annotations

import subprocess

import pytest

import zygote
from clirun import ROOT, cli_env, run_cli, start_rollout

REWARD_FROM_TESTS = ["train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run", "--set",
                     'algorithm.rl.envs[0].rewards=[{function="example_rewards:always_zero"}]']


def forked_and_plain(monkeypatch, args: list[str], env: dict, cwd=ROOT) -> tuple:
    forked = run_cli(args, cwd=cwd, env=env)
    monkeypatch.setenv("ROLLOUT_TEST_ZYGOTE", "0")
    plain = run_cli(args, cwd=cwd, env=env)
    monkeypatch.delenv("ROLLOUT_TEST_ZYGOTE")
    return forked, plain


@pytest.mark.slow
def test_a_forked_cli_prints_and_exits_as_a_plain_interpreter_in_the_callers_directory_and_path(monkeypatch,
                                                                                                tmp_path):
    with open(tmp_path / "out", "w") as out:  # really forked: not a Popen
        started = start_rollout(["--help"], ROOT, cli_env(), out, out)
        assert isinstance(started, zygote.ForkedProcess) and started.wait(timeout=120) == 0
    # A relative PYTHONPATH is the caller's directory's: the reward module is found in tests/.
    forked, plain = forked_and_plain(monkeypatch, REWARD_FROM_TESTS, cli_env(PYTHONPATH="tests"))
    assert forked.returncode == plain.returncode == 0, forked.stderr[-2000:]
    assert forked.stdout == plain.stdout and '"example_rewards:always_zero"' in forked.stdout
    # Without it the module is not found: the same one line and exit 2 both ways.
    forked, plain = forked_and_plain(monkeypatch, REWARD_FROM_TESTS, cli_env())
    assert forked.returncode == plain.returncode == 2 and forked.stderr == plain.stderr
    assert forked.stderr.endswith("cannot find module 'example_rewards' on the Python path\n"), forked.stderr
    # The caller's environment and directory: rollout's home from ROLLOUT_HOME.
    forked = run_cli(["runs"], cwd=tmp_path, env=cli_env(ROLLOUT_HOME=str(tmp_path / "home")))
    assert (forked.returncode, forked.stderr) == (2, f"rollout: error: no store at {tmp_path / 'home' / 'store'}\n")


def test_a_forked_prefect_command_reads_its_own_environment_as_a_plain_one_does(monkeypatch, tmp_path):
    """`prefect ARGS` through the zygote (the deployment tests' `prefect deployment run`): Prefect's settings are the
    child's environment's, not those the zygote imported Prefect under."""
    env = {**cli_env(), "PREFECT_API_URL": "http://localhost:4321/api", "PREFECT_HOME": str(tmp_path / "home")}
    with open(tmp_path / "out", "w") as out:  # really forked: not a Popen
        started = start_rollout(["version"], ROOT, env, out, out, module="prefect")
        assert isinstance(started, zygote.ForkedProcess) and started.wait(timeout=120) == 0
    forked = run_cli(["config", "view"], env=env, module="prefect")
    monkeypatch.setenv("ROLLOUT_TEST_ZYGOTE", "0")
    plain = run_cli(["config", "view"], env=env, module="prefect")
    assert forked.returncode == plain.returncode == 0, forked.stderr[-2000:] + plain.stderr[-2000:]
    assert forked.stdout == plain.stdout
    assert "PREFECT_API_URL='http://localhost:4321/api' (from env)" in forked.stdout, forked.stdout
    assert f"PREFECT_HOME='{tmp_path / 'home'}' (from env)" in forked.stdout, forked.stdout


def test_only_variables_read_at_import_keep_a_run_from_being_forked():
    server = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": "/a", "OMP_WAIT_POLICY": "PASSIVE"}
    assert zygote.forkable({**server, "PYTHONPATH": "tests", "ROLLOUT_TEST_KILL_RANK_AT_STEP": "1:2"}, server)
    assert not zygote.forkable({**server, "HF_HUB_OFFLINE": "0"}, server)
    assert not zygote.forkable({**server, "ATEN_CPU_CAPABILITY": "avx2"}, server)
    assert not zygote.forkable({k: v for k, v in server.items() if k != "OMP_WAIT_POLICY"}, server)
    # The CLI's own import-time defaults count as set: leaving them out changes nothing.
    assert zygote.forkable({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_a_killed_child_reports_the_signal_as_popen_does(tmp_path):
    import signal

    with open(tmp_path / "out", "w") as out:
        started = start_rollout(["train", "rm", "--config", "configs/rm-tiny.toml", "--dry-run"], ROOT, cli_env(),
                                out, out, stdin=subprocess.DEVNULL)
        assert isinstance(started, zygote.ForkedProcess) and started.poll() is None
        started.send_signal(signal.SIGKILL)
        assert started.wait(timeout=60) == -signal.SIGKILL and started.poll() == -signal.SIGKILL


# What Prefect's settings and logging are in a process (tests/zygote.py imports Prefect under its own environment
# and its children follow theirs: rollout_cli/prefect_settings.py): printed as JSON. argv[1]: "fresh" imports
# Prefect under the environment it was started with; "followed" imports it under another first (the ZYGOTE_* values
# below), then takes the one it was started with back and calls `follow_environment`, as a forked CLI does.
PREFECT_STATE = r"""
import json, logging, os, sys
target = dict(os.environ)
if sys.argv[1] == "followed":
    os.environ.update(PREFECT_API_URL="http://127.0.0.1:9/api", PREFECT_HOME=os.environ["ZYGOTE_HOME"],
                      PREFECT_LOGGING_LEVEL="ERROR", PREFECT_LOGGING_EXTRA_LOGGERS="other_lib",
                      PREFECT_TASKS_DEFAULT_RETRIES="0")
import prefect.main
from prefect.logging.configuration import PROCESS_LOGGING_CONFIG
from prefect.settings import get_current_settings
if sys.argv[1] == "followed":
    os.environ.clear(); os.environ.update(target)
    from rollout_cli.prefect_settings import follow_environment
    follow_environment()
names = ["", *PROCESS_LOGGING_CONFIG["loggers"], "rollout_lib", "other_lib", "prefect.flow_runs.child"]
def shown(name):
    logger = logging.getLogger(name or None)
    return [logger.level, logger.propagate, logger.disabled,
            sorted([type(h).__name__, h.level, getattr(h.formatter, "_fmt", None)] for h in logger.handlers)]
print(json.dumps({"settings": get_current_settings().model_dump(mode="json"),
                  "home_created": os.path.isdir(os.environ["PREFECT_HOME"]),
                  "loggers": {name: shown(name) for name in names}}, sort_keys=True, default=str))
"""


@pytest.mark.slow
def test_prefect_imported_under_another_environment_follows_the_clis_as_a_fresh_import_would(tmp_path):
    import json
    import logging
    import sys

    # Every setting from the environment, the profile, the home directory Prefect creates, every logger's level,
    # propagation and handlers (the extra loggers' API handler included): as a fresh interpreter has them.
    env = {**cli_env(), "PREFECT_API_URL": "http://localhost:4321/api", "PREFECT_HOME": str(tmp_path / "home"),
           "PREFECT_LOGGING_LEVEL": "DEBUG", "PREFECT_LOGGING_EXTRA_LOGGERS": "rollout_lib",
           "PREFECT_TASKS_DEFAULT_RETRIES": "3", "ZYGOTE_HOME": str(tmp_path / "zygote-home")}
    fresh, followed = (subprocess.run([sys.executable, "-c", PREFECT_STATE, how], env=env, cwd=ROOT, text=True,
                                      capture_output=True, timeout=120) for how in ("fresh", "followed"))
    assert fresh.returncode == followed.returncode == 0, fresh.stderr[-2000:] + followed.stderr[-2000:]
    fresh, followed = json.loads(fresh.stdout), json.loads(followed.stdout)
    assert fresh["settings"]["api"]["url"] == "http://localhost:4321/api" and fresh["home_created"]
    assert fresh["loggers"]["prefect"][0] == logging.DEBUG and fresh["loggers"]["rollout_lib"][3]
    for part in ("settings", "home_created", "loggers"):
        assert followed[part] == fresh[part], part
    assert (tmp_path / "zygote-home").is_dir()  # the other environment was really imported under


@pytest.mark.slow
def test_a_forked_run_talks_to_its_own_server_logs_at_its_own_level_and_makes_its_own_prefect_home(
        prefect_server, tmp_path):
    # The zygote imported Prefect with the worker's settings: the session server as 127.0.0.1, its PREFECT_HOME,
    # PREFECT_LOGGING_LEVEL=WARNING. This child names the same server as localhost (what Prefect's own "View at"
    # line is built from), another home, and INFO (that line is INFO).
    api_url = prefect_server["api_url"].replace("127.0.0.1", "localhost")
    assert api_url != prefect_server["api_url"]
    env = cli_env(PREFECT_API_URL=api_url, PREFECT_HOME=str(tmp_path / "home"))
    assert zygote.zygote_for(env).env["PREFECT_LOGGING_LEVEL"] == "WARNING" != env["PREFECT_LOGGING_LEVEL"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        started = start_rollout(["train", "rm", "--config", "configs/rm-tiny.toml", "--max-steps", "1", "--store",
                                 str(tmp_path / "store"), "--verbose"], ROOT, env, out, err)
        assert isinstance(started, zygote.ForkedProcess) and started.wait(timeout=300) == 0
    stderr = (tmp_path / "err").read_text()
    assert f"View at {api_url.removesuffix('/api')}/runs/flow-run/" in stderr, stderr[-3000:]
    assert (tmp_path / "home").is_dir()


@pytest.mark.slow
def test_a_worker_whose_own_environment_moved_in_an_import_time_variable_gets_a_new_zygote(monkeypatch, capsys):
    # A library may set such a variable in the test process itself (rollout_lib/data/sources.py sets datasets'
    # HF_DATASETS_*): every later CLI run's environment then differs from the zygote's, and without a new zygote each
    # would start as a plain interpreter (the suite of 9c985a2 ran so from then on, and this file failed).
    first = zygote.zygote_for(cli_env())
    monkeypatch.setenv("HF_ROLLOUT_TEST_MOVED", "1")  # HF_*: read at import; a name no earlier test has set
    moved = zygote.zygote_for(cli_env())
    assert first is not None and moved is not None and moved is not first
    assert moved.env["HF_ROLLOUT_TEST_MOVED"] == "1"
    assert "the worker's environment changed in ['HF_ROLLOUT_TEST_MOVED']: a new zygote" in capsys.readouterr().err
