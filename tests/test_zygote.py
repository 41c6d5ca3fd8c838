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
