"""SIGKILL a server with a request really in flight on it, however loaded the machine is: stop its process group
(SIGSTOP) before the request goes out, wait until the request sits unread in the server's socket (/proc/net/tcp),
then SIGKILL the group. The kernel resets the connection, so the client reads a cut request (httpx's ReadError),
as when a server dies under it; never a refusal before it was sent, nor an answer that came first. And what vLLM
replicas say they answered (their Prometheus counters), to show a request was answered once, by a survivor."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Awaitable, TypeVar

T = TypeVar("T")


def unread_requests(port: int) -> int:
    """Connections to 127.0.0.1:`port` holding bytes its server has not read (/proc/net/tcp: established, receive
    queue not empty): requests that reached a stopped server and wait in flight."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port, state, rx_queue = int(fields[1].split(":")[1], 16), fields[3], int(fields[4].split(":")[1], 16)
        count += local_port == port and state == "01" and rx_queue > 0
    return count


async def kill_with_the_request_in_flight(group: int, port: int, request: Awaitable[T],
                                          timeout_s: float = 60.0) -> tuple[float, asyncio.Future[T]]:
    """Stop process group `group` (a server listening on `port`), send `request` on this event loop, SIGKILL the
    group once the request waits unread in its socket; the monotonic time of the kill and the request, still to be
    awaited (it fails as its connection is reset)."""
    os.killpg(group, signal.SIGSTOP)
    try:
        in_flight = asyncio.ensure_future(request)
        deadline = time.monotonic() + timeout_s
        while not unread_requests(port):
            assert not in_flight.done() and time.monotonic() < deadline, "the request never reached the server"
            await asyncio.sleep(0.005)
    finally:
        os.killpg(group, signal.SIGKILL)
    return time.monotonic(), in_flight


def vllm_requests_answered(base_urls: list[str]) -> float:
    """Requests vLLM replicas have finished, from their Prometheus counters (vllm:request_success_total)."""
    import re

    import httpx

    total = 0.0
    for url in base_urls:
        text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
        total += sum(float(value) for value in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))
    return total
