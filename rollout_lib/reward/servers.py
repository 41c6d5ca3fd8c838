"""What a reward function that asks a model is handed besides the rollout (verl's reward loop, seed 004): the
address of the router in front of its reward's judge and the judge's tokenizer, and what explains a failure there.

Light on purpose (no transformers import): a sync function's adapter carries it, pickled, into worker processes,
which then reach the router over HTTP on 127.0.0.1 like any other client.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any


class RouterUnreachable(ConnectionError):
    """A reward function failed while its reward router did not answer; the message names the router's setting."""


@dataclass(frozen=True)
class RewardServer:
    router_address: str | None = None  # "127.0.0.1:PORT" (serving/router.py), None without a judge
    tokenizer: Any = None  # the judge's tokenizer, when the function takes it
    where: str = ""  # the judge's setting, named in errors

    def explained(self, exc: BaseException) -> Exception | None:
        """A function's failure restated when its router does not answer (the likely cause, named with its setting);
        None when the router answers: then the function's own error stands."""
        if self.router_address is None or router_answers(self.router_address):
            return None
        return RouterUnreachable(" ".join(
            f"reward_router_address {self.router_address} ({self.where}) does not answer: "
            f"{type(exc).__name__}: {exc}".split()))


def router_answers(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts connections at host:port (asked only after a failure: one connect)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
