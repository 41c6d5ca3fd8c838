"""The Prefect server going away mid-run (issue 27, flows/api_watch.py): the run stops within 30 s with one line
naming the server and the command that resumes it, and that command, rerun, ends where an uninterrupted run
ends. The watch itself against a small HTTP server of the test's, the whole path against a real `rollout train`
whose project-local server is SIGKILLed."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from clirun import ROOT, cli_env, run_cli, start_rollout, train_in_process
from flows.api_watch import EXIT_SERVER_LOST, ApiWatch, cli_rerun, deployment_run_command, lost_after_s, watch
from rollout_cli.processes import is_prefect_process, stop_process_group
from rollout_lib.runlog.metrics_file import read_metrics
from rollout_lib.store import ObjectStore

FAST = {"interval_s": 0.05, "timeout_s": 0.5, "lost_after_s": 1.5, "min_failures": 3}


class Health:
    """A /health endpoint on 127.0.0.1 that the test takes down and brings back on the same port."""

    def __init__(self):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
        self.port = self.server.server_address[1]
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self._serve()

    def _serve(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def down(self):
        self.server.shutdown()
        self.server.server_close()

    def up(self):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), _Ok)
        self._serve()


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/api/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _watch(api_url: str, **options) -> tuple[ApiWatch, list]:
    exits: list = []
    return ApiWatch(api_url, "rerun it", end_process=lambda line, code: exits.append((line, code)),
                    **{**FAST, **options}).start(), exits


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_lost_server_ends_the_run_in_one_line_and_a_blip_does_not():
    health = Health()
    watcher, exits = _watch(health.api_url)
    try:
        _wait_for(watcher._answered.is_set)  # armed: the probe got its first answer
        health.down()
        blip_at = time.monotonic()
        # A blip: min_failures probes fail, for much less than lost_after_s, then the server answers again.
        _wait_for(lambda: exits or watcher._failures >= FAST["min_failures"])
        health.up()
        _wait_for(lambda: exits or watcher._answered.is_set())
        # Past lost_after_s since the blip began: a watch that kept counting from it would end the run at once below.
        time.sleep(max(0.0, blip_at + FAST["lost_after_s"] - time.monotonic()))
        assert exits == []
        health.down()
        lost_at = time.monotonic()
        _wait_for(lambda: exits)
        assert time.monotonic() - lost_at >= FAST["lost_after_s"]
        line, code = exits[0]
        assert code == EXIT_SERVER_LOST
        assert line.startswith(f"rollout: error: lost the Prefect server at {health.api_url} (no answer for ")
        assert line.endswith("; nothing is lost: rerun it")
    finally:
        watcher.stop()


def test_a_server_that_never_answered_the_probe_ends_nothing():
    """Nothing listens on the port: every probe fails, for longer than lost_after_s and more than min_failures
    times, which ends an armed watch; this one never got an answer, so it never armed."""
    health = Health()
    health.down()
    watcher, exits = _watch(health.api_url)
    try:
        _wait_for(lambda: exits or watcher.probes >= 1)
        time.sleep(FAST["lost_after_s"])  # since the first probe failed
        probed = watcher.probes
        # The next probe but one began after the threshold: an armed watch would have ended the run there.
        _wait_for(lambda: exits or watcher.probes >= probed + 2)
        assert exits == [] and watcher.probes >= FAST["min_failures"]
    finally:
        watcher.stop()


def test_settle_waits_for_the_verdict_only_while_the_server_fails():
    health = Health()
    watcher, exits = _watch(health.api_url)
    try:
        _wait_for(watcher._answered.is_set)  # armed: the probe got its first answer
        started = time.monotonic()
        watcher.settle()  # answering: returns at once
        assert time.monotonic() - started < 0.1
        health.down()
        _wait_for(lambda: watcher._failing_since is not None)
        watcher.settle()  # failing: returns once the watch has decided (here: lost)
        assert exits and exits[0][1] == EXIT_SERVER_LOST
    finally:
        watcher.stop()


def test_after_the_result_a_lost_server_exits_with_the_runs_code_and_a_warning():
    health = Health()
    watcher, exits = _watch(health.api_url)
    try:
        _wait_for(watcher._answered.is_set)  # armed: the probe got its first answer
        watcher.run_ended(0)
        health.down()
        _wait_for(lambda: exits)
        line, code = exits[0]
        assert code == 0 and line.startswith("rollout: warning: lost the Prefect server at ")
    finally:
        watcher.stop()


def test_no_api_url_watches_nothing_and_the_resume_commands():
    assert watch(None, "rerun") is None and watch("", "rerun") is None
    assert cli_rerun(["train", "rm", "--config", "configs/rm tiny.toml"], own_server=True) == (
        "rerun the same command to resume (it starts the server again): "
        "rollout train rm --config 'configs/rm tiny.toml'")
    assert cli_rerun(["train", "rm"], own_server=False).startswith("once the server answers again, rerun")
    command = deployment_run_command("train-rm", "default", {"config": "configs/rm-tiny.toml",
                                                            "overrides": ["run.name=it's"]})
    assert command == ("prefect deployment run train-rm/default --params "
                       "'{\"config\":\"configs/rm-tiny.toml\",\"overrides\":[\"run.name=it'\"'\"'s\"]}'")
    assert deployment_run_command("train-rm", "default", {}) == "prefect deployment run train-rm/default"


def test_the_lost_after_seconds_are_a_setting_and_a_bad_one_is_refused_before_anything_starts(monkeypatch, capsys,
                                                                                               tmp_path):
    from rollout_cli.main import main

    monkeypatch.delenv("ROLLOUT_SERVER_LOST_AFTER_S", raising=False)
    assert lost_after_s() == 15.0
    monkeypatch.setenv("ROLLOUT_SERVER_LOST_AFTER_S", "40")
    assert lost_after_s() == 40.0
    for bad in ("0", "-3", "soon", "nan"):
        monkeypatch.setenv("ROLLOUT_SERVER_LOST_AFTER_S", bad)
        code = main(["train", "rm", "--config", str(ROOT / "configs/rm-tiny.toml"), "--store", str(tmp_path / "s")])
        assert code == 2
        assert capsys.readouterr().err == (
            f"rollout: error: ROLLOUT_SERVER_LOST_AFTER_S: must be a number of seconds > 0 (got {bad!r}); unset, a "
            "run ends after 15 s without an answer from its Prefect server\n")
        assert not (tmp_path / "s").exists()  # nothing started, nothing written


LOST_AFTER_S = 3


@pytest.mark.slow
def test_killing_the_server_mid_run_stops_it_in_one_line_and_the_rerun_ends_on_the_uninterrupted_checkpoint(
        prefect_server, tmp_path):
    """rm-tiny (4 one-step segments) on the CLI's project-local server, which is SIGKILLed at the first step line:
    the run exits once the server has been silent for ROLLOUT_SERVER_LOST_AFTER_S (3 s here, a user's setting;
    the threshold itself is the tests above) and within 30 s of the kill (EXIT_SERVER_LOST, the line last on
    stderr, no traceback), and the same command rerun (on a new server) resumes from cache and ends on the
    checkpoint an uninterrupted run in a fresh store ends on (the flow in this process, on the session's server).
    Steps cannot outrun the watch: without its server the run starts no next task (measured: none after step 1)."""
    state = tmp_path / "state"
    env = {k: v for k, v in cli_env(ROLLOUT_STATE_DIR=str(state), ROLLOUT_HOME=str(state),
                                    ROLLOUT_SERVER_LOST_AFTER_S=str(LOST_AFTER_S)).items()
           if k not in ("PREFECT_API_URL", "PREFECT_HOME")}

    def args(store):
        return ["train", "rm", "--config", "configs/rm-tiny.toml", "--max-steps", "4", "--store", str(store)]

    def run(store) -> subprocess.CompletedProcess:
        return run_cli(args(store), env=env, timeout=300)

    try:
        err_path, out_path = tmp_path / "killed.err", tmp_path / "killed.out"
        with err_path.open("w") as err, out_path.open("w") as out:
            process = start_rollout(args(tmp_path / "store"), ROOT, env, out, err)
            deadline = time.monotonic() + 120
            while "step 1/4" not in err_path.read_text():
                assert process.poll() is None, err_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "no step line"
                time.sleep(0.05)
            server = json.loads((state / "prefect" / "server.json").read_text())
            os.killpg(server["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
            process.wait(timeout=60)
            took = time.monotonic() - killed_at
        out = out_path.read_text()
        stderr = err_path.read_text()
        assert process.returncode == EXIT_SERVER_LOST, stderr[-3000:]
        assert took < 30 + 3, f"{took:.1f} s from the kill to the exit"
        assert LOST_AFTER_S <= took < 15, took  # the setting's threshold, not the default's 15 s
        assert out == "" and "Traceback" not in stderr
        command = "rollout " + " ".join(args(tmp_path / "store"))
        assert stderr.rstrip("\n").splitlines()[-1] == (
            f"rollout: error: lost the Prefect server at {server['api_url']} (no answer for "
            f"{stderr.rsplit('(no answer for ', 1)[1].split(' s)', 1)[0]} s); nothing is lost: rerun the same "
            f"command to resume (it starts the server again): {command}")
        store = ObjectStore(str(tmp_path / "store"))
        for object_id in store.list_objects():  # whatever the exit left is whole (get_bytes re-hashes)
            store.get_bytes(object_id)

        first = read_metrics(store, "rm-tiny")[0]  # step 1: its segment finished before the kill could stop it
        assert first["step"] == 1

        rerun = run(tmp_path / "store")
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert read_metrics(store, "rm-tiny")[0] == first  # resumed: step 1 came from cache, its record kept
        uninterrupted = train_in_process(*args(tmp_path / "fresh"))  # in this process, on the session's server
        assert json.loads(rerun.stdout)["checkpoint"] == uninterrupted["checkpoint"]
    finally:
        record = state / "prefect" / "server.json"
        if record.exists() and is_prefect_process(pid := json.loads(record.read_text())["pid"]):
            stop_process_group(pid)
