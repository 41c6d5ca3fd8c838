"""Run the `rollout` CLI as a user would: a subprocess against the session's Prefect server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, TypeVar

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def rollout_command(*args: str, module: str = "rollout_cli") -> list[str]:
    return [sys.executable, "-m", module, *args]


def cli_env(**extra: str) -> dict:
    return {**os.environ, "PREFECT_LOGGING_LEVEL": "INFO", **extra}


def start_rollout(args: list[str], cwd: Path, env: dict, stdout, stderr, stdin=None, module: str = "rollout_cli"):
    """`python -m rollout_cli ARGS` (`module`: `python -m prefect ARGS`) started as a process: a child of the
    worker's pre-imported parent (tests/zygote.py) where its environment allows, else a plain interpreter. Returns a
    Popen or what stands for one (pid, poll, wait, send_signal, kill, returncode)."""
    from zygote import zygote_for

    zygote = zygote_for(env)
    if zygote is None:
        return subprocess.Popen(rollout_command(*args, module=module), cwd=cwd, env=env, stdin=stdin, stdout=stdout,
                                stderr=stderr)
    with open(os.devnull, "rb") if stdin == subprocess.DEVNULL else nullcontext() as devnull:
        stdin_fd = devnull.fileno() if devnull is not None else (stdin if stdin is not None else 0)
        return zygote.popen(args, cwd, env, stdin_fd, _fd(stdout), _fd(stderr), module=module)


def _fd(stream) -> int:
    return stream if isinstance(stream, int) else stream.fileno()


def run_cli(args: list[str], cwd: Path = ROOT, env: dict | None = None, timeout: float = 600,
            stdin=None, module: str = "rollout_cli") -> subprocess.CompletedProcess:
    """As `subprocess.run(rollout_command(*args, module=module), cwd=cwd, env=env, stdin=stdin,
    capture_output=True, text=True, timeout=timeout)`, through `start_rollout`."""
    import tempfile

    env = cli_env() if env is None else env
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = start_rollout(list(args), cwd, env, out, err, stdin=stdin, module=module)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(rollout_command(*args, module=module), process.returncode, out.read(),
                                           err.read())


def run_rollout(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return run_cli(list(args), env=cli_env(**env), timeout=timeout)


def on_other_node(home: Path, *args: str) -> subprocess.CompletedProcess:
    """`rollout ...` as typed on another node: a working directory and a home (ROLLOUT_HOME, so its own serve
    records, logs and cache) of its own beside `home`, no Prefect server of ours; nothing shared but the code and
    whatever store its arguments name."""
    work = home.parent / "node-work"
    work.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLOUT_STATE_DIR", "PREFECT_API_URL")}
    return run_cli(list(args), cwd=work, env={**env, "ROLLOUT_HOME": str(home)}, stdin=subprocess.DEVNULL)


def final_result(completed: subprocess.CompletedProcess) -> dict:
    """The result `rollout train` prints on success: its stdout, one JSON document and nothing else."""
    return json.loads(completed.stdout)


def train_in_process(*args: str) -> dict:
    """What `run_rollout("train", KIND, "--config", PATH, "--set", ..., "--store", URL)` then `final_result` give,
    with the flow run in this process instead of a CLI process (seconds of imports and start-up saved): for the
    uninterrupted reference runs of resume tests, where the CLI itself is not what is tested. Takes `train`, the
    kind, --config, --set, --store, --name, --max-steps and --nproc (after the --set ones, as the CLI applies them);
    the session's Prefect server must be up (the `prefect_server` fixture)."""
    assert args[0] == "train", args
    kind, rest, config, overrides, shortcuts = args[1], list(args[2:]), None, [], []
    while rest:
        option = rest.pop(0)
        if option in ("--quiet", "--verbose"):  # the terminal's business, not the flow's
            continue
        value = rest.pop(0)
        if option == "--config":
            config = value
        elif option == "--set":
            overrides.append(value)
        elif option == "--store":
            shortcuts.append(f"run.store={value}")
        elif option == "--name":
            shortcuts.append(f"run.name={value}")
        elif option == "--max-steps":
            shortcuts.append(f"algorithm.{kind}.budget.max_steps={value}")
        elif option == "--nproc":
            shortcuts.append(f"algorithm.{kind}.hardware.nproc={value}")
        else:
            raise ValueError(f"train_in_process takes --config, --set, --store, --name, --max-steps and --nproc, "
                             f"not {option}")
    if kind == "rl":
        from flows.train_rl import train_rl as flow
    elif kind == "sft":
        from flows.train_sft import train_sft as flow
    elif kind == "rm":
        from flows.train_rm import train_rm as flow
    else:
        raise ValueError(f"train_in_process: no flow for {kind!r}")
    state = flow(config=str(ROOT / config), overrides=[*overrides, *shortcuts], return_state=True)
    result = state.result()
    return {"flow_run_id": str(state.state_details.flow_run_id), **result}


