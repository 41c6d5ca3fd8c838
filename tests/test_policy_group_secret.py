"""A closed control channel (issue 44): a group's command socket (trainer/rank_group.py: RL's policy group, SFT's
and RM's segment group) admits only connections presenting the
group's secret (drawn per group, handed to node 0's torchrun in its environment, never logged); anything else is
closed and the group keeps waiting for its ranks."""

from __future__ import annotations

import json
import logging
import socket

import pytest

from rollout_lib.trainer import rank_group
from test_rl_data_parallel import run_in_process

KNOWN_SECRET = "ab" * 32  # secrets.token_hex(32) as the test draws it, to look for it in the logs


def hello_from(client: bytes | None, group: rank_group.RankGroup) -> int | None:
    """The rank `RankGroup._admit` admits for a connection that sends `client` (None: sends nothing)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        if client is not None:
            theirs.sendall(client)
        joined = group._admit(ours, {})
        if joined is None:
            theirs.settimeout(5)
            assert theirs.recv(1) == b""  # closed on it
            return None
        joined[1].close()
        return joined[0]


def test_only_a_hello_with_the_groups_secret_joins(monkeypatch):
    monkeypatch.setattr(rank_group, "HELLO_TIMEOUT_S", 0.5)
    group = rank_group.RankGroup.__new__(rank_group.RankGroup)  # the door alone: no inputs, no processes
    group._secret, group.world_size = "cd" * 32, 2

    def hello(**fields) -> bytes:
        return (json.dumps(fields) + "\n").encode()

    assert hello_from(hello(rank=1, secret="cd" * 32), group) == 1
    assert hello_from(hello(rank=1, secret="ce" * 32), group) is None  # wrong secret
    assert hello_from(hello(rank=1), group) is None  # none: a rank of the code before secrets
    assert hello_from(hello(rank=2, secret="cd" * 32), group) is None  # no such rank
    assert hello_from(b"\xff\xfe not json\n", group) is None
    assert hello_from(None, group) is None  # silent: closed after HELLO_TIMEOUT_S


@pytest.mark.slow
def test_rogue_clients_connecting_first_are_refused_and_the_group_trains(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(rank_group, "HELLO_TIMEOUT_S", 2.0)
    monkeypatch.setattr(rank_group.secrets, "token_hex", lambda nbytes: "ab" * nbytes)
    real_create_server, rogues = socket.create_server, []

    def create_server(address, **kwargs):
        """The group's listener, with three rogues connected before torchrun even starts: first in line."""
        listener = real_create_server(address, **kwargs)
        if not rogues:
            port = listener.getsockname()[1]
            for hello in (b'{"rank": 0, "secret": "' + b"0" * 64 + b'"}\n', b'{"rank": 0}\n', None):
                rogue = socket.create_connection(("127.0.0.1", port))
                if hello is not None:
                    rogue.sendall(hello)
                rogues.append(rogue)
        return listener

    monkeypatch.setattr(rank_group.socket, "create_server", create_server)
    caplog.set_level(logging.DEBUG, logger=rank_group.__name__)  # the ranks' output too
    result = run_in_process(str(tmp_path / "store"), 2, 1)
    assert len(rogues) == 3 and len(result["history"]) == 1 and result["history"][0]["micro_batches"] >= 1
    for rogue in rogues:
        rogue.settimeout(5)
        assert rogue.recv(1) == b"", "a rogue got an answer"  # closed on it, never sent a command
        rogue.close()
    refused = [r for r in caplog.records if "refused a connection from 127.0.0.1" in r.getMessage()]
    assert len(refused) == 3, caplog.text
    assert KNOWN_SECRET not in caplog.text
