"""The other nodes' parts of a rendezvous as flow runs of their node agents (hardware.node_pool, docs/scale.md).

Each other node runs an agent: a Prefect process worker of the run's work pool on that node's own work queue
(`rollout node start --pool P --node K`, rollout_cli/node.py), which registered the deployment
`node-part/P-node-K` of flows/node_part.py. At every rendezvous the flow submits node K's part (its structured
`NodePart`) as a flow run of that deployment, so node K's agent, and no other, starts it. Once node 0's torchrun has
ended, `settle` reads each part's state: Completed is fine; Scheduled or Pending (no agent took it in time) is a
part that never started, cancelled so that a late agent does not join a dead rendezvous; Failed or Crashed is a part
that failed; Running long after node 0 ended is a part whose agent stopped reporting (killed, or its node lost),
marked Crashed. While node 0 runs, a watch stops it as soon as a part ends badly, or as soon as a running part's
agent stops heartbeating (its worker's last heartbeat older than hardware.node_lost_after_s plus two of its
intervals: the node killed, stopped or cut off, which nothing else reports), so that node 0 waits neither for the
rendezvous' timeout nor, once the ranks are starting, for torch's 30-minute process-group timeout. Registered with
the library on import (node_parts.register_pool_launcher).
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Crashed

from rollout_lib.errors import ConfigError
from rollout_lib.trainer.node_parts import (NodeLauncher, NodePart, NodePartError, NodeProblem, agent_command,
                                            node_deployment, node_queue, register_pool_launcher)

# How long the parts may take to end once node 0's torchrun has: after a success their ranks are done and exit
# (the flow run process then reports Completed); after a failure their ranks lose node 0's and fail likewise, within
# hardware.node_lost_after_s (20 s unless set), after which a part still Running counts as lost.
SETTLE_AFTER_SUCCESS_S = 120.0
POLL_S = 0.5
WATCH_S = 2.0  # how often the parts' states are read while node 0 runs
WAITING = ("SCHEDULED", "PENDING")  # no agent has started the part (Late is a Scheduled state)
ENDED = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
ENDED_BADLY = ("FAILED", "CRASHED", "CANCELLED")


class NodePoolLauncher(NodeLauncher):
    """Submits each part to its node's agent in work pool `pool` and reads what became of it."""

    def __init__(self, pool: str, lost_after_s: float = 20.0):
        self.pool = pool
        self.lost_after_s = lost_after_s  # hardware.node_lost_after_s
        self.runs: dict[int, tuple[UUID, str]] = {}  # node rank -> its part's flow run (id, name)
        self._watch: tuple[threading.Thread, threading.Event] | None = None
        self._aborted_by: int | None = None  # the node whose part's end stopped node 0
        self._silent: dict[int, str] = {}  # node rank -> why its agent counts as lost (no heartbeat)

    def launch(self, parts: dict[int, NodePart], abort=None) -> None:
        self.runs, self._aborted_by, self._silent = {}, None, {}
        with get_client(sync_client=True) as client:
            deployments = {}
            for rank in parts:  # every node has its agent, or nothing is submitted
                try:
                    deployments[rank] = client.read_deployment_by_name(node_deployment(self.pool, rank))
                except ObjectNotFound:
                    raise NodePartError(
                        f"hardware.node_pool: node {rank} has no agent in work pool {self.pool!r} (no deployment "
                        f"{node_deployment(self.pool, rank)}): run `{agent_command(self.pool, rank)}` on that node"
                    ) from None
            for rank, part in parts.items():
                run = client.create_flow_run_from_deployment(
                    deployments[rank].id, parameters={"part": part.to_parameters()},
                    name=f"{part.run_id}-node-{rank}", work_queue_name=node_queue(rank))
                self.runs[rank] = (run.id, run.name)
        if abort is not None:
            done = threading.Event()
            self._watch = (threading.Thread(target=self._watch_parts, args=(abort, done), daemon=True), done)
            self._watch[0].start()

    def _watch_parts(self, abort, done: threading.Event) -> None:
        """While node 0 runs: a part that ended badly (its torchrun failed, its process crashed, it was cancelled)
        stops node 0, which would otherwise wait for it until the rendezvous times out, or, once the ranks are
        starting, for torch's process-group timeout. An agent killed outright reports nothing: settle tells."""
        runs = dict(self.runs)
        with get_client(sync_client=True) as client:
            while not done.wait(WATCH_S):
                for rank, (run_id, _) in runs.items():
                    try:
                        kind = client.read_flow_run(run_id).state.type.value
                        silent = self._agent_silence(client, rank) if kind == "RUNNING" else None
                    except Exception:  # noqa: BLE001  the server briefly busy: ask again next time
                        continue
                    if kind in ENDED_BADLY or silent is not None:
                        if silent is not None:
                            self._silent[rank] = silent
                        self._aborted_by = rank
                        abort()
                        return

    def _agent_silence(self, client, rank: int) -> str | None:
        """Why node `rank`'s agent counts as lost, or None: its worker (`rollout node start` names it
        `<pool>-node-<rank>-<host>`) has not sent a heartbeat for longer than node_lost_after_s plus two of its
        heartbeat intervals. A node whose worker is not found by that name (a plain `prefect worker start`) is not
        judged here."""
        prefix = f"{self.pool}-{node_queue(rank)}-"
        workers = [worker for worker in client.read_workers_for_work_pool(self.pool)
                   if worker.name.startswith(prefix) and worker.last_heartbeat_time is not None]
        if not workers:
            return None
        now = datetime.now(timezone.utc)
        ages = {worker.name: ((now - worker.last_heartbeat_time).total_seconds(),
                              self.lost_after_s + 2 * (worker.heartbeat_interval_seconds or 30)) for worker in workers}
        if any(age <= allowed for age, allowed in ages.values()):
            return None
        name, (age, _) = min(ages.items(), key=lambda item: item[1][0])
        return f"its agent (worker {name!r}) sent no heartbeat for {age:.0f} s"

    def settle(self, succeeded: bool) -> NodeProblem | None:
        if self._watch is not None:
            self._watch[1].set()
            self._watch[0].join(timeout=30)
            self._watch = None
        if not self.runs:
            return None
        deadline = time.monotonic() + (SETTLE_AFTER_SUCCESS_S if succeeded else self.lost_after_s)
        with get_client(sync_client=True) as client:
            while True:
                states = {rank: client.read_flow_run(run_id).state for rank, (run_id, _) in self.runs.items()}
                waiting = any(state.type.value in WAITING for state in states.values())
                # a part nobody started will not start now; one that runs may still end, unless its agent is silent
                if all(state.type.value in ENDED or rank in self._silent for rank, state in states.items()) or (
                        time.monotonic() > deadline) or (not succeeded and waiting):
                    break
                time.sleep(POLL_S)
            problems = [self._problem(client, rank, states[rank], succeeded) for rank in sorted(states)]
        self.runs = {}
        problems = [problem for problem in problems if problem is not None]
        # a node that never started or was lost explains the rest; else the first that failed
        return next((problem for problem in problems if problem.caused), problems[0] if problems else None)

    def _problem(self, client, rank: int, state, succeeded: bool) -> NodeProblem | None:
        run_id, name = self.runs[rank]
        kind = state.type.value
        where = f"node {rank}'s part (flow run {name!r}, work queue {node_queue(rank)!r} of pool {self.pool!r})"
        if kind == "COMPLETED":
            return None
        if kind in WAITING:
            client.set_flow_run_state(run_id, Cancelled(message="the rendezvous it was to join is over"), force=True)
            return NodeProblem(f"{where} never started: no agent of that node took it; start it there with "
                               f"`{agent_command(self.pool, rank)}`", caused=True)
        if kind in ("FAILED", "CRASHED"):  # the cause when its end is what stopped node 0
            return NodeProblem(f"{where} failed: {(state.message or kind.lower()).splitlines()[0]}",
                               caused=rank == self._aborted_by)
        if kind == "CANCELLED":
            return NodeProblem(f"{where} was cancelled", caused=True)
        if rank in self._silent:
            client.set_flow_run_state(run_id, Crashed(message="its agent stopped heartbeating"), force=True)
            return NodeProblem(f"{where} was lost while it ran: {self._silent[rank]} (hardware.node_lost_after_s = "
                               f"{self.lost_after_s:g} s, plus two heartbeats): its node was killed, stopped or cut off; "
                               f"restart the agent there with `{agent_command(self.pool, rank)}`", caused=True)
        wait = SETTLE_AFTER_SUCCESS_S if succeeded else self.lost_after_s
        client.set_flow_run_state(run_id, Crashed(message="its agent stopped reporting"), force=True)
        setting = "" if succeeded else " (hardware.node_lost_after_s)"
        return NodeProblem(f"{where} was still {state.name} {wait:g} s{setting} after node 0's torchrun ended: its "
                           "agent stopped reporting (killed, or its node lost); restart it there with "
                           f"`{agent_command(self.pool, rank)}`", caused=True)


def check_agents(cfg) -> None:
    """Before anything runs: with hardware.node_pool, every other node has registered its agent in the pool, else a
    ConfigError naming the setting, the node and the command to run there."""
    hardware = getattr(cfg.settings, "hardware", None)
    if hardware is None or hardware.node_pool is None:
        return
    with get_client(sync_client=True) as client:
        for rank in range(1, hardware.nnodes):
            try:
                client.read_deployment_by_name(node_deployment(hardware.node_pool, rank))
            except ObjectNotFound:
                raise ConfigError([(
                    f"algorithm.{cfg.algorithm.kind}.hardware.node_pool",
                    f"node {rank} of {hardware.nnodes} has no agent in work pool {hardware.node_pool!r} (no deployment "
                    f"{node_deployment(hardware.node_pool, rank)}): run `{agent_command(hardware.node_pool, rank)}` "
                    "on that node")]) from None


register_pool_launcher(lambda hardware: NodePoolLauncher(hardware.node_pool, hardware.node_lost_after_s))