def run_until_then_kill(args: list[str], marker: str, log_path: Path, timeout: float = 600,
                        env: dict | None = None, after_s: float = 0.0) -> str:
    """Start the CLI with `args`, SIGKILL it as soon as `marker` shows in its output (or `after_s` seconds after);
    return that output.

    Fails if the process exits on its own first (the kill would prove nothing) or the marker never comes. The run
    is --verbose: its terminal keeps Prefect's per-task lines (`train-steps-1-8' - Finished`) markers wait for."""
    with log_path.open("w") as log:
        process = start_rollout([*args, "--verbose"], ROOT, env or cli_env(), log, log)
        deadline = time.monotonic() + timeout
        while marker not in log_path.read_text():
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{marker!r} never appeared"
            time.sleep(0.02)
        time.sleep(after_s)
        assert process.poll() is None, f"the run ended within {after_s:.2f} s of {marker!r}: no kill to test"
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    return log_path.read_text()


def run_and_act_at(args: list[str], marker: str, action: Callable[[], None], log_path: Path,
                   timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the CLI with `args`; call `action()` (SIGKILL a server, say) as soon as `marker` shows in its output,
    then let the run go on to its end. Fails if the run ends before the marker shows. --verbose, as
    `run_until_then_kill`: markers are Prefect's per-task lines."""
    err_path = log_path.with_suffix(".err")
    with log_path.open("w") as out, err_path.open("w") as err:
        process = start_rollout([*args, "--verbose"], ROOT, cli_env(), out, err)
        deadline = time.monotonic() + timeout
        while marker not in log_path.read_text() + err_path.read_text():
            assert process.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{marker!r} never appeared"
            time.sleep(0.02)
        action()
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    return subprocess.CompletedProcess(args, process.returncode, log_path.read_text(), err_path.read_text())


def settled(read: Callable[[], T], timeout: float = 30.0) -> T:
    """`read()` once the server's view has stopped changing: the server writes task runs in batches (at most
    TASK_RUN_FLUSH_S late), so a read right after a run ends can miss its last task runs."""
    from rollout_cli.local_server import TASK_RUN_FLUSH_S

    deadline = time.monotonic() + timeout
    previous = read()
    while True:
        time.sleep(1.5 * TASK_RUN_FLUSH_S)
        current = read()
        if current == previous or time.monotonic() > deadline:
            return current
        previous = current


def task_run_states(flow_run_id: str) -> dict[str, str]:
    """Task run name -> state name (Completed, Cached, ...) of one flow run, from the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    def read() -> dict[str, str]:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        # A task run the server has created but not yet given a state (its first state is written in a later batch)
        # reads as None; `settled` reads again until nothing changes.
        return {run.name: run.state.name if run.state else None for run in runs}

    return settled(read)


def metrics_table(run_name: str) -> dict[str, list]:
    """A run's per-step metrics artifact (columns: name -> one value per step), as the UI shows it."""
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"{run_name}-metrics"])))
    data = max(artifacts, key=lambda artifact: artifact.created).data
    return json.loads(data) if isinstance(data, str) else data
