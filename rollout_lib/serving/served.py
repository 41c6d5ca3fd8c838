"""Every model a run reaches over HTTP, owned in one place: `ServedModels` starts or connects each one once, hands out
its replica pool, and stops what it started at `close()`:

- **Frozen models** (teachers, judges, frozen samplers): each distinct setting becomes one started replica pool.
  `{ base_url = [...], name = ... }`: a pool over the user's replicas, probed at connection. `{ model = "<ref>" }`:
  a deployment rollout serves (engine.py); one already running for the same model directory (a `rollout serve
  start` the user kept, or the test session's) is reused and left running. Connecting checks the served model's
  tokenizer against the policy's (tokenizers.py): a mismatch is a config error naming the setting, raised before
  any step samples or trains.
- **Reward models** served by vLLM's pooling runner: rollout's own deployment (`reward_model_pool`), or servers you
  run, given by URL (`reward_model_at`), connected and checked (pooling_servers.py) but never started or restarted.
- **The policy server** (`policy_server`, serving/policy_server.py) when the live policy samples on the engine: a
  deployment of the base model in dev mode, started for this run (or a killed run's orphan of the same model
  adopted), never shared with frozen models or another run.

A frozen model's pool may also be reached over HTTP through `router` (serving/router.py). Every replica rollout
serves is restarted when a request finds none answering (pool.py, "Recovery"). What this object started is stopped
by `close()`; a run killed before it could close leaves orphans, which the next run of that model adopts.

The flow creates one `ServedModels`, hands it to the tasks that need a served model (a resource, never part of a
cache key: tasks.common.RESOURCE_PARAMETERS) and closes it at the end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence

from rollout_lib.errors import ConfigError
from rollout_lib.hardware import replica_gpus
from rollout_lib.serving.settings import ExternalModel, ServedModel
from rollout_lib.serving import engine
from rollout_lib.serving.policy_server import PolicyServer, PolicyServerSpec, remote_deployment
from rollout_lib.serving.client import ServingError
from rollout_lib.serving.pool import EndpointPool
from rollout_lib.serving.pooling_servers import connect_pooling_servers
from rollout_lib.serving.references import default_name, served_model_directory
from rollout_lib.serving.router import PoolRouter
from rollout_lib.serving.tokenizers import find_tokenizer_mismatch
from rollout_lib.store import ObjectStore, canonical_json

log = logging.getLogger(__name__)


class ServedModels:
    def __init__(self, store_url: str | None = None):
        self.store_url = store_url  # where checkpoint references ({ model = "runs/<name>/latest" }) are found
        self._pools: dict[bytes, EndpointPool] = {}
        self.described: dict[bytes, str] = {}  # per pool: "model 'name' at url, url" (for logs and errors)
        self._started: list[str] = []  # deployments this object started, stopped by close()
        self._lock = threading.Lock()  # tasks may run in threads of one flow process
        self._policy_servers: dict[bytes, PolicyServer] = {}
        self._router: PoolRouter | None = None  # every model a reward function reaches over HTTP, one address
        self._routable: list[tuple[EndpointPool, str]] = []  # what the router serves, or will once it starts

    def pool(self, frozen: ExternalModel | ServedModel, *, tokenizer=None, where: str) -> EndpointPool:
        """The started pool of `frozen` (connecting on first use); `tokenizer`: the policy's, checked once."""
        key = canonical_json(frozen.model_dump(mode="json"))
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool, described = self._connect(frozen, where)
                if tokenizer is not None:
                    mismatch = asyncio.run(find_tokenizer_mismatch(pool, tokenizer))
                    if mismatch:
                        asyncio.run(pool.aclose())
                        raise ConfigError([(where, f"{described} does not share the policy's tokenizer: {mismatch}")])
                self._pools[key] = pool
                self.described[key] = described
            return pool

    def router(self, frozen: ExternalModel | ServedModel, *, where: str) -> PoolRouter:
        """The run's one HTTP router (serving/router.py: one address for every replica of every model a reward
        function reaches, routed by model name, with each pool's guarantees), serving `frozen`'s pool from now on;
        started on first use on 127.0.0.1 and stopped at close(). `where` names the setting in the errors about
        that model (the first to ask: later ones share it)."""
        return self._routed(self.pool(frozen, where=where), where)

    def _routed(self, pool: EndpointPool, where: str) -> PoolRouter:
        with self._lock:
            if all(known is not pool for known, _ in self._routable):
                self._routable.append((pool, where))
            if self._router is None or not self._router.alive():
                self._router = PoolRouter(pool, where=where).start()
            for routable, routable_where in self._routable:  # the reward models served so far too
                self._router.add(routable, where=routable_where)
            return self._router

    def _routable_too(self, pool: EndpointPool, where: str) -> None:
        """A reward model's pool: behind the run's router as well (its /classify by name), now or once it starts."""
        self._routable.append((pool, where))
        if self._router is not None:
            self._router.add(pool, where=where)

    def connect(self, frozen: ExternalModel | ServedModel, *, tokenizer, where: str) -> str:
        """Connect `frozen` now (serving it if rollout is to) and check its tokenizer; returns what it connected."""
        self.pool(frozen, tokenizer=tokenizer, where=where)
        return self.described[canonical_json(frozen.model_dump(mode="json"))]

    def reward_model_pool(self, reference, *, replicas: int, where: str, gpus=None) -> EndpointPool:
        """The started pool of a reward model rollout serves with vLLM's pooling runner (`POST /classify`):
        `reference` is a ModelRef (a checkpoint looked up in its own `store`, or any model reference); `gpus`: the
        GPUs its replicas take."""
        key = canonical_json(["pooling", reference.uri, reference.store, replicas, gpus])
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                try:
                    deployment = self._deployment(reference.uri, reference.store, replicas=replicas,
                                                  max_model_len=None, runner="pooling", gpus=gpus, where=where)
                except ConfigError:
                    raise
                except (engine.EngineError, OSError, ValueError) as exc:
                    raise ConfigError([(where, f"cannot serve reward model {reference.uri!r}: {exc}")]) from None
                pool = EndpointPool(deployment.base_urls, deployment.name, recover=_restarter(deployment))
                asyncio.run(pool.start())
                self._pools[key] = pool
                self.described[key] = f"reward model {deployment.name!r} at {', '.join(deployment.base_urls)}"
                self._routable_too(pool, where)
            return pool

    def reward_model_at(self, reference, base_url: Sequence[str], served_name: str | None, *, tokenizer,
                        where: str) -> EndpointPool:
        """The started pool over the pooling servers you run (`base_url`) of the reward model `reference` (a
        ModelRef), checked against `tokenizer` (the reference's) on first use; `where`: the base_url setting's
        locator, which a refusal names."""
        key = canonical_json(["pooling-at", reference.uri, reference.store, list(base_url), served_name])
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                try:
                    pool = asyncio.run(connect_pooling_servers(list(base_url), served_name, tokenizer))
                except ServingError as exc:  # one line naming the URL and what to do
                    raise ConfigError([(where, str(exc))]) from None
                self._pools[key] = pool
                self.described[key] = f"reward model {pool.model!r} at {pool.url_list}"
                self._routable_too(pool, where)
            return pool

    def policy_server(self, spec: PolicyServerSpec) -> PolicyServer:
        """The run's policy server for `spec` (serving/policy_server.py), started on first use: a live-policy
        deployment named `policy-<model>-<this pid>`, an orphaned one of the same model and flags adopted (its run
        was killed), or `spec.remote_urls` reached. What it holds is unknown until `PolicyServer.hold` reloads and
        checks it."""
        args = spec.server_args()
        placed = replica_gpus(list(spec.gpus), spec.replicas)  # replica j's GPUs (hardware.replica_gpus)
        key = canonical_json(["policy", spec.base_model.uri, spec.replicas, args, list(spec.remote_urls), placed])
        with self._lock:
            server = self._policy_servers.get(key)
            if server is None:
                deployment = remote_deployment(list(spec.remote_urls), spec.served_name) if spec.remote_urls \
                    else self._policy_deployment(spec, args, placed)
                server = PolicyServer(deployment, spec, ObjectStore(self.store_url) if spec.remote_urls else None)
                self._policy_servers[key] = server
            return server

    def _policy_deployment(self, spec: PolicyServerSpec, args: list[str], placed) -> engine.Deployment:
        """This run's own policy deployment: a killed run's orphan of the same model, flags and GPUs adopted, else
        one started; stopped at close()."""
        store_url = spec.base_model.store or self.store_url
        model_dir = served_model_directory(spec.base_model, store_url)
        deployment = None
        for running in engine.running_deployments():
            if (running.live_policy and running.orphaned and running.model_dir == str(model_dir)
                    and len(running.replicas) == spec.replicas and running.extra_args == args
                    and running.gpus == placed):
                deployment = engine.claim_orphan(running.name, os.getpid())
                if deployment is not None:
                    log.info("adopting policy server %s left by a killed run", running.name)
                    deployment = engine.restart_dead_replicas(deployment)
                    break
        if deployment is None:
            name = f"policy-{default_name(spec.base_model)[:60]}-{os.getpid()}"
            deployment = engine.start_deployment(spec.base_model, name=name, replicas=spec.replicas,
                                                 store_url=store_url, owner_pid=os.getpid(), live_policy=True,
                                                 extra_args=args, gpus=list(spec.gpus))
        self._started.append(deployment.name)
        return deployment

    def _connect(self, frozen: ExternalModel | ServedModel, where: str) -> tuple[EndpointPool, str]:
        recover = None  # a server given by URL is the user's: failover and a clear error, no restart
        if isinstance(frozen, ExternalModel):
            urls, name = frozen.base_url, frozen.name
        else:
            deployment = self._deployment(frozen.model.uri, self.store_url, replicas=frozen.replicas,
                                          max_model_len=frozen.max_model_len, runner=frozen.runner,
                                          gpus=frozen.gpus, where=where)
            urls, name, recover = deployment.base_urls, deployment.name, _restarter(deployment)
        pool = EndpointPool(urls, name, timeout_s=frozen.timeout_s, max_attempts=frozen.max_attempts,
                            recover=recover)
        asyncio.run(pool.start())
        return pool, f"model {name!r} at {', '.join(urls)}"

    def _deployment(self, uri: str, store_url: str | None, *, replicas: int, max_model_len: int | None,
                    runner: str, gpus: list[int] | None = None, where: str = ""):
        """A running deployment of the model reused (a placed one only where it is placed as asked), else one
        started: `gpus` split over its replicas (hardware.replica_gpus)."""
        model_dir = served_model_directory(uri, store_url)
        placed = replica_gpus(list(gpus), replicas) if gpus else None
        for running in engine.running_deployments():
            if running.model_dir == str(model_dir) and running.runner == runner and not running.live_policy:
                if placed is not None and running.gpus != placed:
                    raise ConfigError([(f"{where}.gpus", f"{uri} is already served by deployment {running.name!r} "
                                        f"on GPUs {running.gpus or 'all'}, not {placed}: stop it (rollout serve stop "
                                        f"{running.name}) or leave gpus out to use it")])
                if running.orphaned:  # its run was killed before it could stop it: ours to stop now
                    self._started.append(running.name)
                log.info("reusing served deployment %s for %s", running.name, uri)
                return engine.restart_dead_replicas(running)
        # A reward model is named by its directory (for a checkpoint: its id, whatever ref named it), apart from a
        # generation deployment of the same weights.
        name = f"rm-{default_name(str(model_dir))[:60]}" if runner == "pooling" else None
        deployment = engine.start_deployment(uri, name=name, replicas=replicas, store_url=store_url,
                                             max_model_len=max_model_len, runner=runner, owner_pid=os.getpid(),
                                             gpus=list(gpus or ()))
        self._started.append(deployment.name)
        return deployment

    def __enter__(self) -> "ServedModels":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close every pool; stop the deployments this object started."""
        with self._lock:
            if self._router is not None:  # first: it sends through the pools
                self._router.close()
                self._router = None
            self._routable.clear()
            for pool in self._pools.values():
                asyncio.run(pool.aclose())
            self._pools.clear()
            self.described.clear()
            for server in self._policy_servers.values():
                server.close()
            self._policy_servers.clear()
            for name in self._started:
                engine.stop_deployment(name)
            self._started.clear()


def _restarter(deployment: engine.Deployment):
    """The pool's `recover` for a deployment rollout serves: its dead replicas started again on their ports (and
    waited for); False when none is dead. From the record when there is one, else from what the run knew of it (a
    deployment whose every replica died has its record dropped by the next look)."""
    def restart() -> bool:
        current = engine.find_deployment(deployment.name)
        if current is not None and all(replica.alive for replica in current.replicas):
            return False
        engine.restart_dead_replicas(current or deployment)
        return True
    return restart
