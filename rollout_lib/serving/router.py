"""A run's served models' replica pools over HTTP, behind one address: the one a user's reward function POSTs
OpenAI-compatible requests to (verl's `reward_router_address`, seed 004: one address over all of a run's reward
servers), routed by the body's `"model"`, each with its pool's guarantees.

    router = PoolRouter(pool, where="algorithm.rl.envs[0].rewards[0].judge").start()
    router.add(other_pool, where="algorithm.rl.envs[1].rewards[0].judge")   # another judge, a reward model
    router.address          # "127.0.0.1:PORT", verl's format: the function builds f"http://{address}/v1/..."
    router.close()

A body that names no model goes to the one model the router serves (several: refused, listing them). Each request
is one `pool.call(...)`, so every guarantee of the pool holds (pool.py). uvicorn runs a Starlette app in a daemon
thread on 127.0.0.1; any path is forwarded, streaming is refused, and a failure is an OpenAI-style error body whose
one-line message names the setting (`where`) and the replicas. In full, and why not `vllm-router`: docs/serving.md,
"The reward router".
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_lib.serving.client import RequestRejected, ServingError
from rollout_lib.serving.pool import EndpointPool, PoolUnavailable

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0


class PoolRouter:
    def __init__(self, pool: EndpointPool, *, where: str):
        """`pool`: the first model's; `where`: the setting whose model it is (an error about a model names its
        setting). `add` serves more."""
        self.pools: dict[str, tuple[EndpointPool, str]] = {pool.model: (pool, where)}
        # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and without it every reply
        # (headers, then body) waits ~40 ms for the client's delayed ACK.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))  # the kernel's free port, held from now on: no race for it
        self.port = self._socket.getsockname()[1]
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST"])])
        config = uvicorn.Config(app, loop="asyncio", log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name=f"rollout-reward-router {self.port}", daemon=True)
        self._failed: BaseException | None = None

    @property
    def address(self) -> str:
        """host:port, as verl hands it to compute_score."""
        return f"127.0.0.1:{self.port}"

    @property
    def pool(self) -> EndpointPool:
        """The pool of a router serving one model."""
        (pool, _), = self.pools.values()
        return pool

    @property
    def where(self) -> str:
        return " / ".join(where for _, where in self.pools.values())

    def add(self, pool: EndpointPool, *, where: str) -> "PoolRouter":
        """Serve `pool`'s model too, under its served name (a name served already keeps its first pool)."""
        self.pools.setdefault(pool.model, (pool, where))
        return self

    def __repr__(self) -> str:
        return f"PoolRouter({self.address}, {[pool for pool, _ in self.pools.values()]!r})"

    def start(self) -> "PoolRouter":
        """Serve from a daemon thread; returns once the server accepts connections (raises, naming the setting, if it
        does not within START_TIMEOUT_S)."""
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if self._failed is not None or not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise ServingError(self.address, f"{self.where}: the reward router did not start"
                                                 + (f": {self._failed}" if self._failed else ""))
            time.sleep(0.01)
        return self

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._server.should_exit

    def close(self) -> None:
        """Stop serving (requests in flight get up to 5 s to finish) and join the thread. Idempotent."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._socket.close()

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._failed = exc

    async def _forward(self, request: Request) -> JSONResponse:
        path = "/" + request.path_params["path"]
        body = None
        if request.method == "POST":
            try:
                body = json.loads(await request.body())
            except ValueError as exc:
                return self._error(400, f"the request body is not JSON ({exc})")
            if not isinstance(body, dict):
                return self._error(400, f"the request body is a JSON {type(body).__name__}, not an object")
            if body.get("stream"):
                return self._error(400, "streaming is not supported: send the request without \"stream\"")
        elif path == "/v1/models" and len(self.pools) > 1:
            return await self._models()
        named = body.get("model") if body is not None else None
        if named is None and len(self.pools) > 1:
            return self._error(400, f"this address serves {self._names()}: name one as the body's \"model\"")
        if named is not None and named not in self.pools:
            return self._error(404, f"no model {named!r} here: it serves {self._names()}")
        pool, where = self.pools[named] if named is not None else next(iter(self.pools.values()))
        if body is not None:
            body.setdefault("model", pool.model)
        try:
            reply = await pool.call(lambda replica: replica.request(request.method, path, body))
        except RequestRejected as exc:
            return self._error(exc.status, str(exc), pool, where)
        except PoolUnavailable as exc:
            return self._error(503, str(exc), pool, where)
        except ServingError as exc:  # a reply that is not JSON, or of the wrong shape
            return self._error(502, str(exc), pool, where)
        except Exception as exc:  # noqa: BLE001 - the caller gets one line, not a dropped connection
            log.exception("reward router of %s", where)
            return self._error(500, f"{type(exc).__name__}: {exc}", pool, where)
        return JSONResponse(reply)

    async def _models(self) -> JSONResponse:
        """Every model's own /v1/models entry (max_model_len and all), in the order they were added."""
        data = []
        for pool, _ in self.pools.values():
            listed = await pool.call(lambda replica: replica.request("GET", "/v1/models", None))
            data.extend(entry for entry in listed.get("data", []) if entry.get("id") == pool.model)
        return JSONResponse({"object": "list", "data": data})

    def _names(self) -> str:
        return ", ".join(repr(name) for name in self.pools)

    def _error(self, status: int, message: str, pool: EndpointPool | None = None, where: str | None = None
               ) -> JSONResponse:
        if pool is None and len(self.pools) == 1:  # before routing: the one model it serves
            pool, where = next(iter(self.pools.values()))
        about = f"{where} (model {pool.model!r})" if pool is not None else self.where
        line = " ".join(f"reward router of {about}: {message}".split())
        return JSONResponse({"error": {"message": line, "code": status}}, status_code=status)
