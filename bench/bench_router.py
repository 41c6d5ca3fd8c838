"""rollout's reward router (rollout_lib/serving/router.py) against vllm-router (PyPI, Rust), side by side in one run,
in front of the same canned replicas.

Each replica is bench_serving.LatencyServer in a process of its own (it answers /v1/chat/completions after its
delay, requests overlapping like a batching server's; /health and /v1/models at once), so that one can be
SIGKILLed. What is measured in front of them (the routers in processes of their own, so that none shares the
client's interpreter, but where said):

    rollout             PoolRouter over an EndpointPool of the replicas, built as ServedModels builds a judge's given
                        by URL (the pool started, timeout 120 s, 3 attempts)
    rollout in-process  the same, in a thread of the client's process, where a run has it (overhead and throughput
                        only)
    the pool alone      the EndpointPool called in the client's process with no HTTP server in front: the router's
                        own serving costs the difference (overhead and throughput only)
    vllm-router <p>     `.venv-router/bin/vllm-router --policy <p>` for each of --policies (default round_robin and
                        power_of_two, its nearest to least outstanding), its other settings at their defaults

The client is this process: aiohttp, one session of keep-alive connections, POST /v1/chat/completions (the pool
alone: its own httpx client).

    overhead     one request at a time over a keep-alive connection, 2 replicas answering at once: median and p95
                 latency, and the same straight to one replica (what a router adds)
    throughput   requests/s with --concurrency in flight, same replicas
    slow         2 replicas, one answering after --slow-ms and the other at once, at each of --slow-concurrency
                 requests in flight (32: a router near its limit; 4: far from it): the share of requests each router
                 sends to the slow one, requests/s, median and p95 latency
    kill         2 replicas answering after --kill-delay-ms, --concurrency in flight; one SIGKILLed once a third of
                 the requests are answered: how many requests fail (each router gets fresh replicas)

The load average is printed before and after: on a shared machine the figures move with it. About a minute.

    bash scripts/setup-router.sh     # once: .venv-router with vllm-router 0.1.17
    .venv/bin/python bench/bench_router.py [--requests 1000] [--concurrency 32] [--slow-ms 50]
        [--slow-concurrency 32,4] [--kill-delay-ms 20] [--policies round_robin,power_of_two] [--skip kill]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_serving import LatencyServer  # noqa: E402  (bench/ is this script's own directory)

from rollout_lib.serving.client import ServingError  # noqa: E402
from rollout_lib.serving.pool import EndpointPool  # noqa: E402
from rollout_lib.serving.router import PoolRouter  # noqa: E402

VLLM_ROUTER = ROOT / ".venv-router" / "bin" / "vllm-router"
START_TIMEOUT_S = 30.0
BODY = {"model": "m", "messages": [{"role": "user", "content": "Is 3 + 4 = 7? Answer with a score."}],
        "max_tokens": 8}


# --- the processes: replicas and routers ---------------------------------------------------------------------------


def serve_replica(delay_ms: float) -> None:
    """Child process: one canned replica; prints its URL, serves until killed."""
    with LatencyServer(delay_ms / 1000, one_at_a_time=False) as server:
        print(server.url, flush=True)
        threading.Event().wait()


def start_rollout_router(urls: list[str]) -> PoolRouter:
    """As ServedModels starts a judge's router (served.py: _connect, then router): the pool started, then served."""
    pool = EndpointPool(urls, "m", timeout_s=120.0, max_attempts=3)
    asyncio.run(pool.start())
    return PoolRouter(pool, where="bench").start()


