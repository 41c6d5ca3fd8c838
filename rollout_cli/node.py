"""`rollout node start --pool P --node K`: this machine as node K of multi-node runs (docs/scale.md), a node agent.

A thin wrapper over `prefect worker start`: it makes sure of the process work pool P, registers the deployment
`node-part/P-node-K` of flows/node_part.py on the work queue `node-K` (this checkout's flows, run in `--dir`), then
becomes `prefect worker start --pool P --work-queue node-K --type process --limit 1`, in the foreground, until
stopped. Every run whose hardware.node_pool is P submits node K's part of each rendezvous to that queue, so one
agent per node, started once, replaces the torchrun commands someone typed per segment. The server is the one
PREFECT_API_URL names (the flow's: `eval "$(rollout stack env)"` on node 0 prints it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rollout_cli.stack import WORKER_ENV_DEFAULTS, StackError, prefect_client
from rollout_lib.paths import PROJECT_ROOT
from rollout_lib.trainer.node_parts import NODE_DIR_ENV, NODE_FLOW, node_deployment, node_queue

FLOW_ENTRYPOINT = "flows/node_part.py:node_part"


def worker_command(pool: str, node: int) -> list[str]:
    return [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--work-queue", node_queue(node),
            "--type", "process", "--limit", "1", "--name", f"{pool}-{node_queue(node)}-{os.uname().nodename}"]


def register(api_url: str, pool: str, node: int, directory: Path) -> str:
    """The work pool (process) if missing, and node `node`'s deployment of the part flow; its name."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with prefect_client(api_url) as client:
        try:
            found = client.read_work_pool(pool)
        except ObjectNotFound:
            found = client.create_work_pool(WorkPoolCreate(
                name=pool, type="process", base_job_template=ProcessWorker.get_default_base_job_template()))
        if found.type != "process":
            raise StackError(f"work pool {pool!r} is of type {found.type!r}: a node agent is a process worker; "
                             "name a process pool (or a new name: it is created)")
        flow_id = client.create_flow_from_name(NODE_FLOW)
        client.create_deployment(  # updated in place when it exists
            flow_id=flow_id, name=node_deployment(pool, node).partition("/")[2], work_pool_name=pool,
            work_queue_name=node_queue(node), entrypoint=FLOW_ENTRYPOINT,
            pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(PROJECT_ROOT)}}],
            job_variables={"env": {NODE_DIR_ENV: str(directory), "PREFECT_LOGGING_EXTRA_LOGGERS": "rollout_lib"}},
            description=f"Node {node}'s part of each rendezvous of runs with hardware.node_pool = {pool!r}.")
    return node_deployment(pool, node)


def start(pool: str, node: int, directory: Path, poll_s: float) -> None:
    """Register node `node` in `pool`, then become its worker (never returns unless the exec fails)."""
    api_url = os.environ.get("PREFECT_API_URL")
    if not api_url:
        raise StackError("rollout node start: set PREFECT_API_URL to the flow's Prefect server (on node 0: "
                         "`rollout stack env` prints it)")
    name = register(api_url, pool, node, directory)
    print(f"node {node} of work pool {pool!r}: deployment {name}, work queue {node_queue(node)!r}, parts run in "
          f"{directory}; starting its worker", flush=True)
    # A heartbeat every 5 s (Prefect's default is 30): a run's watch counts the node lost once its worker has been
    # silent for hardware.node_lost_after_s (20 s by default) plus two heartbeats (flows/node_launch.py).
    env = {**WORKER_ENV_DEFAULTS, "PREFECT_WORKER_HEARTBEAT_SECONDS": "5", **os.environ,
           "PREFECT_WORKER_QUERY_SECONDS": f"{poll_s:g}"}
    os.execve(sys.executable, worker_command(pool, node), env)
