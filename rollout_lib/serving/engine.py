"""Start, find and stop vLLM OpenAI servers for any model reference rollout understands.

A deployment is one served model name and N replicas: each replica its own vLLM process (the API server, which
forks its EngineCore: vllm_server_main.py) on its own port on 127.0.0.1, started detached as the leader of a process
group and recorded in `<state>/serve/<name>.json` (the state dir of rollout_lib.paths), with its log in
`<state>/serve/<name>-<i>.log`. A deployment outlives the process that started it until `stop_deployment` (or
`rollout serve stop`) stops every process of every replica's group.

vLLM lives in its own venv (`.venv-vllm`, or ROLLOUT_VLLM_PYTHON); every server gets SERVER_FLAGS, the ones verified
on these machines (why each: docs/serving.md).

A live-policy deployment (`live_policy=True`, serving/policy_server.py) also runs in vLLM's dev mode
(VLLM_SERVER_DEV_MODE=1: POST /collective_rpc reloads its weights in place); its weights are whatever was last
loaded into it, so it is never reused for a frozen model, nor a frozen one for a policy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import psutil

from rollout_lib.gpu_env import visible_devices
from rollout_lib.hardware import replica_gpus
from rollout_lib.paths import PROJECT_ROOT, state_dir
from rollout_lib.processes import cmdline_contains, free_ports, group_members, port_is_free
from rollout_lib.serving.references import default_max_model_len, default_name, served_model_directory
from rollout_lib.serving.store_fetch import fetch_directory

VLLM_PYTHON_ENV = "ROLLOUT_VLLM_PYTHON"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # opens /collective_rpc (weight reload) and other control endpoints
RUNNERS = ("generate", "pooling")
HOST = "127.0.0.1"  # never another interface: a dev-mode server exposes control endpoints
STOP_GRACE_S = 15.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_START_MARKER = "=== rollout: starting "  # written to a replica's log before each start of it

# The flags every server gets; `extra_args` come after them, so a repeated flag overrides (argparse: last wins).
# processed_logprobs: a sampled token's logprob is that of the distribution it was drawn from (after temperature
# and top_p), the samplers' contract (sampling/base.py); prompt logprobs (scoring) are unprocessed either way.
# A live-policy server's worker extension: it reloads the policy's weights in place and fetches a policy state from
# the run's store, for a server on a node that shares nothing else with the trainer (worker_extension.py; POST
# /collective_rpc, in dev mode).
POLICY_SERVER_EXTENSION = "rollout_lib.serving.worker_extension.PolicyServerExtension"
# vLLM's OpenAI server with its engine core forked rather than spawned on CPUs (a replica ready 6 s sooner).
SERVER_MODULE = "rollout_lib.serving.vllm_server_main"
SERVER_FLAGS = ("--dtype", "float32", "--enforce-eager", "--no-enable-chunked-prefill", "--no-enable-prefix-caching",
                "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log")


class EngineError(RuntimeError):
    """A served model that cannot start or be found; the message names the deployment, its URL and its log."""


# --- where vLLM is -----------------------------------------------------------------------------


def vllm_python() -> Path:
    """The python of vLLM's venv: ROLLOUT_VLLM_PYTHON, else .venv-vllm/bin/python in the checkout."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    python = Path(configured) if configured else PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        where = f"{VLLM_PYTHON_ENV}={configured} does not exist" if configured else ".venv-vllm/bin/python missing"
        raise EngineError(f"vLLM is not installed ({where}): run scripts/setup.sh")
    return python


# --- records --------------------------------------------------------------------------------------------------


@dataclass
class Replica:
    index: int
    pid: int  # the API server's PID, which leads the replica's process group
    port: int
    base_url: str  # the server root, http://127.0.0.1:<port> (OpenAI routes under /v1)
    log: str
    started_at: str

    @property
    def alive(self) -> bool:
        """The recorded process is alive, not a zombie, and still a vLLM process (a PID can be reused)."""
        return is_vllm_process(self.pid)


