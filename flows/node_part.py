"""One node's part of a rendezvous, as its node agent runs it (docs/scale.md, "Several nodes").

The deployment `node-part/<pool>-node-<K>` that `rollout node start --pool <pool> --node K` registers runs this
flow on node K's agent. Its one parameter is the part's structured fields (trainer/node_parts.NodePart), checked
before anything runs; the node builds its torchrun command from them and runs it in the agent's directory
(trainer/node_agent.py), its output in the flow run's logs. A part whose torchrun fails fails the flow run in one
line naming the node and the rank; the flow's node reads that state (flows/node_launch.py).
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from rollout_lib.trainer.node_agent import node_directory, run_node_part
from rollout_lib.trainer.node_parts import NODE_FLOW, NodePart


@flow(name=NODE_FLOW, log_prints=False)
def node_part(part: dict) -> None:
    """Run this node's part (`part`: NodePart's fields) until its torchrun ends."""
    run_node_part(NodePart.from_parameters(part), cwd=node_directory(), log=get_run_logger().info)
