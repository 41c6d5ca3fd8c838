"""The run's tie to its Prefect server (issue 27; docs/runs.md, "When the Prefect server goes away").

When the server a run talks to dies mid-run (killed, out of memory, its machine asleep), Prefect alone keeps
training on cached state, fails about a minute later with a ConnectError traceback, then retries event delivery for
minutes before it exits. Instead, a daemon thread of the run's process GETs `<api url>/health` every
PROBE_INTERVAL_S; when the server has not answered for LOST_AFTER_S (or ROLLOUT_SERVER_LOST_AFTER_S, if set) and at
least MIN_FAILURES probes in a row failed, the process prints one line naming the server and the command that
resumes the run, and exits with EXIT_SERVER_LOST. Any HTTP answer counts as alive (a busy server's 503 too, a
gateway's 502/504 not); a refused or timed-out connection is a failure. A blip, a server busy for a few seconds,
this process paused (SIGSTOP, a laptop asleep: monotonic time stops with it) never end a run, and the watch arms
itself only once the server has answered its probe, so a server only Prefect's own client can reach (TLS settings,
a proxy) never ends one either.

Which processes are watched: the `rollout train` process (rollout_cli/main.py: the flow runs in it; its resume
command is the command line) and a process a worker started for one flow run (PREFECT__FLOW_RUN_ID is set; its
resume command is `prefect deployment run` with the run's parameters), from `flows/common.py` `load_run_config`.
A flow called from other Python code (a notebook, the tests) is never watched: ending that interpreter is not
ours to do. Prefect is imported only to name a deployment run's resume command.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable

PROBE_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 5.0
LOST_AFTER_S = 15.0
# Seconds without an answer that end a run, in place of LOST_AFTER_S: longer where the server may be unreachable
# for a while (a server restarted by a supervisor, a flaky network), shorter where a lost server should be found
# sooner (a CI, a laptop). Read by every watched process: the `rollout train` process and a worker's flow runs.
LOST_AFTER_ENV = "ROLLOUT_SERVER_LOST_AFTER_S"
MIN_FAILURES = 3
# EX_TEMPFAIL (sysexits.h): a temporary failure, the command may be retried, which is what resumes the run.
EXIT_SERVER_LOST = 75

_active: ApiWatch | None = None
_active_lock = threading.Lock()


class ApiWatch:
    """Watches `api_url` from a daemon thread and ends the process when it is lost (module docstring). `resume`:
    what the line says after "nothing is lost: ". `before_exit`: called first (given 2 s), e.g. to stop a live
    progress bar so that the terminal gets its cursor back. `end_process(line, exit code)`: the tests' stand-in for
    printing the line and exiting."""

    def __init__(self, api_url: str, resume: str, *, before_exit: Callable[[], None] | None = None,
                 interval_s: float = PROBE_INTERVAL_S, timeout_s: float = PROBE_TIMEOUT_S,
                 lost_after_s: float = LOST_AFTER_S, min_failures: int = MIN_FAILURES,
                 end_process: Callable[[str, int], None] | None = None):
        self.api_url = api_url.rstrip("/")
        self.resume = resume
        self.before_exit = before_exit
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.lost_after_s, self.min_failures = lost_after_s, min_failures
        self._end_process = end_process or _print_and_exit
        self._stop = threading.Event()
        self._answered = threading.Event()  # set while the last probe got an answer
        self._failing_since: float | None = None  # monotonic start of the current run of failed probes
        self._failures = 0
        self.probes = 0  # probes decided so far: what a test waits on instead of the clock
        self._run_exit_code: int | None = None  # set once the run has ended and its result is reported
        self._thread = threading.Thread(target=self._loop, name="rollout-api-watch", daemon=True)

    def start(self) -> ApiWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._answered.set()  # release a settle() waiting on this watch

    def settle(self) -> None:
        """Return at once while the server answers; while it fails to, wait for the verdict: the server answers
        again (return) or is lost (the process ends here). For the caller that just saw the flow end or raise:
        a failure the lost server caused ends in the one line, not in a traceback or a misleading error."""
        if self._failing_since is not None and not self._stop.is_set():
            self._answered.wait(self.lost_after_s + self.interval_s + self.timeout_s)

    def run_ended(self, exit_code: int) -> None:
        """The run's result is reported: a server lost from now on (while Prefect delivers the last log lines and
        events at exit) ends the process with `exit_code` and a warning, not the resume line."""
        self._run_exit_code = exit_code

    def _loop(self) -> None:
        armed = False
        while not self._stop.is_set():
            started = time.monotonic()
            if _answers(self.api_url, self.timeout_s):
                armed = True
                self._failing_since, self._failures = None, 0
                self._answered.set()
            elif armed:
                self._answered.clear()
                self._failures += 1
                if self._failing_since is None:
                    self._failing_since = started
                silent_s = time.monotonic() - self._failing_since
                if silent_s >= self.lost_after_s and self._failures >= self.min_failures and not self._stop.is_set():
                    self._lost(silent_s)
                    return
            self.probes += 1
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def _lost(self, silent_s: float) -> None:
        where = f"the Prefect server at {self.api_url} (no answer for {silent_s:.0f} s)"
        if self._run_exit_code is None:
            line, code = (f"rollout: error: lost {where}; nothing is lost: {self.resume}", EXIT_SERVER_LOST)
        else:
            line, code = (f"rollout: warning: lost {where} before it got the run's last log lines and events; the "
                          f"result above stands", self._run_exit_code)
        if self.before_exit is not None:
            cleanup = threading.Thread(target=self.before_exit, daemon=True)
            cleanup.start()
            cleanup.join(2.0)
        self._end_process(line, code)


def _answers(api_url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s):
            return True
    except urllib.error.HTTPError as exc:
        return exc.code not in (502, 504)  # a gateway whose server is gone; any other status is the server talking
    except (OSError, ValueError):  # refused, reset, timed out, unresolvable; ValueError: an unusable URL
        return False


def _print_and_exit(line: str, code: int) -> None:
    """The line, last on stderr, then the process ends at once.

    os._exit: no finally block, no atexit handler, no Prefect retry loop runs, so nothing lingers, and what the run
    had written stays as a SIGKILL would leave it, which resume is built for: the store makes every object and ref
    visible only whole (rollout_lib/store.py: a staging file fsynced then renamed into place on a local disk, one PUT
    on s3), the metrics file's reader drops a half-written last line (rollout_lib/runlog/metrics_file.py), and
    Prefect takes a half-written task result record for a cache miss (ResultStore.exists) and recomputes it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # what the run printed comes before the line
        except (OSError, ValueError):
            pass
    try:
        ours = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):  # the other threads (Prefect's log and event workers) print nothing after the line
            os.dup2(devnull, fd)
        # A newline first: Prefect's "Error logging to API" message may have left a line open.
        os.write(ours, f"\n{line}\n".encode())
    finally:
        os._exit(code)