@dataclass
class Deployment:
    name: str  # the served model name (the `model` field of every request)
    model: str  # the reference as given
    model_dir: str  # what vLLM loads
    runner: str
    max_model_len: int
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set for every replica, over the defaults
    replicas: list[Replica] = field(default_factory=list)
    ready: bool = False  # every replica answered once the start finished
    # The process that started it for its own use (a flow run), which stops it when done; None: started to be kept
    # (`rollout serve start`). A deployment whose owner died without stopping it (SIGKILL) is an orphan: the
    # next user of the same model adopts it (serving/served.py), so it is stopped eventually.
    owner_pid: int | None = None
    # Serves the policy being trained: dev mode on, weights reloaded in place (serving/policy_server.py).
    live_policy: bool = False
    # Replica j's GPUs, its CUDA_VISIBLE_DEVICES (hardware.replica_gpus); empty: every replica sees every GPU.
    gpus: list[list[int]] = field(default_factory=list)

    @property
    def orphaned(self) -> bool:
        return self.owner_pid is not None and not psutil.pid_exists(self.owner_pid)

    @property
    def base_urls(self) -> list[str]:
        return [replica.base_url for replica in self.replicas]

    @property
    def pids(self) -> list[int]:
        return [replica.pid for replica in self.replicas]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> "Deployment":
        replicas = [Replica(**replica) for replica in record.get("replicas", [])]
        return cls(**{**record, "replicas": replicas})

    def describe(self) -> dict:
        """The record, with each replica's liveness and whether it answers now (for `rollout serve status`)."""
        described = self.to_json()
        for replica, shown in zip(self.replicas, described["replicas"]):
            shown["alive"] = replica.alive
            shown["answers"] = shown["alive"] and answers(replica.base_url, self.name)
        return described


def serve_dir() -> Path:
    return state_dir() / "serve"


def _record_path(name: str) -> Path:
    return serve_dir() / f"{name}.json"


SHARED_MEMORY = Path("/dev/shm")


def weights_dirs(name: str) -> tuple[Path, ...]:
    """Where a live-policy deployment's replicas may reload their weights from (serving/weight_sync.py), best
    first: shared memory (tmpfs) when the machine has it, one directory per state directory and deployment, so a
    rerun that adopts an orphaned server writes where it reads and stopping the deployment frees the memory; then
    beside the deployment's record (a container's /dev/shm is often 64 MB: the writer takes the first with room)."""
    fallback = serve_dir() / f"{name}-weights"
    if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK):
        digest = hashlib.blake2b(str(serve_dir().resolve()).encode(), digest_size=6).hexdigest()
        return SHARED_MEMORY / f"rollout-{digest}" / f"{name}-weights", fallback
    return (fallback,)


def _forget(name: str) -> None:
    """Delete a stopped deployment's record and its weights file."""
    _record_path(name).unlink(missing_ok=True)
    for directory in weights_dirs(name):
        shutil.rmtree(directory, ignore_errors=True)
        if directory.parent.parent == SHARED_MEMORY:
            with contextlib.suppress(OSError):  # this state directory's folder, once its last deployment stopped
                directory.parent.rmdir()


