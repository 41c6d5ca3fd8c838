"""Nodes that join by themselves (docs/scale.md, "Node agents"): node 1 is a node agent, `rollout node start --pool P
--node 1`, a real Prefect process worker started from a directory of its own with a Prefect home of its own on
127.0.0.1, against the session's server; node 0 is the flow, in this process (`train_in_process`). Once the
agent runs, the test runs nothing for node 1: the flow submits node 1's part of its group (one a run) to it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from clirun import ROOT, train_in_process
from rollout_cli.processes import stop_process_group
from rollout_lib.errors import ConfigError
from rollout_lib.trainer.data_parallel import HOLD_AT_STEP_ENV, DataParallelError
from rollout_lib.trainer.node_parts import NodePart, node_deployment
from test_nodes import free_port

POOL = "test-nodes"  # each test its own (POOL-a, POOL-b): its part runs are its own
LOST_AFTER_S = 3


def sft_args(store: Path, *more: str) -> list[str]:
    return ["train", "sft", "--config", "configs/sft-tiny.toml", "--set", f"run.store={store}",
            "--set", "algorithm.sft.gradient_accumulation=2", "--set", "algorithm.sft.budget.max_steps=2",
            "--set", "algorithm.sft.checkpoint_interval=1", *more]


def over_two_nodes(pool: str, timeout_s: float = 120) -> list[str]:
    # a part lost with its agent is called lost LOST_AFTER_S after node 0 failed (hardware.node_lost_after_s; 20 s
    # by default): a killed agent never reports, so the wait is all the test would spend there
    return ["--set", "algorithm.sft.hardware.nnodes=2", "--set", f"algorithm.sft.hardware.node_pool={pool}",
            "--set", f"algorithm.sft.hardware.rdzv_endpoint=127.0.0.1:{free_port()}",
            "--set", f"algorithm.sft.hardware.rdzv_timeout_s={timeout_s}",
            "--set", f"algorithm.sft.hardware.node_lost_after_s={LOST_AFTER_S}"]


class NodeAgent:
    """`rollout node start --pool POOL --node 1` from `home`/work, PREFECT_HOME `home`/prefect: started, stopped,
    killed with everything it started (its node lost)."""

    def __init__(self, home: Path, pool: str, env: dict[str, str] | None = None, directory: Path | None = None):
        self.pool = pool
        self.directory = directory
        self.work = home / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PREFECT_HOME": str(home / "prefect"), "PYTHONPATH": str(ROOT), **(env or {})}
        self.env.pop("ROLLOUT_STATE_DIR", None)
        self.log = home / "agent.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> "NodeAgent":
        begun = self.log.stat().st_size if self.log.exists() else 0  # the log is shared by this home's agents
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rollout_cli", "node", "start", "--pool", self.pool, "--node", "1", "--poll-s", "1",
                 *(["--dir", str(self.directory)] if self.directory else [])],
                cwd=self.work, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        deadline = time.monotonic() + 120
        while b"started!" not in self.log.read_bytes()[begun:]:  # this worker's own "Worker ... started!"
            assert self.process.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.5)
        return self

    def kill_node(self) -> None:
        """SIGKILL the agent and every process it started (the flow run's own session included): node 1 lost."""
        for process in self.processes():
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait()

    def processes(self) -> list[psutil.Process]:
        agent = psutil.Process(self.process.pid)
        return [*agent.children(recursive=True), agent]

    def freeze_node(self) -> None:
        """SIGSTOP the agent and every process it started: node 1 still there (its sockets open) but silent, as a
        hung or cut-off machine; nothing reports an end."""
        for process in self.processes():
            try:
                process.suspend()
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            stop_process_group(self.process.pid)


@pytest.fixture
def node_home(prefect_server, tmp_path) -> Path:
    return tmp_path / "node-1"


def part_runs(prefect_server, pool: str) -> list[dict]:
    """Node 1's part flow runs in `pool` (name, state), oldest first."""
    import json
    import urllib.request

    body = json.dumps({"flow_runs": {"work_queue_name": {"any_": ["node-1"]}}, "work_pools": {"name": {"any_": [pool]}},
                       "sort": "EXPECTED_START_TIME_ASC"}).encode()
    request = urllib.request.Request(f"{prefect_server['api_url']}/flow_runs/filter", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return [{"name": run["name"], "state": run["state"]["type"], "message": run["state"].get("message")}
                for run in json.loads(response.read())]


def test_a_part_is_structured_parameters_checked_before_anything_runs():
    part = NodePart(node_rank=1, nnodes=2, nproc=1, endpoint="node0:29400", run_id="rollout-abc", timeout_s=300,
                    module="rollout_lib.trainer.segment_worker", backend="gloo", threads=2, gpus=(4, 5))
    assert NodePart.from_parameters(part.to_parameters()) == part
    assert part.command()[-4:] == ["-m", "rollout_lib.trainer.segment_worker", "--receive-spec", "gloo"]
    assert part.environment({})["CUDA_VISIBLE_DEVICES"] == "4,5" and part.environment({})["OMP_NUM_THREADS"] == "2"
    for field, value, says in [("module", "os; rm -rf /", "module must be one of"),
                               ("endpoint", "node0:29400 --x", 'endpoint must be "host:port"'),
                               ("node_rank", 0, "node_rank must be 1..nnodes-1"),
                               ("run_id", "a b", "run_id must be")]:
        with pytest.raises(ValueError, match=says):
            NodePart.from_parameters({**part.to_parameters(), field: value})
    with pytest.raises(ValueError, match="unknown field"):
        NodePart.from_parameters({**part.to_parameters(), "command": "sh -c x"})
    assert node_deployment("gpu", 3) == "node-part/gpu-node-3"


def test_a_node_agent_and_its_parts_flow_start_without_importing_torch():
    """The agent's command (`rollout node start`, until it becomes the worker) and each part's flow run process
    (flows/node_part.py) only start and watch torchrun, which imports torch itself: importing it there too cost each
    agent start and each part 1.5 CPU-s more."""
    probe = ("import sys, rollout_cli.node, flows.node_part; "
             "print(sorted(name for name in ('torch', 'transformers', 'pyarrow') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.slow
def test_a_node_whose_agent_never_runs_is_frozen_or_killed_fails_the_segment_naming_it_and_the_rerun_ends_on_one_nodes_id(
        prefect_server, node_home, tmp_path):
    from rollout_cli.node import register

    pool = f"{POOL}-b"
    # no agent registered: refused as the run starts, before anything runs
    with pytest.raises(ConfigError) as refused:
        train_in_process(*sft_args(tmp_path / "absent", *over_two_nodes(pool)))
    assert str(refused.value) == (
        f"algorithm.sft.hardware.node_pool: node 1 of 2 has no agent in work pool '{pool}' (no deployment "
        f"node-part/{pool}-node-1): run `rollout node start --pool {pool} --node 1` on that node")
    assert not (tmp_path / "absent").exists()

    # registered, but its worker never started: the part is never taken (the rendezvous' whole 2 s waited)
    register(prefect_server["api_url"], pool, 1, node_home)
    with pytest.raises(DataParallelError) as never:
        train_in_process(*sft_args(tmp_path / "never", *over_two_nodes(pool, timeout_s=2)))
    error = str(never.value).splitlines()[0]
    assert error.startswith("train steps 1-1: node 1's part (flow run ") and error.endswith(
        f"work queue 'node-1' of pool '{pool}') never started: no agent of that node took it; start it there with "
        f"`rollout node start --pool {pool} --node 1`; the segment's start checkpoint is in the store, so a rerun "
        "trains steps 1-1 again from it."), error
    assert part_runs(prefect_server, pool)[-1]["state"] == "CANCELLED"  # a late agent will not join a dead rendezvous

    # an agent whose parts fail at once (its parts' directory gone): node 0 stops then, not at the rendezvous' timeout.
    # It heartbeats every second: once its directory is back, the same agent is the node frozen below (an agent's
    # start saved)
    agent = NodeAgent(node_home, pool, {"PREFECT_WORKER_HEARTBEAT_SECONDS": "1"}, directory=node_home / "parts").start()
    (node_home / "parts").rmdir()
    began = time.monotonic()
    try:
        with pytest.raises(DataParallelError) as failed:
            train_in_process(*sft_args(tmp_path / "failed", *over_two_nodes(pool, timeout_s=300)))
        error = str(failed.value).splitlines()[0]
        assert time.monotonic() - began < 300, error
        assert error.startswith("train steps 1-1: node 1's part (flow run ") and "failed: " in error and (
            f"No such file or directory: '{node_home / 'parts'}'") in error, error
    except BaseException:
        agent.stop()  # else stopped below, as the frozen node
        raise

    # node 1 frozen (SIGSTOP to the agent and all it started) as its torchrun starts its rank: silent, sockets open,
    # whether its rank has joined the group or not; its agent's heartbeats stop, and node 0 stops within
    # node_lost_after_s plus two heartbeats, not at the rendezvous' timeout (300 s) nor torch's group timeout (30 min)
    (node_home / "parts").mkdir()  # the agent above, its parts' directory back
    outcome: dict = {}

    def train(args: list[str]) -> None:  # node 0: the flow, in this process (a CLI's start saved)
        try:
            outcome["result"] = train_in_process(*args)
        except Exception as exc:  # noqa: BLE001  what the run failed with is the point
            outcome["error"] = exc

    node_0 = threading.Thread(target=train, args=(sft_args(tmp_path / "frozen", *over_two_nodes(pool, 300)),))
    node_0.start()
    try:
        deadline = time.monotonic() + 300
        while not any("rollout_lib.trainer.torchrun" in " ".join(process.cmdline()) and process.children()
                      for process in agent.processes()):
            assert node_0.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.1)
        agent.freeze_node()
        frozen_at = time.monotonic()
        node_0.join(timeout=300)
        stopped_after = time.monotonic() - frozen_at
    finally:
        agent.kill_node()
        agent.stop()
    error = str(outcome.get("error", outcome)).splitlines()[0]
    outcome.clear()
    assert error.startswith("train steps 1-1: node 1's part (flow run ") and (
        f"was lost while it ran: its agent (worker '{pool}-node-1-") in error and (
        f"(hardware.node_lost_after_s = {LOST_AFTER_S} s, plus two heartbeats): its node was killed, stopped or cut "
        f"off; restart the agent there with `rollout node start --pool {pool} --node 1`") in error, error
    assert stopped_after < 60, (stopped_after, error)

    # the agent and all it started SIGKILLed as node 1's rank holds at step 2: node 1 lost mid-segment
    held = node_home / "held"
    agent = NodeAgent(node_home, pool, {HOLD_AT_STEP_ENV: f"2:{held}"}).start()
    args = sft_args(tmp_path / "killed", *over_two_nodes(pool))
    node_0 = threading.Thread(target=train, args=(args,))
    node_0.start()
    try:
        deadline = time.monotonic() + 300
        while not held.exists():
            assert node_0.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.2)
        agent.kill_node()
    finally:
        agent.stop()
        node_0.join(timeout=300)
    error = str(outcome.get("error", outcome)).splitlines()[0]
    assert error.startswith("train steps 2-2: node 1's part (flow run ") and error.endswith(
        f"was still Running {LOST_AFTER_S} s (hardware.node_lost_after_s) after node 0's torchrun ended: its agent "
        "stopped reporting (killed, or its node "
        f"lost); restart it there with `rollout node start --pool {pool} --node 1`; the segment's start checkpoint "
        "is in the store, so a rerun trains steps 2-2 again from it."), error

    # the agent back (no hold): the rerun trains step 2 again from the store and ends where 1 node x 2 processes ends
    agent = NodeAgent(node_home, pool).start()
    try:
        rerun = train_in_process(*args)
    finally:
        agent.stop()
    expected = train_in_process(*sft_args(tmp_path / "one-node", "--nproc", "2"))
    assert rerun["checkpoint"] == expected["checkpoint"]
    # a part per run, not per segment (one group for the run): never taken, failed at once, the frozen node's, the
    # run whose node was lost (its steps 1 and 2), the rerun (step 2 again)
    states = [run["state"] for run in part_runs(prefect_server, pool)]
    assert states == ["CANCELLED", "FAILED", "CRASHED", "CRASHED", "COMPLETED"], states


@pytest.mark.slow
def test_a_part_whose_torchrun_fails_fails_in_one_line_naming_its_node(tmp_path):
    from rollout_lib.trainer.node_agent import run_node_part
    from rollout_lib.trainer.node_parts import NodePartError

    # node 0 never comes: node 1's torchrun gives up at the rendezvous after 1 s
    part = NodePart(node_rank=1, nnodes=2, nproc=1, endpoint=f"127.0.0.1:{free_port()}", run_id="rollout-alone",
                    timeout_s=1, module="rollout_lib.trainer.segment_worker", backend="gloo")
    lines: list[str] = []
    with pytest.raises(NodePartError) as failed:
        run_node_part(part, cwd=str(tmp_path), log=lines.append)
    assert str(failed.value).startswith("node 1's torchrun (1 processes) failed: ") and "\n" not in str(failed.value)
    assert lines[0].startswith("node 1: ") and "--node-rank=1" in lines[0] and any(
        "RendezvousTimeoutError" in line for line in lines)


def test_a_node_agent_without_a_server_or_with_a_bad_pool_name_is_refused_in_one_line(monkeypatch, capsys):
    from rollout_cli.main import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["node", "start", "--pool", "gpu-nodes", "--node", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "rollout: error: rollout node start: set PREFECT_API_URL to the flow's Prefect server (on node 0: "
        "`rollout stack env` prints it)")
    assert main(["node", "start", "--pool", "gpu nodes", "--node", "1"]) == 2
    assert "Invalid value for --pool: 'gpu nodes': letters, digits" in capsys.readouterr().err
    assert main(["node", "start", "--pool", "gpu", "--node", "0"]) == 2  # node 0 runs the flow


@pytest.mark.slow
def test_a_deployment_run_on_node_0s_worker_with_node_1_an_agent_ends_on_one_nodes_checkpoint(worker_stack, node_home,
                                                                                                tmp_path):
    """Both nodes are Prefect workers, each started from a directory and a Prefect home of its own on 127.0.0.1:
    node 0 the stack's worker (`rollout stack start`), which runs the flow of a `train-sft/default` run created as
    `prefect deployment run` creates it, and node 1 a node agent (`rollout node start`), to which the flow submits
    node 1's part. Nothing is run for either node after they start: 2 nodes x 1 process end on the checkpoint
    1 node x 2 processes writes."""
    from rollout_lib.store import ObjectStore

    pool = f"{POOL}-c"
    args = sft_args(tmp_path / "deployed", *over_two_nodes(pool))
    overrides = [value for flag, value in zip(args, args[1:]) if flag == "--set"]
    agent = NodeAgent(node_home, pool).start()
    try:
        flow_run = worker_stack.wait(worker_stack.create("train-sft/default", config="configs/sft-tiny.toml",
                                                         overrides=overrides), timeout=600)
    finally:
        agent.stop()
    assert flow_run["state"]["type"] == "COMPLETED", flow_run["state"]
    expected = train_in_process(*sft_args(tmp_path / "one-node", "--nproc", "2"))
    assert ObjectStore(str(tmp_path / "deployed")).get_ref("runs/sft-tiny/latest") == expected["checkpoint"]
    assert [run["state"] for run in part_runs({"api_url": worker_stack.api_url}, pool)] == ["COMPLETED"]  # one group
