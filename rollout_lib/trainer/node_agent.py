"""A node's side of a group over several nodes: run one `NodePart` (its torchrun) here until it ends, each output line
logged, and fail in one line naming the node and the rank when it does not end well. What a node agent's flow run
does (flows/node_part.py); Prefect-free, so it runs and tests without it, and torch-free: the flow run's process only
watches torchrun, which imports torch itself."""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections import deque

from rollout_lib.trainer.node_parts import NODE_DIR_ENV, NodePart, NodePartError
from rollout_lib.trainer.torchrun_summary import failure_message

logger = logging.getLogger(__name__)


def node_directory() -> str:
    """Where this node's parts run: the agent's directory (`rollout node start --dir`), else here."""
    return os.environ.get(NODE_DIR_ENV) or os.getcwd()


def run_node_part(part: NodePart, cwd: str, log=logger.info) -> None:
    """Run `part` on this node (its torchrun, in `cwd`) until it ends; each output line to `log`. NodePartError with
    the failing rank, as torchrun tells it, when it does not exit 0."""
    tail: deque[str] = deque(maxlen=400)
    command = part.command()
    log(f"node {part.node_rank}: {shlex.join(command)} (in {cwd})")
    with subprocess.Popen(command, cwd=cwd, env=part.environment(dict(os.environ)), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True) as process:
        for line in process.stdout:
            tail.append(line.rstrip("\n"))
            log(line.rstrip("\n"))
    if process.returncode != 0:
        # the first line is the failure (the rest: the output's last lines, in the flow run's logs anyway)
        message = failure_message(f"node {part.node_rank}'s torchrun ({part.nproc} processes) failed",
                                  process.returncode, list(tail), "the flow's node fails the group with it")
        raise NodePartError(message.splitlines()[0])