def _read_record(name: str) -> Deployment | None:
    try:
        return Deployment.from_json(json.loads(_record_path(name).read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def _write_record(deployment: Deployment) -> None:
    path = _record_path(deployment.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(json.dumps(deployment.to_json(), indent=2))
    staging.replace(path)


@contextlib.contextmanager
def _locked(name: str, blocking: bool = True) -> Iterator[bool]:
    """An exclusive lock on the deployment `name` across processes (a start, a restart, a cleanup); yields
    whether it was taken (always, when blocking)."""
    serve_dir().mkdir(parents=True, exist_ok=True)
    with open(serve_dir() / f".{name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise EngineError(f"served model name {name!r}: use letters, digits, '.', '_', '-' (at most 100, "
                           "starting with a letter or digit)")
    return name


# --- processes ------------------------------------------------------------------------------------------------

_children: dict[int, subprocess.Popen] = {}  # replicas this process started: polled for an early exit, and kept
# referenced so Python does not warn about a running child when the Popen object would be collected


def is_vllm_process(pid: int) -> bool:
    return cmdline_contains(pid, "vllm")


def answers(base_url: str, name: str, timeout_s: float = 2.0) -> bool:
    """Whether the server at `base_url` serves `name` now (GET /v1/models)."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout_s) as response:
            models = json.loads(response.read())
    except (OSError, ValueError):
        return False
    return any(entry.get("id") == name for entry in models.get("data", []) if isinstance(entry, dict))


def _server_env(deployment: Deployment, replica_count: int, index: int = 0) -> dict[str, str]:
    """The environment of replica `index`: the caller's, the defaults verified here, the deployment's own `env`,
    then its GPUs (`Deployment.gpus`: placed, it sees only those). The replicas share the cores: each gets
    cores // replicas OpenMP threads (ROLLOUT_VLLM_THREADS overrides)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = os.environ.get("ROLLOUT_VLLM_THREADS") or str(max(1, cores // max(1, replica_count)))
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes far more
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # do not pin the cores the trainer shares
    # The model runs in the engine-core process, not a third "Worker" process: ready sooner, samples faster, the
    # same tokens (docs/serving.md, "One process per replica").
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["OMP_NUM_THREADS"] = threads  # the engine runs 1 thread unless this is set (~70% speed on 2 cores)
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    if "--enable-lora" in deployment.extra_args:  # a LoRA policy's adapter is loaded (in place) while it runs
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    # The server's entry point (vllm_server_main.py) and a live policy's worker extension (worker_extension.py) are
    # imported from this checkout.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(PROJECT_ROOT), env.get("PYTHONPATH"))))
    placed = visible_devices(deployment.gpus[index]) if deployment.gpus else {}
    return {**env, **deployment.env, **placed}


def _server_command(deployment: Deployment, port: int) -> list[str]:
    return [
        str(vllm_python()), "-m", SERVER_MODULE,
        "--model", deployment.model_dir, "--served-model-name", deployment.name,
        "--host", HOST, "--port", str(port), "--max-model-len", str(deployment.max_model_len),
        *SERVER_FLAGS, *(["--runner", "pooling"] if deployment.runner == "pooling" else []),
        *(["--worker-extension-cls", POLICY_SERVER_EXTENSION] if deployment.live_policy else []),
        *deployment.extra_args,
    ]


def _launch(deployment: Deployment, index: int, port: int, replica_count: int) -> Replica:
    """Start replica `index` on `port`, detached (its own session and process group)."""
    log = serve_dir() / f"{deployment.name}-{index}.log"
    command = _server_command(deployment, port)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with log.open("ab") as handle:
        handle.write(f"\n{_START_MARKER}{started_at}: {' '.join(command)}\n".encode())
        handle.flush()
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=_server_env(deployment, replica_count, index), cwd=serve_dir(),
                                   start_new_session=True)
    _children[process.pid] = process
    return Replica(index=index, pid=process.pid, port=port, base_url=f"http://{HOST}:{port}", log=str(log),
                   started_at=started_at)


def _exit_code(replica: Replica) -> int | None:
    """The replica's exit code once its process has exited (None while it runs; -1 when it is gone but was not our
    child, or is no vLLM process any more)."""
    process = _children.get(replica.pid)
    if process is not None:
        return process.poll()
    return None if replica.alive else -1


def wait_ready(deployment: Deployment, timeout_s: float = 600.0, replicas: Sequence[Replica] | None = None) -> None:
    """Wait until every replica (or those given) answers /v1/models with the deployment's name; EngineError
    naming the URL and the end of its log when one exits first or the timeout passes."""
    pending = list(deployment.replicas if replicas is None else replicas)
    deadline = time.monotonic() + timeout_s
    while pending:
        for replica in list(pending):
            if answers(replica.base_url, deployment.name):
                pending.remove(replica)
                continue
            code = _exit_code(replica)
            if code is not None:
                how = f"exited with code {code}" if code >= 0 else "exited"
                raise EngineError(f"vLLM server for {deployment.name!r} at {replica.base_url} {how} before it was "
                                   f"ready{_log_excerpt(replica)}")
        if not pending:
            break
        if time.monotonic() > deadline:
            replica = pending[0]
            raise EngineError(f"vLLM server for {deployment.name!r} at {replica.base_url} did not answer "
                               f"/v1/models within {timeout_s:.0f}s{_log_excerpt(replica)}")
        time.sleep(0.5)


_NOISE = ("Route: ", "Available routes are", "warnings.warn(", "DeprecationWarning", "is deprecated and")
_CARETS = re.compile(r"^[\s^~]*$")  # a traceback's underline
_ERROR = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")


def _log_since_start(path: str | Path) -> list[str]:
    """The lines of a replica's log since its latest start (at most its last 256 kB)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 256_000))
            text = handle.read().decode(errors="replace")
    except OSError:
        return []
    if _START_MARKER in text:
        text = text.rsplit(_START_MARKER, 1)[-1].split("\n", 1)[-1]
    return [line.rstrip() for line in text.splitlines()]


def log_tail(path: str | Path, lines: int = 10) -> list[str]:
    """The last `lines` meaningful lines of a replica's log since its latest start (no blank lines, no route
    listing, no deprecation warnings, no traceback underlines)."""
    kept = [line for line in _log_since_start(path)
            if line.strip() and not _CARETS.match(line) and not any(noise in line for noise in _NOISE)]
    return kept[-lines:]


def log_root_cause(path: str | Path) -> str | None:
    """The first exception a replica's log reports since its latest start (`ValueError: ...`): vLLM's last lines
    are often the API server's own traceback ("Engine core initialization failed. See root cause above")."""
    for line in _log_since_start(path):
        match = _ERROR.search(line)
        if match and " WARNING " not in line:
            return f"{match.group(1)}: {match.group(2)}"
    return None


def _log_excerpt(replica: Replica) -> str:
    cause = log_root_cause(replica.log)
    tail = log_tail(replica.log)
    shown = "\n".join(f"  {line}" for line in tail) if tail else "  (nothing)"
    return f"{': ' + cause if cause else ''}; last lines of {replica.log}:\n{shown}"


def _stop_groups(pids: Sequence[int], grace_s: float = STOP_GRACE_S) -> None:
    """Stop the process groups the replicas' servers lead: SIGTERM, then SIGKILL after `grace_s`, and wait until
    every member is gone. A group is signalled only while it still holds a vLLM process (a dead leader's children
    included); a recorded PID may belong to an unrelated process by now."""
    members = {pid: group_members(pid) for pid in pids}
    groups = [pid for pid in pids if any(is_vllm_process(member.pid) for member in members[pid])]
    processes = [member for pid in groups for member in members[pid]]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for pid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
                os.killpg(pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        if _wait_gone(processes, wait_s):
            break
    for pid in pids:
        process = _children.pop(pid, None)
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=1)  # reap our own child
    for member in processes:  # a live policy's fetched states (store_fetch.py): a model's size in shared memory
        shutil.rmtree(fetch_directory(member.pid), ignore_errors=True)


def _wait_gone(processes: Sequence[psutil.Process], timeout_s: float) -> bool:
    """Whether all of `processes` ended (a zombie counts as ended) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [process for process in processes if _running(process)]
        if not running:
            return True
        if time.monotonic() > deadline:
            return False
        for process in running:  # reap our own children as they end
            child = _children.get(process.pid)
            if child is not None:
                child.poll()
        time.sleep(0.1)


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# --- deployments ----------------------------------------------------------------------------------------------


def start_deployment(reference, *, name: str | None = None, replicas: int = 1, port: int | None = None,
                     store_url: str | None = None, max_model_len: int | None = None, runner: str = "generate",
                     extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                     ready_timeout_s: float = 600.0, owner_pid: int | None = None,
                     live_policy: bool = False, gpus: Sequence[int] = ()) -> Deployment:
    """Serve `reference` as `name` on `replicas` vLLM servers (the first on `port` if given, the others on free
    ports), started in parallel; return once every replica answers. A deployment of that name already running
    the same model directory with the same runner is reused as it is (dead replicas restarted); the same name
    serving anything else is an error. When a replica exits or the timeout passes, everything started is stopped
    and EngineError names the URL and the end of its log. `live_policy`: a policy server, in dev mode (module
    docstring). `gpus`: split evenly over the replicas, each seeing only its share (hardware.replica_gpus)."""
    if runner not in RUNNERS:
        raise EngineError(f"runner {runner!r}: expected one of {', '.join(RUNNERS)}")
    if replicas < 1:
        raise EngineError(f"replicas must be at least 1 (got {replicas})")
    if name is not None:
        _check_name(name)
    vllm_python()  # not installed: say so before converting or exporting anything
    model_dir = served_model_directory(reference, store_url)
    uri = reference if isinstance(reference, str) else reference.uri
    name = _check_name(name or default_name(reference, model_dir))
    with _locked(name):
        existing = _read_record(name)
        if existing is not None and not any(replica.alive for replica in existing.replicas):
            _drop(existing)
            existing = None
        if existing is not None:
            if (existing.model_dir != str(model_dir) or existing.runner != runner
                    or existing.live_policy != live_policy):
                what = "a live policy" if existing.live_policy else existing.runner
                raise EngineError(f"served model name {name!r} is already running {existing.model_dir} "
                                   f"({what}); stop it first (rollout serve stop {name}) or pick another name")
            return _restart_dead(existing, ready_timeout_s)
        if port is not None and not port_is_free(port):
            raise EngineError(f"cannot serve {name!r} at http://{HOST}:{port}: port {port} is already in use")
        ports = ([port] if port is not None else []) + [p for p in free_ports(replicas + 1) if p != port]
        deployment = Deployment(name=name, model=uri, model_dir=str(model_dir), runner=runner,
                                max_model_len=max_model_len or default_max_model_len(model_dir),
                                extra_args=list(extra_args),
                                env={**(env or {}), **({DEV_MODE_ENV: "1"} if live_policy else {})},
                                owner_pid=owner_pid, live_policy=live_policy,
                                gpus=replica_gpus(list(gpus), replicas))
        try:
            for i in range(replicas):
                deployment.replicas.append(_launch(deployment, i, ports[i], replica_count=replicas))
                _write_record(deployment)  # recorded at once: a start killed halfway is still stoppable
            wait_ready(deployment, ready_timeout_s)
        except BaseException:
            _stop_groups([replica.pid for replica in deployment.replicas if replica.pid])
            _record_path(name).unlink(missing_ok=True)
            raise
        deployment.ready = True
        _write_record(deployment)
        return deployment


def find_deployment(name: str) -> Deployment | None:
    """The recorded deployment `name` while any of its replicas runs; a record none of whose processes is a live
    vLLM process any more is dropped (and what is left of its groups stopped)."""
    deployment = _read_record(name)
    if deployment is None or any(replica.alive for replica in deployment.replicas):
        return deployment
    with _locked(name, blocking=False) as locked:
        if locked:  # not while a start or restart of it is under way
            _drop(deployment)
    return None


def _drop(deployment: Deployment, grace_s: float = 2.0) -> None:
    """Stop what is left of a deployment's groups (of one none of whose servers runs: a killed API server's
    EngineCore and Worker), delete its record."""
    _stop_groups(deployment.pids, grace_s)
    _forget(deployment.name)


def claim_orphan(name: str, owner_pid: int) -> Deployment | None:
    """Make `owner_pid` the owner of the deployment `name` if it is still an orphan (its owner died), atomically: of
    two processes that try, one gets it (and stops it when done), the other None."""
    with _locked(name):
        deployment = _read_record(name)
        if deployment is None or not deployment.orphaned:
            return None
        deployment.owner_pid = owner_pid
        _write_record(deployment)
        return deployment


def _recorded_names() -> list[str]:
    return sorted(path.stem for path in serve_dir().glob("*.json")) if serve_dir().is_dir() else []


def running_deployments() -> list[Deployment]:
    """Every recorded deployment that still runs, by name."""
    return [deployment for deployment in map(find_deployment, _recorded_names()) if deployment is not None]


def stop_deployment(name: str, grace_s: float = STOP_GRACE_S) -> Deployment | None:
    """Stop every process of every replica of `name` and drop its record; the deployment, or None when none of
    that name was recorded."""
    deployment = _read_record(name)
    if deployment is not None:
        _drop(deployment, grace_s)
    return deployment


def stop_all(grace_s: float = STOP_GRACE_S) -> list[Deployment]:
    """Stop every recorded deployment (all their groups at once); the deployments stopped."""
    deployments = [deployment for deployment in map(_read_record, _recorded_names()) if deployment is not None]
    _stop_groups([pid for deployment in deployments for pid in deployment.pids], grace_s)
    for deployment in deployments:
        _forget(deployment.name)
    return deployments


def restart_dead_replicas(deployment: Deployment | str, ready_timeout_s: float = 600.0) -> Deployment:
    """Start again, each on its own port, the replicas of `deployment` whose process is gone (what is left of their
    groups is stopped first); return the deployment as now recorded, once every restarted replica answers."""
    name = deployment if isinstance(deployment, str) else deployment.name
    with _locked(name):
        current = _read_record(name)
        if current is None:
            if isinstance(deployment, str):
                raise EngineError(f"no served model {name!r} is recorded in {serve_dir()}")
            current = deployment  # every process and the record are gone: start it again from what the caller has
        return _restart_dead(current, ready_timeout_s)


def _restart_dead(deployment: Deployment, ready_timeout_s: float) -> Deployment:
    """restart_dead_replicas, with the deployment's lock held; then wait until every replica answers."""
    dead = [replica for replica in deployment.replicas if not replica.alive]
    if not dead:
        wait_ready(deployment, ready_timeout_s)  # a start still under way (its starter was killed) may be pending
        return deployment
    _stop_groups([replica.pid for replica in dead], grace_s=2.0)  # orphaned EngineCores may hold the port
    restarted = []
    try:
        for replica in dead:
            _wait_port_free(replica, timeout_s=30.0)
            new = _launch(deployment, replica.index, replica.port, replica_count=len(deployment.replicas))
            deployment.replicas[deployment.replicas.index(replica)] = new
            restarted.append(new)
            _write_record(deployment)
        wait_ready(deployment, ready_timeout_s)
    except BaseException:
        _stop_groups([replica.pid for replica in restarted])
        raise
    deployment.ready = True
    _write_record(deployment)
    return deployment


def _wait_port_free(replica: Replica, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not port_is_free(replica.port):
        if time.monotonic() > deadline:
            raise EngineError(f"cannot restart replica {replica.index} at {replica.base_url}: port {replica.port} "
                               "is still in use")
        time.sleep(0.2)
