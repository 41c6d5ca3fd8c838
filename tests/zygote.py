"""A parent for the `rollout` (and `prefect`) CLI processes the tests start, with torch, transformers and Prefect
already imported.

Why: every CLI process imports torch, transformers' modeling code and Prefect (5.5 CPU-s on a 2-core machine) before
it does anything, and the suite starts over a hundred of them (docs/hardware.md, "Where the suite's CPU goes"). This
process imports torch, transformers, Prefect, matplotlib and pandas once (and the third-party libraries Prefect's
client and a training run import), then forks a child per CLI run: the child is a real process of its own (its pid, its argv, its working
directory, its environment, its stdin/stdout/stderr; it can be SIGKILLed, its children are orphaned as a CLI's are),
and runs `python -m rollout_cli ARGS` (or `python -m prefect ARGS`) from there, rollout imported fresh. Prefect,
imported here under this process's environment, is made to follow the child's: the CLI rebuilds Prefect's settings
and logging from its environment at its start and whenever it sets PREFECT_API_URL or PREFECT_HOME itself
(rollout_cli/prefect_settings.py; tests/test_zygote.py holds a child's to a fresh interpreter's), and a `prefect`
child has them rebuilt the same way before Prefect's CLI starts. What differs
from a user's start is only that the interpreter and those imports are shared;
`ROLLOUT_TEST_ZYGOTE=0` runs every CLI process as a plain interpreter instead.

Limits, kept honest: children share the hash seed of this process (a user's each draw their own), and a run whose
environment differs from this process's in a variable the preloaded libraries read at import (HF_*, TORCH*, ...;
PREFECT_PLUGINS_*, whose start-up hooks run once, at Prefect's import) is not forked here: the client starts it as a
plain interpreter (`forkable`). Prefect's first-run telemetry notice (interactive terminals only) is not shown in a
child.

ROLLOUT_TEST_ZYGOTE_LOG=PATH (in the environment the zygote starts with) appends one JSON line per reaped child to
PATH: its argv and its CPU seconds (its own and its reaped children's, from wait4): what docs/hardware.md's
per-child figures are.

Protocol (a Unix socket): the client sends one JSON request {argv, cwd, env} with its stdin, stdout and stderr as
file descriptors; the server answers one line {"pid": N} when the child is forked and one line {"returncode": R}
(Popen's convention: -signal when killed) when it has been reaped.

    python tests/zygote.py SOCKET_PATH
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import sys

PRELOADED = ("torch", "transformers.modeling_utils")
# The third-party libraries Prefect's client and rollout's CLI import after those (0.6-0.9 CPU-s a run here), none
# of which reads the environment at import but fsspec (its FSSPEC_* config: in IMPORT_TIME_ENV).
PRELOADED_DEPENDENCIES = ("httpx", "httpcore", "griffe", "pydantic", "pydantic_settings", "pydantic_extra_types",
                          "jsonschema", "referencing", "rich.console", "rich.traceback", "websockets", "fsspec",
                          "coolname", "pathspec", "prometheus_client", "pendulum", "psutil", "click", "uvicorn",
                          "starlette", "cloudpickle", "orjson", "toml", "blake3", "humanize", "slugify", "anyio")
# Prefect (~0.7-1.0 CPU-s a CLI run): it builds its settings and logging from the environment at import, under this
# process's environment here; the CLI builds them again from its own (rollout_cli/prefect_settings.py). Then
# matplotlib (~0.45 CPU-s: every training run draws its curves, flows/common.py): its rc file, backend and font cache
# are found through MPL*, HOME and XDG_* (in IMPORT_TIME_ENV). Then pyarrow and pandas (~0.55 CPU-s: reading a
# dataset imports pandas through pyarrow's `from_pydict`; ARROW_*, PANDAS_*: in IMPORT_TIME_ENV; libarrow's jemalloc
# starts its background thread at load and keeps itself consistent across fork with its own atfork handlers) and
# the rest a training run imported after all those (its profile, docs/hardware.md).
PRELOADED_LATE = ("prefect.main", "prefect.artifacts", "matplotlib.figure", "matplotlib.ticker",
                  "matplotlib.backends.backend_agg", "PIL.Image", "pyarrow", "pandas", "fastapi", "tokenizers",
                  "graphviz", "tabulate", "email_validator", "tomli_w")
# Read by the preloaded libraries (or the interpreter) when they are imported: a request that sets any of these
# otherwise than this process was started with runs as a plain interpreter. Prefect's plugins run their start-up
# hooks at its import, which the CLI's re-read of the settings does not redo.
IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE", "TRANSFORMERS_", "TORCH", "PYTORCH_", "ATEN_", "OMP_", "MKL_", "ONEDNN_",
                   "DNNL_", "KMP_", "TOKENIZERS_", "CUDA_", "PYTHON", "LD_", "FSSPEC_", "PREFECT_PLUGINS_",
                   "PREFECT_EXPERIMENTS_PLUGINS_", "MPL", "HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "ARROW_",
                   "PYARROW_", "PANDAS_", "MALLOC_CONF", "JE_")
# What `rollout_cli.main` sets before anything imports transformers (its tqdm bars, verbosity and offline mode are
# read at import): the same defaults, here, before the preload.
CLI_IMPORT_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
                       "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def import_time_env(env: dict) -> dict:
    # PYTHONPATH is not among them: the child builds its sys.path from its own (`_child_sys_path`).
    return {key: value for key, value in env.items() if key.startswith(IMPORT_TIME_ENV) and key != "PYTHONPATH"}


def _python_path(env: dict) -> list[str]:
    return [os.path.abspath(entry) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


def _base_sys_path() -> list[str]:
    """This process's sys.path without its script's directory and its PYTHONPATH: what every child shares."""
    own = set(_python_path(dict(os.environ)))
    return [entry for entry in sys.path[1:] if entry not in own]


def _child_sys_path(request_env: dict, base: list[str]) -> list[str]:
    """The sys.path `python -m` would start with in the child's (current) directory and environment: the
    directory, its PYTHONPATH (absolute, as the interpreter makes it), then `base`."""
    return [os.getcwd(), *_python_path(request_env), *base]


def forkable(env: dict, server_env: dict) -> bool:
    """Whether a child with `env` would import what a server started with `server_env` imported, as it did."""
    return import_time_env({**CLI_IMPORT_DEFAULTS, **env}) == import_time_env({**CLI_IMPORT_DEFAULTS, **server_env})


# --- server ----------------------------------------------------------------------------------------------------


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"), as the interpreter does
    return 1


# What a child may run as `python -m MODULE ARGS`: the rollout CLI, and Prefect's (the tests' `prefect deployment run`,
# `prefect flow-run retry`: 2.5 CPU-s each as a plain interpreter here).
CHILD_MODULES = ("rollout_cli", "prefect")


def _run_child(request: dict, fds: list[int], base_sys_path: list[str]) -> None:
    """In the forked child: become `python -m MODULE ARGS` (MODULE: the request's, rollout_cli by default) in the
    request's directory and environment."""
    import atexit
    import runpy
    import signal
    import threading
    import traceback

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, 65536)  # as Popen's close_fds: the server's sockets are not the CLI's business
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(request["cwd"])
    sys.path[:] = _child_sys_path(request["env"], base_sys_path)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-m", *request["argv"]]
    module = request.get("module", "rollout_cli")
    code = 0
    try:
        if module not in CHILD_MODULES:
            raise ValueError(f"tests/zygote.py runs {', '.join(CHILD_MODULES)}, not {module!r}")
        if module == "prefect":  # the rollout CLI does this itself as it starts (rollout_cli/prefect_settings.py)
            from rollout_cli.prefect_settings import follow_environment

            follow_environment()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - an uncaught error ends the process as the interpreter ends it
        traceback.print_exc()
        code = 1
    # The interpreter's own shutdown order: wait for non-daemon threads, run atexit, flush.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def serve(socket_path: str) -> None:
    for key, value in CLI_IMPORT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    base_sys_path = _base_sys_path()
    for module in PRELOADED:
        __import__(module)
    for module in (*PRELOADED_DEPENDENCIES, *PRELOADED_LATE):
        try:  # a speed-up only: a library some set-up lacks (an optional extra's) is imported by the child if used
            __import__(module)
        except ImportError:
            pass
    import threading

    assert threading.active_count() == 1, "a preloaded library started a thread: forking would lose it"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    argvs: dict[int, list[str]] = {}
    cpu_log = os.environ.get("ROLLOUT_TEST_ZYGOTE_LOG")
    print("ready", flush=True)
    while True:
        for key, _ in selector.select(timeout=0.02):
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                _run_child(request, fds, base_sys_path)
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = connection
            argvs[pid] = request["argv"]
        while children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            argv = argvs.pop(pid, None)
            if cpu_log:
                with open(cpu_log, "a") as log:
                    log.write(json.dumps({"argv": argv, "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)}) + "\n")
            connection = children.pop(pid, None)
            if connection is not None:
                returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    connection.sendall(json.dumps({"returncode": returncode}).encode() + b"\n")
                except OSError:
                    pass  # the client is gone: nobody to tell
                connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])


# --- client ----------------------------------------------------------------------------------------------------


class ForkedProcess:
    """The part of `subprocess.Popen` the tests use, for a child of the server: pid, poll, wait, send_signal, kill
    and returncode."""

    def __init__(self, connection: socket.socket, args: list[str]):
        self.args = args
        self._connection = connection
        self._reader = connection.makefile("r")
        self.pid = json.loads(self._reader.readline())["pid"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        import select

        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._finish(self._reader.readline())  # one short line, sent whole when the child was reaped
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if self.returncode is None:
            self._connection.settimeout(timeout)
            try:
                line = self._reader.readline()
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            finally:
                self._connection.settimeout(None)
            self._finish(line)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def _finish(self, line: str) -> None:
        if not line:
            raise RuntimeError(f"tests/zygote.py is gone: the exit of pid {self.pid} is unknown")
        self.returncode = json.loads(line)["returncode"]
        self._reader.close()
        self._connection.close()


class Zygote:
    """The server, started on first use by the process that needs it (one per pytest-xdist worker) and stopped
    with it."""

    def __init__(self):
        import atexit
        import subprocess
        import tempfile

        self._dir = tempfile.mkdtemp(prefix="rollout-zygote-")
        self.socket_path = os.path.join(self._dir, "socket")
        self.env = dict(os.environ)
        self._process = subprocess.Popen([sys.executable, __file__, self.socket_path], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, env=self.env)
        assert self._process.stdout.readline().strip() == b"ready", "tests/zygote.py did not start"
        atexit.register(self.stop)

    def stop(self) -> None:
        self._process.kill()
        self._process.wait()

    def popen(self, args: list[str], cwd, env: dict, stdin: int, stdout: int, stderr: int,
              module: str = "rollout_cli") -> ForkedProcess:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.socket_path)
        request = json.dumps({"argv": list(args), "cwd": str(cwd), "env": env, "module": module}).encode()
        socket.send_fds(connection, [request], [stdin, stdout, stderr])
        return ForkedProcess(connection, list(args))


_zygote: Zygote | None = None


def zygote_for(env: dict) -> Zygote | None:
    """The worker's server when a CLI process with `env` can be its child; None to start a plain interpreter."""
    global _zygote
    if os.environ.get("ROLLOUT_TEST_ZYGOTE", "1") == "0":
        return None
    if _zygote is not None and not forkable(dict(os.environ), _zygote.env):
        # The worker's own environment moved in a variable read at import (a library set one in-process, e.g.
        # datasets' HF_DATASETS_*): children of the old server would no longer be this worker's, so start anew.
        before, now = import_time_env(_zygote.env), import_time_env(dict(os.environ))
        changed = sorted(key for key in {*before, *now} if before.get(key) != now.get(key))
        print(f"tests/zygote.py: the worker's environment changed in {changed}: a new zygote", file=sys.stderr)
        _zygote.stop()
        _zygote = None
    if _zygote is None:
        _zygote = Zygote()
    return _zygote if forkable(env, _zygote.env) else None
