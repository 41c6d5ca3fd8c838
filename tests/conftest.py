"""Test-session set-up: offline, isolated caches, and one real Prefect server for the whole session.

The environment is fixed here, at import time, before any test imports Prefect: Prefect reads its settings when
it is imported, and subprocesses (the CLI, workers) inherit them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SESSION_DIR = Path(tempfile.mkdtemp(prefix="rollout-tests-"))

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# Two pytest-xdist workers on two cores each run torch at `run.torch_threads` (2) threads: OpenMP's default of
# spinning while it waits then burns the cores the other worker needs (the fast tests: 74 s with spinning, 39 s
# without, 53 s on one worker). Waiting changes no result: only how idle threads wait.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["ROLLOUT_CACHE_DIR"] = str(SESSION_DIR / "cache")
os.environ["ROLLOUT_STATE_DIR"] = str(SESSION_DIR / "state")
os.environ["PREFECT_HOME"] = str(SESSION_DIR / "prefect-home")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "examples"))  # the example environments' modules (PYTHONPATH=examples for the CLI)

from clirun import run_cli  # noqa: E402
from rollout_cli.local_server import SERVER_ENV, free_port, is_healthy  # noqa: E402
from rollout_cli.processes import stop_process_group  # noqa: E402

_PORT = free_port()
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{_PORT}/api"
ARTIFACTS_DIR = ROOT / "test-artifacts"


@pytest.fixture(scope="session")
def prefect_server():
    """A real `prefect server start` on 127.0.0.1, shared by every test that needs the API; always stopped."""
    api_url = os.environ["PREFECT_API_URL"]
    log = (SESSION_DIR / "prefect-server.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(_PORT)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**SERVER_ENV, **os.environ},  # the settings users' servers get (rollout_cli/local_server.py)
    )
    try:
        deadline = time.monotonic() + 120
        while not is_healthy(api_url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not start; see {SESSION_DIR / 'prefect-server.log'}")
            time.sleep(0.5)
        yield {"api_url": api_url, "ui_url": api_url.removesuffix("/api"), "pid": process.pid}
    finally:
        stop_process_group(process.pid)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from rollout_lib.model.tiny import build_tiny_qwen2

    return build_tiny_qwen2(SESSION_DIR / "tiny-qwen2")


@pytest.fixture
def store_root(tmp_path) -> str:
    return str(tmp_path / "store")


@pytest.fixture(scope="session")
def s3_options():
    """A moto S3 server with the bucket s3server.BUCKET, shared by the session; yields s3fs storage options."""
    from s3server import moto_s3

    with moto_s3() as options:
        yield options


# --- deployments: the session's server + `rollout stack start` (work pool, `prefect deploy --all`, a worker) ----

# The session's server inherits this when `prefect_server` starts it: the schedule test sees the nightly runs
# created within seconds instead of a minute.
os.environ.setdefault("PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS", "2")

TINY_PAIRS = [
    {"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}.", "rejected": f"Maybe {a + b + 3}? No idea."}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (9, 9)]
]


def write_pairs(path: Path, rows: list[dict], bad_line: int | None = None) -> Path:
    """JSONL of preference pairs; `bad_line` (1-based) replaces that row with malformed JSON."""
    import json

    lines = [json.dumps(row) for row in rows]
    if bad_line is not None:
        lines[bad_line - 1] = '{"prompt": "broken row", "chosen": oops}'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


READ_TIME_FIELDS = ("estimated_run_time", "estimated_start_time_delta")  # Prefect's own __eq__ skips them too


class DeploymentStack:
    """The session's stack seen from a test: start deployment runs as users do (`prefect deployment run`) and
    read what happened through the REST API."""

    terminal = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")

    def __init__(self, record: dict):
        self.api_url = record["api_url"]
        self.ui_url = record["ui_url"]
        self.worker = record["worker"]

    def prefect(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """`prefect ARGS` as typed in this environment (through tests/zygote.py: 2.5 CPU-s of imports saved)."""
        return run_cli(list(args), env=dict(os.environ), stdin=subprocess.DEVNULL, timeout=timeout, module="prefect")

    def run(self, deployment: str = "train-rm/default", timeout: float = 600, **params) -> dict:
        """`prefect deployment run <deployment> --param k=<json> ... --watch`; returns the finished flow run, with
        the command's exit code and output under "cli"."""
        done, flow_run_id = self._deployment_run(deployment, params, watch=timeout)
        flow_run = self.wait(flow_run_id, timeout=60)
        return {**flow_run, "cli": {"returncode": done.returncode, "output": done.stdout + done.stderr}}

    def submit(self, deployment: str = "train-rm/default", **params) -> str:
        """`prefect deployment run` without waiting; returns the flow run id."""
        return self._deployment_run(deployment, params, watch=None)[1]

    def create(self, deployment: str = "train-rm/default", **params) -> str:
        """A flow run of `deployment` with `params` created through the REST API, as `prefect deployment run`
        creates it (and the UI's Run button), without that command's process (2 CPU-s): for tests of what the
        worker and the flow do with a run, not of the command. Returns the flow run id."""
        deployment_id = self.api("GET", f"/deployments/name/{deployment}")["id"]
        return self.api("POST", f"/deployments/{deployment_id}/create_flow_run", {"parameters": params})["id"]

    def _deployment_run(self, deployment: str, params: dict, watch: float | None):
        import json
        import re

        args = ["deployment", "run", deployment]
        if watch is not None:
            args += ["--watch", "--watch-timeout", str(int(watch))]
        for key, value in params.items():
            args += ["--param", f"{key}={json.dumps(value)}"]
        done = self.prefect(*args, timeout=(watch or 0) + 120)
        match = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
        assert match, f"no flow run created:\n{done.stdout}\n{done.stderr}"
        return done, match.group(1)

    def wait(self, flow_run_id: str, timeout: float = 300, states: tuple[str, ...] = terminal) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            flow_run = self.api("GET", f"/flow_runs/{flow_run_id}")
            if flow_run["state"]["type"] in states or time.monotonic() > deadline:
                return flow_run
            time.sleep(0.5)

    def task_runs(self, flow_run_id: str) -> list[dict]:
        """The task runs of a finished flow run, once the server has recorded them all."""
        from clirun import settled

        def read() -> list[dict]:
            runs = self.api("POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}},
                                                          "sort": "EXPECTED_START_TIME_ASC"})
            # computed at each read (a task run left Running by a killed flow run grows them forever): dropped, or
            # `settled` never sees two reads alike and waits its whole timeout
            return [{key: value for key, value in run.items() if key not in READ_TIME_FIELDS} for run in runs]

        return settled(read)

    def artifacts(self, flow_run_id: str) -> list[dict]:
        return self.api("POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})

    def logs(self, flow_run_id: str) -> str:
        logs = self.api("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                                  "sort": "TIMESTAMP_ASC"})
        return "\n".join(entry["message"] for entry in logs)

    def api(self, method: str, path: str, body: dict | None = None, attempts: int = 5):
        """One REST call; retried when the server is briefly overloaded (503: SQLite busy on a loaded machine),
        as Prefect's own client does."""
        import json
        import urllib.error
        import urllib.request

        for attempt in range(attempts):
            request = urllib.request.Request(f"{self.api_url}{path}", method=method,
                                             data=json.dumps(body).encode() if body is not None else None,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return json.loads(response.read() or b"null")
            except urllib.error.HTTPError as exc:
                if exc.code not in (429, 503) or attempt == attempts - 1:
                    raise
            time.sleep(1 + 2 * attempt)


@pytest.fixture(scope="session")
def worker_stack(prefect_server):
    """`rollout stack start --no-schedule` against the session's server (PREFECT_API_URL): the work pool, every
    deployment of prefect.yaml, one process worker polling every second. The worker is always stopped; the
    server belongs to `prefect_server` and is left to it."""
    from rollout_cli import stack

    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_LOGGING_LEVEL": "INFO"}
    try:
        started = run_cli(["stack", "start", "--no-schedule"], env=env, stdin=subprocess.DEVNULL, timeout=300)
        assert started.returncode == 0, f"rollout stack start failed:\n{started.stdout}\n{started.stderr}"
        # It says which schedules run by themselves: none, once --no-schedule paused them.
        assert "no schedule is active: runs start only when asked for" in started.stdout, started.stdout
        record = stack.read_record()
        assert record["server"]["owned"] is False and record["api_url"] == prefect_server["api_url"]
        yield DeploymentStack(record)
    finally:
        stack.stop(log=lambda *_: None)


@pytest.fixture(scope="session")
def failed_row_run(worker_stack) -> dict:
    """A `train-rm/default` run whose training data has a malformed row at line 3: it ends Failed. Shared by the
    API test of the failure path and the browser test that inspects it in the UI."""
    data = write_pairs(SESSION_DIR / "bad-row" / "train.jsonl", TINY_PAIRS, bad_line=3)
    flow_run = worker_stack.run(config="configs/rm-tiny.toml", overrides=[
        f"algorithm.rm.dataset.path={data}", f"run.store={SESSION_DIR / 'bad-row' / 'store'}", "run.name=bad-row",
    ])
    return {"flow_run": flow_run, "data": data, "line": 3}


# --- served models: one vLLM deployment of tiny:qwen2 (2 replicas) for the sessions that ask for it -----------

VLLM_TINY_NAME = "test-tiny"


class ServedTiny:
    """The session's served tiny model as tests see it. Tests may SIGKILL or SIGSTOP its replicas (any process of
    a replica's group); `ensure_running()` brings every replica back on its port before the next test relies on
    it. `pids` follow restarts; `base_urls` never change."""

    def __init__(self, deployment):
        self.name = deployment.name
        self.model_dir = Path(deployment.model_dir)
        self.base_urls = list(deployment.base_urls)
        self._last = deployment

    @property
    def deployment(self):
        from rollout_lib.serving import engine

        self._last = engine.find_deployment(self.name) or self._last
        return self._last

    @property
    def pids(self) -> list[int]:
        return self.deployment.pids

    def ensure_running(self, timeout_s: float = 600) -> "ServedTiny":
        """SIGCONT every replica's process group (a stopped process answers nothing), restart the replicas whose
        server is gone, and wait until every replica answers /v1/models."""
        import signal
        from contextlib import suppress

        from rollout_lib.processes import group_members
        from rollout_lib.serving import engine

        for attempt in range(3):  # a replica whose engine was killed exits a moment later: then restart it too
            deployment = self.deployment
            for pid in deployment.pids:
                if any(engine.is_vllm_process(member.pid) for member in group_members(pid)):
                    with suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGCONT)
            try:
                self._last = engine.restart_dead_replicas(deployment, ready_timeout_s=timeout_s)
                assert self._last.base_urls == self.base_urls
                return self
            except engine.EngineError:
                if attempt == 2:
                    raise
                time.sleep(2)
        return self


@pytest.fixture(scope="session")
def vllm_tiny_session():
    """`rollout serve start tiny:qwen2 --name test-tiny --replicas 2`, as a user runs it (~25-40 s on 2 cores, paid
    only by sessions that use it); always stopped (`rollout serve stop test-tiny`) at the session's end. Tests take
    it through `vllm_tiny`."""
    from rollout_lib.serving import engine

    try:
        started = run_cli(["serve", "start", "tiny:qwen2", "--name", VLLM_TINY_NAME, "--replicas", "2"],
                          env=dict(os.environ), stdin=subprocess.DEVNULL, timeout=900)
        assert started.returncode == 0, f"rollout serve start failed:\n{started.stdout}\n{started.stderr}"
        deployment = engine.find_deployment(VLLM_TINY_NAME)
        assert deployment is not None and len(deployment.replicas) == 2, started.stdout
        yield ServedTiny(deployment)
    finally:
        run_cli(["serve", "stop", VLLM_TINY_NAME], env=dict(os.environ), stdin=subprocess.DEVNULL, timeout=120)


@pytest.fixture
def vllm_tiny(vllm_tiny_session) -> ServedTiny:
    """The session's served tiny model with every replica running as the test starts. A test that kills a replica
    leaves its restart to the next test that needs it, so the group's last test, a kill (test_serving_pool.py), costs
    no restart (a replica start: ~11 CPU-s)."""
    return vllm_tiny_session.ensure_running()


# Session fixtures that start servers: every test using one runs in the same pytest-xdist worker, so the suite starts
# each server once (README: `pytest -n 2 --dist loadgroup`).
# rlhf_reference (test_rlhf_flow.py): the module's reference pipeline, run through the worker stack (rlhf/default)
# and compared with by the module's other tests; in one group it is trained once.
# served_rm (test_served_reward_model.py): its module's served RM; one of its tests puts the RM behind one router with
# the session's vLLM judge, so the module runs in vllm_tiny's group and trains and serves its RM once.
SHARED_SERVERS = {"vllm_tiny": "vllm_tiny", "vllm_tiny_session": "vllm_tiny", "worker_stack": "worker_stack",
                  "failed_row_run": "worker_stack", "rlhf_reference": "worker_stack", "served_rm": "vllm_tiny"}
# The longest groups (seconds on one 2-core worker, measured 2026-11-27 with --durations=0, a quiet AVX-512 machine:
# worker_stack 273, test_policy_engine 270, vllm_tiny 231, test_rl_data_parallel 218, test_task_runners 163,
# test_sharding 162, ... of 3283 in all; test_node_agents, added later: 501 s on a machine at load 15, not measured
# quiet), first in the collected order. pytest-xdist (3.8, `--loadscope-reorder`, its default) hands groups out by
# how many tests each holds, so this order only breaks its ties: replaying a suite's durations through its scheduler
# gave workers ending 856 / 854 s, this order 850 / 860, the ideal longest-first 855 / 855 (helper "wall", 2026-11-28).
LONGEST_GROUPS = ["worker_stack", "test_policy_engine", "vllm_tiny", "test_rl_data_parallel", "test_task_runners",
                  "test_sharding", "test_node_agents", "test_off_policy", "test_distillation", "test_rlhf_flow", "test_data_parallel",
                  "test_multiturn_learn", "test_lora", "test_policy_remote",
                  "test_orchestrator_loss", "test_rl_flow", "test_rm_flow", "test_streamed_scoring",
                  "test_serving_engine", "test_run_metrics"]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    """Group the tests for pytest-xdist's `--dist loadgroup`: a test that uses a session server goes with that
    server's group, every other test with its module (module fixtures, such as a trained teacher, are set up once).
    The longest groups come first."""
    groups = {}
    for item in items:
        group = next((SHARED_SERVERS[name] for name in item.fixturenames if name in SHARED_SERVERS), None)
        groups[item] = group or item.module.__name__.rpartition(".")[2]
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    rank = {group: index for index, group in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: rank.get(groups[item], len(rank)))  # stable: file order within a rank


def pytest_sessionfinish(session, exitstatus):
    """No served model outlives the session: stop whatever a test started and left in the session's state dir."""
    from rollout_lib.serving import engine

    if engine.serve_dir().is_dir():
        engine.stop_all()