def lost_after_s() -> float:
    """LOST_AFTER_S, or the seconds ROLLOUT_SERVER_LOST_AFTER_S gives; ConfigError naming the variable when it
    is not a number of seconds > 0."""
    import math

    from rollout_lib.errors import ConfigError

    value = os.environ.get(LOST_AFTER_ENV, "").strip()
    if not value:
        return LOST_AFTER_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError([(LOST_AFTER_ENV, f"must be a number of seconds > 0 (got {value!r}); unset, a run ends "
                                            f"after {LOST_AFTER_S:g} s without an answer from its Prefect server")])
    return seconds


def watch(api_url: str | None, resume: str, **options) -> ApiWatch | None:
    """Watch `api_url` for this process, in place of the watch running before; None, and nothing watched, without
    an API URL (an ephemeral in-process server dies with the process)."""
    global _active
    if not api_url:
        return None
    with _active_lock:
        if _active is not None:
            _active.stop()
        _active = ApiWatch(api_url, resume, **{"lost_after_s": lost_after_s(), **options}).start()
        return _active


def watch_worker_flow_run() -> None:
    """In a process a worker started for one flow run (its id in PREFECT__FLOW_RUN_ID), watch the run's server,
    unless something already does; anywhere else, nothing. Called as the flows load their settings."""
    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if not flow_run_id or _active is not None:
        return
    from prefect.settings import PREFECT_API_URL

    watch(PREFECT_API_URL.value(), f"once the server answers again, resume with: {_deployment_rerun(flow_run_id)}")


def _deployment_rerun(flow_run_id: str) -> str:
    """`prefect deployment run <flow>/<deployment> --params '<the run's parameters>'`, read while the server is up;
    the same run again finds every finished task in its cache."""
    try:
        from uuid import UUID

        from prefect import get_client

        with get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(UUID(flow_run_id))
            deployment = client.read_deployment(flow_run.deployment_id)
            flow = client.read_flow(flow_run.flow_id)
        return deployment_run_command(flow.name, deployment.name, flow_run.parameters)
    except Exception:  # noqa: BLE001 - no deployment (a served flow's own run), or the server is gone already
        return "run its deployment again with the same parameters"


def deployment_run_command(flow_name: str, deployment_name: str, parameters: dict) -> str:
    command = ["prefect", "deployment", "run", f"{flow_name}/{deployment_name}"]
    if parameters:
        command += ["--params", json.dumps(parameters, separators=(",", ":"))]
    return shlex.join(command)


def cli_rerun(argv: list[str], own_server: bool) -> str:
    """What the line tells a `rollout train` user: the same command line again."""
    command = shlex.join(["rollout", *argv])
    if own_server:  # rollout_cli/local_server.py starts the project-local server again on the next run
        return f"rerun the same command to resume (it starts the server again): {command}"
    return f"once the server answers again, rerun the same command to resume: {command}"