def serve_rollout_router(urls: list[str]) -> None:
    """Child process: rollout's router over `urls`; prints its address, serves until killed."""
    router = start_rollout_router(urls)
    print(f"http://{router.address}", flush=True)
    threading.Event().wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Processes:
    """The child processes of one measurement; all stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.children: list[subprocess.Popen] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def _spawn(self, argv: list[str], name: str, *, stdout_to_log: bool = False) -> tuple[subprocess.Popen, Path]:
        """`stdout_to_log`: stdout goes to the log too (else it is a pipe for the child's first line)."""
        log = self.log_dir / f"{name}-{len(self.children)}.log"
        with open(log, "wb") as sink:
            child = subprocess.Popen(argv, stdout=sink if stdout_to_log else subprocess.PIPE, stderr=sink, cwd=ROOT)
        self.children.append(child)
        return child, log

    def _first_line(self, child: subprocess.Popen, log: Path) -> str:
        line = child.stdout.readline().decode().strip()
        if not line:
            raise SystemExit(f"bench: a child process exited before it served: {log.read_text()[-2000:]}")
        return line

    def replica(self, delay_ms: float) -> tuple[str, subprocess.Popen]:
        child, log = self._spawn([sys.executable, __file__, "--serve-replica", str(delay_ms)], "replica")
        return self._first_line(child, log), child

    def rollout_router(self, urls: list[str]) -> str:
        child, log = self._spawn([sys.executable, __file__, "--serve-rollout-router", *urls], "rollout-router")
        return self._first_line(child, log)

    def vllm_router(self, urls: list[str], policy: str) -> str:
        port = free_port()
        child, log = self._spawn([str(VLLM_ROUTER), "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1",
                                  "--port", str(port), "--prometheus-port", str(free_port()),
                                  "--log-level", "warning"], f"vllm-router-{policy}", stdout_to_log=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if child.poll() is not None:
                raise SystemExit(f"bench: vllm-router exited ({child.returncode}): {log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return url
            except OSError:
                time.sleep(0.05)
        raise SystemExit(f"bench: vllm-router did not listen within {START_TIMEOUT_S:g} s: {log.read_text()[-2000:]}")


# --- the client ----------------------------------------------------------------------------------------------------


@dataclass
class Run:
    latencies_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    by_replica: Counter = field(default_factory=Counter)  # answered requests per replica URL
    failures: Counter = field(default_factory=Counter)  # failed requests by reason

    @property
    def answered(self) -> int:
        return len(self.latencies_ms)

    @property
    def per_s(self) -> float:
        return self.answered / self.elapsed_s

    @property
    def median_ms(self) -> float:
        return statistics.median(self.latencies_ms)

    @property
    def p95_ms(self) -> float:
        return statistics.quantiles(self.latencies_ms, n=20)[18]


class Failed(Exception):
    """One request that got no answer; the reason is what the failures are counted by."""


async def _drive(send, requests: int, concurrency: int, after_each=None) -> Run:
    """`requests` calls of `send()` (one request -> its reply JSON, or Failed), `concurrency` in flight, after
    `concurrency` untimed ones (connections opened, the router's clients made). `after_each(answered)` runs after
    every answered request."""
    run = Run()

    async def one(record: bool) -> None:
        started = time.perf_counter()
        try:
            reply = await send()
        except Failed as failure:
            if record:
                run.failures[str(failure)] += 1
            return
        if record:
            run.latencies_ms.append((time.perf_counter() - started) * 1000)
            run.by_replica[reply.get("replica")] += 1
            if after_each is not None:
                after_each(run.answered)

    await asyncio.gather(*(one(False) for _ in range(concurrency)))
    left = iter(range(requests))

    async def worker() -> None:
        for _ in left:
            await one(True)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.elapsed_s = time.perf_counter() - started
    return run


async def _over_http(url: str, requests: int, concurrency: int, after_each=None) -> Run:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:

        async def send() -> dict:
            try:
                async with session.post(f"{url}/v1/chat/completions", json=BODY) as response:
                    reply = await response.json(content_type=None)
                    status = response.status
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                raise Failed(type(exc).__name__) from None
            if status != 200:
                raise Failed(f"HTTP {status}")
            return reply

        return await _drive(send, requests, concurrency, after_each)


async def _through_pool(urls: list[str], requests: int, concurrency: int) -> Run:
    """The pool called in this process, no HTTP server in front: what the router's own serving adds is the rest."""
    pool = EndpointPool(urls, "m", timeout_s=120.0, max_attempts=3)

    async def send() -> dict:
        try:
            return await pool.call(lambda replica: replica.request("POST", "/v1/chat/completions", BODY))
        except ServingError as exc:
            raise Failed(type(exc).__name__) from None

    try:
        return await _drive(send, requests, concurrency)
    finally:
        await pool.aclose()


def measure(target: str | list[str], requests: int, concurrency: int, after_each=None) -> Run:
    """`target`: a URL (a router, a replica), or replica URLs to call through a pool in this process."""
    if isinstance(target, list):
        return asyncio.run(_through_pool(target, requests, concurrency))
    return asyncio.run(_over_http(target, requests, concurrency, after_each))


# --- the measurements ----------------------------------------------------------------------------------------------


def router_names(policies: list[str]) -> list[str]:
    return ["rollout"] + [f"vllm-router {policy}" for policy in policies]


def start_router(processes: Processes, name: str, urls: list[str]) -> str:
    if name == "rollout":
        return processes.rollout_router(urls)
    return processes.vllm_router(urls, name.removeprefix("vllm-router "))


def overhead_and_throughput(args, log_dir: Path) -> None:
    print(f"\noverhead: one request at a time over a keep-alive connection ({args.sequential} requests), and "
          f"throughput: {args.concurrency} in flight ({args.requests} requests); 2 replicas answering at once")
    print(f"  {'':30s} {'median ms':>10s} {'p95 ms':>8s} {'requests/s':>11s}  answered per replica")
    with Processes(log_dir) as processes:
        urls = [processes.replica(0)[0] for _ in range(2)]
        targets = [("straight to one replica", urls[0])]
        targets += [(name, start_router(processes, name, urls)) for name in router_names(args.policies)]
        in_process = start_rollout_router(urls)
        targets.insert(2, ("rollout in-process", f"http://{in_process.address}"))
        targets.insert(3, ("the pool alone, in-process", urls))
        try:
            for name, url in targets:
                sequential = measure(url, args.sequential, 1)
                loaded = measure(url, args.requests, args.concurrency)
                failed = sum(sequential.failures.values()) + sum(loaded.failures.values())
                spread = "/".join(str(loaded.by_replica[u]) for u in urls)
                print(f"  {name:30s} {sequential.median_ms:10.2f} {sequential.p95_ms:8.2f} {loaded.per_s:11.0f}  "
                      f"{spread}" + (f"  FAILED {failed}: {dict(sequential.failures + loaded.failures)}"
                                     if failed else ""))
        finally:
            in_process.close()


def slow_replica(args, log_dir: Path) -> None:
    print(f"\nslow replica: one replica answers after {args.slow_ms:g} ms, the other at once; {args.slow_requests} "
          f"requests at each load")
    print(f"  {'':30s} {'in flight':>9s} {'to the slow one':>16s} {'requests/s':>11s} {'median ms':>10s} "
          f"{'p95 ms':>8s}")
    with Processes(log_dir) as processes:
        slow, fast = processes.replica(args.slow_ms)[0], processes.replica(0)[0]
        for name in router_names(args.policies):
            url = start_router(processes, name, [slow, fast])
            for in_flight in args.slow_concurrency:
                run = measure(url, args.slow_requests, in_flight)
                share = run.by_replica[slow] / max(run.answered, 1)
                print(f"  {name:30s} {in_flight:9d} {run.by_replica[slow]:8d} ({share:4.0%}) {run.per_s:11.0f} "
                      f"{run.median_ms:10.2f} {run.p95_ms:8.2f}"
                      + (f"  FAILED {dict(run.failures)}" if run.failures else ""))


def killed_replica(args, log_dir: Path) -> None:
    kill_at = args.kill_requests // 3
    print(f"\nkill: 2 replicas answering after {args.kill_delay_ms:g} ms, {args.concurrency} in flight, "
          f"{args.kill_requests} requests; one replica SIGKILLed after {kill_at} answers")
    print(f"  {'':30s} {'failed':>7s} {'requests/s':>11s} {'p95 ms':>8s} {'max ms':>8s}  answered by the killed one")
    for name in router_names(args.policies):
        with Processes(log_dir) as processes:
            (victim, victim_process), (other, _) = (processes.replica(args.kill_delay_ms) for _ in range(2))
            url = start_router(processes, name, [victim, other])

            def kill_once(answered: int) -> None:
                if answered == kill_at:
                    victim_process.send_signal(signal.SIGKILL)

            run = measure(url, args.kill_requests, args.concurrency, kill_once)
            failed = sum(run.failures.values())
            print(f"  {name:30s} {failed:7d} {run.per_s:11.0f} {run.p95_ms:8.2f} {max(run.latencies_ms):8.1f}  "
                  f"{run.by_replica[victim]}" + (f"  ({dict(run.failures)})" if failed else ""))


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg()) + f" (1, 5, 15 min; {os.cpu_count()} cores)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequential", type=int, default=400, help="requests one at a time (overhead)")
    parser.add_argument("--requests", type=int, default=1000, help="requests with --concurrency in flight")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--slow-ms", type=float, default=50.0)
    parser.add_argument("--slow-requests", type=int, default=600)
    parser.add_argument("--slow-concurrency", default="32,4", help="loads of the slow-replica test, comma-separated")
    parser.add_argument("--kill-delay-ms", type=float, default=20.0)
    parser.add_argument("--kill-requests", type=int, default=600)
    parser.add_argument("--policies", default="round_robin,power_of_two", help="vllm-router policies, comma-separated")
    parser.add_argument("--skip", default="", help="comma-separated: overhead, slow, kill")
    parser.add_argument("--serve-replica", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--serve-rollout-router", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_replica is not None:
        return serve_replica(args.serve_replica)
    if args.serve_rollout_router:
        return serve_rollout_router(args.serve_rollout_router)
    if not VLLM_ROUTER.exists():
        raise SystemExit("bench: no .venv-router: run `bash scripts/setup-router.sh` first")
    args.policies = [policy for policy in args.policies.split(",") if policy]
    args.slow_concurrency = [int(value) for value in args.slow_concurrency.split(",") if value]
    skip = set(args.skip.split(","))
    version = subprocess.run([str(ROOT / ".venv-router" / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('vllm-router'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    print(f"rollout's router vs vllm-router {version}; load average before: {load_average()}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-router-") as log_dir:
        if "overhead" not in skip:
            overhead_and_throughput(args, Path(log_dir))
        if "slow" not in skip:
            slow_replica(args, Path(log_dir))
        if "kill" not in skip:
            killed_replica(args, Path(log_dir))
    print(f"\nload average after: {load_average()}; the bench took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
