"""Several replicas of one served model behind one async API: least outstanding requests, a timeout on every
request, failover to another replica, ejection of failing replicas and their return once they answer again.

    pool = EndpointPool(["http://127.0.0.1:8111", "http://127.0.0.1:8112"], "tiny", timeout_s=60)
    await pool.start()                      # probes every replica: reachable, serves "tiny", its max_model_len
    gen = await pool.generate(ids, max_tokens=32, seed=7)
    results = await bounded_map(lambda ids: pool.score(ids), sequences, concurrency=8)
    await pool.aclose()

Selection: the healthy replica with the fewest requests in flight (ties round robin). Each attempt has a deadline;
one that fails for a reason worth retrying (client.ReplicaUnavailable) is retried on *another* replica, up to
`max_attempts`; HTTP 4xx and malformed replies are raised at once. A replica failing `eject_after` attempts in a
row is ejected and probed back in the background after `probe_interval_s`; with every replica out a request raises
at once, naming each URL and why. `recover` (replicas rollout serves) restarts the dead ones when a request found
none to answer, and the request is sent once more. `outstanding` is released on every path; `served` and
`failures` only grow. In full: docs/serving.md, "The pool".

The pool may be used from successive `asyncio.run()` calls and from several threads (one loop each): HTTP clients
are per event loop (client.HttpSession) and the counters are guarded by a lock. (verl's router: docs/serving.md.)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from rollout_lib.serving.client import (DEFAULT_MAX_CONNECTIONS, EndpointClient, Generation, HttpSession,
                                        ReplicaUnavailable, RequestRejected, ServingError)

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class PoolUnavailable(ServingError):
    """No replica could serve a request (all out, or every attempt failed); names every URL involved."""

    def __init__(self, urls: list[str], detail: str):
        self.url = ", ".join(urls)
        self.urls = list(urls)
        self.detail = " ".join(detail.split())
        RuntimeError.__init__(self, self.detail)


@dataclass
class _Health:
    failures_in_a_row: int = 0
    out_until: float | None = None  # None: in selection; else monotonic time after which it is probed again
    last_error: str = ""
    probe: asyncio.Task | None = None


class EndpointPool:
    def __init__(self, base_urls: list[str] | str, model: str, *, timeout_s: float | None = 120.0,
                 max_attempts: int = 3, eject_after: int = 2, probe_interval_s: float = 10.0,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, session: HttpSession | None = None,
                 recover: Callable[[], bool] | None = None):
        """`base_urls`: the replicas (with or without /v1); `model`: the served model name. `timeout_s` bounds each
        attempt, connect to last byte (None: no limit; it must cover the slowest legitimate request, queueing in
        the server included); `max_attempts`: attempts per request, each on a replica not yet tried;
        `eject_after`: failed attempts in a row that take a replica out; `probe_interval_s`: how long it stays
        out before a probe; `max_connections`: open connections over all replicas (per event loop); `recover`:
        for replicas rollout serves, a blocking call that restarts the dead ones on their ports (engine.py) and says
        whether any was dead, run once a request has failed on every replica it could try; the request is then
        sent again."""
        if isinstance(base_urls, str):
            base_urls = [base_urls]
        if not base_urls:
            raise ValueError("EndpointPool needs at least one base URL")
        if max_attempts < 1 or eject_after < 1:
            raise ValueError("max_attempts and eject_after must be >= 1")
        self.model = model
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.eject_after = eject_after
        self.probe_interval_s = probe_interval_s
        self.session = session or HttpSession(max_connections)
        self.replicas = [EndpointClient(url, model, timeout_s=timeout_s, session=self.session) for url in base_urls]
        self.urls = [replica.url for replica in self.replicas]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"EndpointPool: a base URL is listed twice: {', '.join(self.urls)}")
        self.outstanding: dict[str, int] = dict.fromkeys(self.urls, 0)
        self.served: dict[str, int] = dict.fromkeys(self.urls, 0)
        self.failures: dict[str, int] = dict.fromkeys(self.urls, 0)
        self._health = {url: _Health() for url in self.urls}
        self._lock = threading.Lock()
        self._next = 0  # round-robin start among equally loaded replicas
        self._max_model_len: int | None = None
        self._started = False
        self._starting: asyncio.Task | None = None  # a lazy start() shared by the requests that wait on it
        self.recover = recover
        self.recoveries = 0  # times `recover` ran
        self._recovering = threading.Lock()  # one restart at a time; requests failing meanwhile wait for it

    def __repr__(self) -> str:
        return f"EndpointPool({self.urls!r}, {self.model!r})"

    @property
    def probe_timeout_s(self) -> float:
        return min(self.timeout_s or 10.0, 10.0)

    # --- lifecycle --------------------------------------------------------------------------------------------

    async def start(self) -> EndpointPool:
        """Probe every replica at once: reachable, serving `model`; read max_model_len. Any failure raises one
        ServingError line naming each failing URL and why (unreachable; or the model names it serves)."""
        results = await asyncio.gather(*(replica.check(timeout_s=self.probe_timeout_s) for replica in self.replicas),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, ServingError):
                raise result
        failed = [result for result in results if isinstance(result, ServingError)]
        if len(failed) == 1:
            raise failed[0]
        if failed:
            raise PoolUnavailable([error.url for error in failed], "; ".join(str(error) for error in failed))
        lengths = [length for length in results if isinstance(length, int)]
        with self._lock:
            self._max_model_len = min(lengths) if lengths else None
            for health in self._health.values():
                health.failures_in_a_row, health.out_until = 0, None
            self._started = True
        return self

    async def __aenter__(self) -> EndpointPool:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close this loop's HTTP connections and its probes (other loops' close when those loops end)."""
        loop = asyncio.get_running_loop()
        probes = [h.probe for h in self._health.values() if h.probe is not None and h.probe.get_loop() is loop]
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        await self.session.aclose()

    @property
    def max_model_len(self) -> int | None:
        """The smallest max_model_len the replicas reported at start() (None if they report none)."""
        if not self._started:
            raise RuntimeError("EndpointPool.max_model_len: call `await pool.start()` first")
        return self._max_model_len

    @property
    def ejected(self) -> list[str]:
        """The replicas now out of selection."""
        return [url for url in self.urls if self._health[url].out_until is not None]

    # --- the API (client.EndpointClient's, over the pool) ------------------------------------------------------

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                       seed: int | None = None, stop_token_ids: list[int] | None = None) -> Generation:
        return await self.call(lambda replica: replica.generate(
            prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
            stop_token_ids=stop_token_ids))

    async def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_ids[t] | token_ids[:t]) for t = 1..n-1; n may be at most max_model_len - 1."""
        await self._ensure_started()
        limit = self._max_model_len
        if limit is not None and len(token_ids) > limit - 1:
            raise RequestRejected(self.url_list, f"cannot score {len(token_ids)} tokens: the server samples one "
                                                 f"token after them, so at most max_model_len - 1 = {limit - 1}",
                                  status=400)
        return await self.call(lambda replica: replica.score(token_ids))

    async def classify(self, inputs: list[list[int]]) -> list[float]:
        """The served sequence classifier's raw score of each token-id input (a pooling deployment)."""
        return await self.call(lambda replica: replica.classify(inputs))

    async def chat(self, messages: list[dict], *, max_tokens: int, temperature: float = 1.0,
                   seed: int | None = None) -> str:
        return await self.call(lambda replica: replica.chat(messages, max_tokens=max_tokens, temperature=temperature,
                                                            seed=seed))

    async def tokenize(self, text: str | None = None, messages: list[dict] | None = None, *,
                       add_generation_prompt: bool = True, add_special_tokens: bool = True) -> list[int]:
        return await self.call(lambda replica: replica.tokenize(
            text, messages, add_generation_prompt=add_generation_prompt, add_special_tokens=add_special_tokens))

    @property
    def url_list(self) -> str:
        return ", ".join(self.urls)

    async def call(self, request: Callable[[EndpointClient], Awaitable[R]]) -> R:
        """Run `request(replica)` on the least loaded healthy replica, failing over to another on a retryable error;
        with `recover`, a request that no replica answered restarts the dead replicas and is sent once more (the
        same request: a seeded one samples the same tokens)."""
        try:
            return await self._call_once(request)
        except PoolUnavailable:
            if self.recover is None:
                raise
            failed_at = self.recoveries
            if not await asyncio.to_thread(self._recover, failed_at):
                raise  # nothing was dead (a hung replica, say): the error stands
        return await self._call_once(request)

    def _recover(self, failed_at: int) -> bool:
        """Restart the dead replicas (once for all the requests that failed together); whether any was."""
        with self._recovering:
            if self.recoveries == failed_at:  # not already done by a request that failed at the same time
                if not self.recover():
                    return False
                log.warning("serving: no replica of %r answered; restarted the dead ones (%s), sending again",
                            self.model, self.url_list)
                self.recoveries += 1
            with self._lock:
                for health in self._health.values():
                    health.out_until, health.failures_in_a_row = None, 0
            return True

    async def _call_once(self, request: Callable[[EndpointClient], Awaitable[R]]) -> R:
        await self._ensure_started()
        tried: set[str] = set()
        errors: list[ReplicaUnavailable] = []
        for _ in range(self.max_attempts):
            replica = await self._select(tried)
            if replica is None:
                break
            url = replica.url
            tried.add(url)
            with self._lock:
                self.outstanding[url] += 1
            try:
                result = await request(replica)
            except ReplicaUnavailable as exc:
                self._record_failure(url, exc)
                errors.append(exc)
                continue
            finally:
                with self._lock:
                    self.outstanding[url] -= 1
            self._record_success(url)
            return result
        out = self._why_out(exclude=tried)
        if errors:
            raise PoolUnavailable(self.urls, f"no replica of {self.model!r} answered ({len(errors)} attempt"
                                             f"{'s' if len(errors) > 1 else ''}): "
                                             + "; ".join(str(error) for error in errors)
                                             + (f"; out of the pool: {out}" if out else ""))
        raise PoolUnavailable(self.urls, f"no replica of {self.model!r} available: {out}")

    # --- selection and health ---------------------------------------------------------------------------------

    async def _ensure_started(self) -> None:
        """A pool used before `start()` starts itself, once for all the requests that arrive meanwhile."""
        if self._started:
            return
        loop = asyncio.get_running_loop()
        with self._lock:
            task = self._starting
            if task is None or task.get_loop() is not loop or (task.done() and not self._started):
                task = self._starting = loop.create_task(self.start())
        await asyncio.shield(task)

    async def _select(self, tried: set[str]) -> EndpointClient | None:
        replica = self._pick(tried)
        if replica is not None:
            return replica
        # Nothing in selection: wait for the probes under way (of replicas this request has not tried), then look
        # once more. A replica whose probe is not yet due stays out: the request fails at once.
        loop = asyncio.get_running_loop()
        probes = [h.probe for url, h in self._health.items()
                  if url not in tried and h.probe is not None and h.probe.get_loop() is loop and not h.probe.done()]
        if not probes:
            return None
        await asyncio.wait(probes)
        return self._pick(tried)

    def _pick(self, tried: set[str]) -> EndpointClient | None:
        now = time.monotonic()
        self._start_due_probes(now)
        with self._lock:
            count = len(self.replicas)
            start = self._next
            self._next = (self._next + 1) % count
            candidates = [index for index, url in enumerate(self.urls)
                          if url not in tried and self._health[url].out_until is None]
            if not candidates:
                return None
            best = min(candidates, key=lambda index: (self.outstanding[self.urls[index]], (index - start) % count))
            return self.replicas[best]

    def _record_success(self, url: str) -> None:
        with self._lock:
            health = self._health[url]
            health.failures_in_a_row = 0
            self.served[url] += 1
            back = health.out_until is not None
            health.out_until = None
        if back:
            log.info("serving: %s answered again; back in the pool of %r", url, self.model)

    def _record_failure(self, url: str, error: ReplicaUnavailable) -> None:
        with self._lock:
            health = self._health[url]
            health.failures_in_a_row += 1
            health.last_error = error.detail
            self.failures[url] += 1
            eject = health.out_until is None and health.failures_in_a_row >= self.eject_after
            if eject:
                health.out_until = time.monotonic() + self.probe_interval_s
        if eject:
            log.warning("serving: %s failed %d times in a row, out of the pool of %r (probed again in %g s): %s",
                        url, health.failures_in_a_row, self.model, self.probe_interval_s, error.detail)

    def _start_due_probes(self, now: float) -> None:
        loop = asyncio.get_running_loop()
        for replica in self.replicas:
            health = self._health[replica.url]
            if health.out_until is None or health.out_until > now:
                continue
            with self._lock:
                probe = health.probe
                if probe is not None and not probe.done() and probe.get_loop() is loop:
                    continue
                health.probe = loop.create_task(self._probe(replica), name=f"rollout-serving-probe {replica.url}")

    async def _probe(self, replica: EndpointClient) -> None:
        health = self._health[replica.url]
        try:
            await replica.check(timeout_s=self.probe_timeout_s)
        except ServingError as exc:
            with self._lock:
                health.last_error = exc.detail
                if health.out_until is not None:
                    health.out_until = time.monotonic() + self.probe_interval_s
        else:
            with self._lock:
                back = health.out_until is not None
                health.failures_in_a_row, health.out_until = 0, None
            if back:
                log.info("serving: %s answers again; back in the pool of %r", replica.url, self.model)

    def _why_out(self, exclude: set[str]) -> str:
        """The replicas out of the pool (but those in `exclude`) and why, on one line."""
        now = time.monotonic()
        parts = []
        for url in self.urls:
            health = self._health[url]
            if health.out_until is not None and url not in exclude:
                wait = max(0.0, health.out_until - now)
                parts.append(f"{url} (out after {health.failures_in_a_row} failures in a row, probed again in "
                             f"{wait:.0f} s; last error: {health.last_error})")
        return ", ".join(parts)


async def bounded_map(fn: Callable[[T], Awaitable[R]], items: Iterable[T], *, concurrency: int) -> list[R]:
    """`[await fn(item) for item in items]` with at most `concurrency` calls in flight, results in input order.
    The first error cancels the calls still running and is raised."""
    gate = asyncio.Semaphore(concurrency)

    async def one(item: T) -> R:
        async with gate:
            return await fn(item)

    tasks = [asyncio.ensure_future(one(item)) for item in items]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

