"""The live policy on a vLLM engine: a deployment started from the base model in vLLM's dev mode, whose weights
are reloaded in place to the policy state a sample stage samples from, and checked before anything samples.

    server = served_models.policy_server(spec)  # a PolicyServerSpec: started (or an orphan adopted), run-owned
    server.hold(state_id, model, tokenizer)  # every replica holds `model`'s weights, verified; no-op if it does
    await server.pool.generate(...)          # an EndpointPool over the replicas
    server.recover()                         # replicas died mid-step: restart them (they hold nothing until `hold`)

A replica that stops answering during a hold (killed inside the reload or the probe) raises PolicyReplicaLost; the
sampler then restarts it and holds again, as for one lost while sampling (sampling/vllm.py).

Reload (serving/weight_sync.py, engine_reload.py): the model's state dict -> a safetensors file in shared memory,
`lm_head.weight` written even when tied (vLLM's CPU engine otherwise keeps its head on the old embeddings), then
`POST /collective_rpc {"method": "reload_policy_weights"}` on every replica not holding the state yet;
`reload_paths` says which path ran on each. A LoRA policy: the replicas run the frozen base with `--enable-lora`,
and a reload writes the adapter directory and loads it in place under one name (`/v1/load_lora_adapter`).

Verification: a fixed probe (PROBE_LENGTH token ids from a fixed seed) is scored by each reloaded replica and by
the trainer's forward of the same weights; a replica off by more than `tolerance` anywhere fails the step with a
PolicyServerError naming its URL, the state and the difference. A bfloat16 engine is compared with the weights
rounded to bfloat16 at BF16_PROBE_TOLERANCE. Why 1e-3 and 16 tokens, what the probe can and cannot see (measured):
docs/serving.md.

What a replica holds is remembered per (URL, process id): a restarted replica (same URL, new process) starts from
the base model's files again, so it is reloaded on the next `hold`.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from rollout_lib.serving import engine
from rollout_lib.serving.client import EndpointClient, ReplicaUnavailable, ServingError, base_model_names
from rollout_lib.serving.pool import EndpointPool
from rollout_lib.serving.store_fetch import STATE_FILES
from rollout_lib.serving.weight_sync import AdapterDirectory, SharedWeightsFile
from rollout_lib.store import ObjectStore

log = logging.getLogger(__name__)

PROBE_LENGTH = 16
PROBE_SEED = 20261123
DEFAULT_TOLERANCE = 1e-3
BF16_PROBE_TOLERANCE = 2.0  # a bfloat16 engine against the trainer's weights in bfloat16 (module docstring)
RELOAD_TIMEOUT_S = 600.0  # a reload of a large model from disk; the per-request timeout of sampling is separate


# The ranks vLLM accepts as --max-lora-rank (vllm.config.lora.MaxLoRARanks): an adapter of rank r needs the first
# that is >= r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_server_args(rank: int) -> list[str]:
    """The flags of a policy server that serves a LoRA policy of `rank`: one adapter slot, in place reloads."""
    slot = next((allowed for allowed in VLLM_LORA_RANKS if allowed >= rank), None)
    if slot is None:
        raise ValueError(f"a LoRA rank of {rank} is above the largest vLLM serves ({VLLM_LORA_RANKS[-1]})")
    return ["--enable-lora", "--max-lora-rank", str(slot), "--max-loras", "1"]


@dataclass(frozen=True)
class PolicyServerSpec:
    """The run's policy server (ServedModels.policy_server), built in one place: VllmSamplerSettings.server_spec.
    `extra_args`: server flags (engine.start_deployment); an orphan is adopted only if started with the same.
    `adapter_rank`: the policy is a LoRA adapter of that rank. `remote_urls`: policy servers on other nodes (`rollout
    serve start BASE --live-policy`), shipped each state through the run's store; none is started here."""

    base_model: Any  # config.common.ModelRef: what the server starts from (then reloaded per state)
    replicas: int = 1
    timeout_s: float | None = 120.0
    max_attempts: int = 3
    tolerance: float = DEFAULT_TOLERANCE
    extra_args: tuple[str, ...] = ()
    probe_dtype: torch.dtype = torch.float32
    adapter_rank: int | None = None
    remote_urls: tuple[str, ...] = ()
    served_name: str | None = None
    gpus: tuple[int, ...] = ()  # this node's GPUs the replicas take, split evenly

    def server_args(self) -> list[str]:
        return [*self.extra_args, *(lora_server_args(self.adapter_rank) if self.adapter_rank is not None else [])]


class PolicyServerError(RuntimeError):
    """The policy server cannot be brought to the requested weights (a reload failed, or the probe disagrees)."""


class PolicyReplicaLost(PolicyServerError):
    """A replica stopped answering during a hold (connection refused or reset, cut off mid-answer, timed out, HTTP
    5xx): its process may have died. The sampler handles it as a replica lost while sampling (sampling/vllm.py):
    it restarts the dead replicas of a server rollout started and holds again; one on another node, or one still
    running (hung), fails the step with this message."""


@dataclass
class HoldReport:
    """What `hold` did: the replicas it reloaded, the seconds write + reload + check took (and the write's alone),
    the largest probe difference."""

    reloaded: list[str] = field(default_factory=list)
    seconds: float = 0.0
    write_seconds: float = 0.0
    engine_reload_seconds: float = 0.0  # the slowest replica's reload call (fetch included for a remote one)
    probe_seconds: float = 0.0  # the trainer's forward of the probe, then the slowest replica's scoring of it
    max_probe_diff: float | None = None


def probe_ids(model, tokenizer, length: int = PROBE_LENGTH) -> list[int]:
    """The fixed probe sequence: `length` token ids drawn from a fixed seed among the ids both the tokenizer and the
    embeddings know (the server refuses ids past the tokenizer's), the same in every process and run."""
    vocab_size = min(len(tokenizer), int(model.get_input_embeddings().weight.shape[0]))
    return [int(token) for token in np.random.default_rng(PROBE_SEED).integers(0, vocab_size, size=length)]


@torch.no_grad()
def trainer_logprobs(model, token_ids: list[int]) -> list[float]:
    """log p(token_ids[t] | token_ids[:t]), t = 1..n-1, by the in-memory model (eval mode, temperature 1)."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        return chosen.cpu().tolist()
    finally:
        model.train(was_training)


class PolicyServer:
    """A live-policy deployment (engine.py, `live_policy=True`) and the state each replica holds."""

    def __init__(self, deployment: engine.Deployment, spec: PolicyServerSpec, ship_through: ObjectStore | None = None):
        self.deployment, self.spec = deployment, spec  # the probe is computed in the engine's dtype, spec.probe_dtype
        # Replicas on another node (`remote_deployment`): each state goes through the run's store, which they read
        # themselves (store_fetch.py); rollout neither restarts them nor knows their processes, so every hold
        # reloads and checks them.
        self.store = ship_through
        # The weights the replicas reload from (serving/weight_sync.py): a file in shared memory, rewritten in place;
        # a LoRA policy (`spec.adapter_rank`): its adapter directory, which every replica loads in place under one
        # adapter name, `served_name`, the model its requests name.
        dirs = engine.weights_dirs(deployment.name)
        self.adapter = spec.adapter_rank is not None
        self.weights = AdapterDirectory(dirs, spec.base_model.uri) if self.adapter else SharedWeightsFile(dirs)
        self._holds: dict[str, tuple[int, str]] = {}  # base URL -> (pid, state id) it was loaded and checked with
        self.reload_paths: dict[str, str] = {}  # base URL -> how its last reload ran (engine_reload.py)
        self._lock = threading.Lock()
        self.pool = self._new_pool()

    @property
    def name(self) -> str:
        return self.deployment.name

    @property
    def served_name(self) -> str:
        """The model name requests ask for: the deployment's (its weights reloaded in place), or its adapter's."""
        return f"{self.deployment.name}-adapter" if self.adapter else self.deployment.name

    @property
    def urls(self) -> str:
        return ", ".join(self.deployment.base_urls)

    def _new_pool(self) -> EndpointPool:
        return EndpointPool(self.deployment.base_urls, self.served_name, timeout_s=self.spec.timeout_s,
                            max_attempts=self.spec.max_attempts)

    @property
    def remote(self) -> bool:
        return self.store is not None

    def holds(self, state_id: str) -> bool:
        """Whether every replica, as it runs now, was loaded with `state_id` and checked (a remote replica's process
        is unknown, a restart unseen: never taken as holding anything)."""
        return not self.remote and all(self._holds.get(replica.base_url) == (replica.pid, state_id)
                                       for replica in self.deployment.replicas)

    def recover(self) -> list[str]:
        """Restart the replicas whose process is gone (engine.restart_dead_replicas) and start a fresh pool (the old
        one ejected them); the URLs restarted. They hold the base model until the next `hold` reloads them."""
        if self.remote:  # another node's servers: theirs to restart
            return []
        with self._lock:
            before = {replica.base_url: replica.pid for replica in self.deployment.replicas}
            self.deployment = engine.restart_dead_replicas(self.deployment)
            restarted = [replica.base_url for replica in self.deployment.replicas
                         if before.get(replica.base_url) != replica.pid]
            self._replace_pool()
            return restarted

    def _replace_pool(self) -> None:
        old, self.pool = self.pool, self._new_pool()
        asyncio.run(old.aclose())

    def hold(self, state_id: str, model, tokenizer) -> HoldReport:
        """Bring every replica to `model`'s weights, known as `state_id`: restart dead replicas, reload those that do
        not hold the state, verify each reloaded one with the probe. PolicyServerError when a reload fails or a
        replica's probe logprobs are off by more than the tolerance, PolicyReplicaLost when a replica stops answering
        (`recover`, then `hold` again, is the caller's: sampling/vllm.py); nothing is remembered as held then."""
        with self._lock:
            report = HoldReport()
            started = time.perf_counter()
            if not self.remote and any(not replica.alive for replica in self.deployment.replicas):
                self.deployment = engine.restart_dead_replicas(self.deployment)
                self._replace_pool()
            stale = [replica for replica in self.deployment.replicas
                     if self.remote or self._holds.get(replica.base_url) != (replica.pid, state_id)]
            if not stale:
                return report
            log.info("policy server %s: reloading %s to state %s", self.name,
                     ", ".join(replica.base_url for replica in stale), state_id)
            self.weights.write(model)
            if self.remote:
                self._ship()
            report.write_seconds = time.perf_counter() - started
            for replica in stale:
                self._holds.pop(replica.base_url, None)
            report.reloaded = [replica.base_url for replica in stale]
            report.max_probe_diff = self._verify(report.reloaded, state_id, model, tokenizer, reload=True,
                                                 report=report)
            for replica in stale:
                self._holds[replica.base_url] = (replica.pid, state_id)
            report.seconds = time.perf_counter() - started
            log.info("policy server %s: reloaded %s with state %s in %.2f s (weights written in %.2f s, reloaded %s; "
                     "probe max |diff| %.2g)", self.name, ", ".join(report.reloaded), state_id, report.seconds,
                     report.write_seconds, ", ".join(sorted({self.reload_paths.get(url, "?")
                                                             for url in report.reloaded})), report.max_probe_diff)
            return report

    def check(self, state_id: str, model, tokenizer) -> float:
        """Verify, without reloading, that every replica serves `model`'s weights (the probe); the largest
        difference, or PolicyServerError naming the replica that does not."""
        return self._verify(self.deployment.base_urls, state_id, model, tokenizer, reload=False)

    def _verify(self, urls: list[str], state_id: str, model, tokenizer, *, reload: bool,
                report: HoldReport | None = None) -> float:
        """(Reload, then) score the probe on each replica of `urls` and compare with the trainer's logprobs: the
        largest difference, or PolicyServerError naming the first replica beyond the tolerance. `report` gets the
        seconds of each part."""
        probe = probe_ids(model, tokenizer)
        started = time.perf_counter()
        expected = self._expected(model, probe)
        timings: dict[str, float] = {"trainer": time.perf_counter() - started}
        diffs = asyncio.run(self._probe_all(urls, probe, expected, reload=reload, timings=timings))
        if report is not None:
            report.engine_reload_seconds = timings.get("reload", 0.0)
            report.probe_seconds = timings.get("trainer", 0.0) + timings.get("score", 0.0)
        for url, diff in zip(urls, diffs):
            if diff > self.spec.tolerance:
                raise PolicyServerError(
                    f"policy server {url} ({self.name!r}) does not hold policy state {state_id}"
                    f"{' after reloading it' if reload else ''}: its logprobs of the {len(probe)}-token probe differ "
                    f"from the trainer's by up to {diff:.3g} (tolerance {self.spec.tolerance:g}); refusing to sample "
                    "from unknown weights")
        return max(diffs)

    def _expected(self, model, probe: list[int]) -> list[float]:
        """The trainer's logprobs of the probe, in the engine's dtype."""
        if self.spec.probe_dtype == torch.float32:
            return trainer_logprobs(model, probe)
        # the weights rounded as the engine rounds them (a copy: the trainer's model stays fp32)
        return trainer_logprobs(copy.deepcopy(model).to(self.spec.probe_dtype), probe)

    @property
    def _shipped(self) -> str:
        """Where in the store a remote replica fetches the state from."""
        return f"{self.store.root}/transfer/{self.name}"

    def _ship(self) -> None:
        """The state's files, as just written here, to the store's transfer area (store.put_transfer_file)."""
        for name in STATE_FILES:
            local = self.weights.directory / name
            if local.is_file():
                self.store.put_transfer_file(f"{self.name}/{name}", local)

    async def _fetched(self, client: EndpointClient, url: str) -> str:
        """Have a remote replica copy the shipped state to its own machine; the directory it reloads from there."""
        try:
            answer = await client.request("POST", "/collective_rpc", {"method": "fetch_from_store",
                                                                     "args": [self._shipped]})
        except ServingError as exc:
            raise PolicyServerError(
                f"policy server {url} ({self.name!r}) cannot read the policy state from the run's store at "
                f"{self._shipped}: {exc.detail}. A policy server on another node reads the store itself: give the "
                "run a store its node reaches (a shared filesystem path, or an s3:// URL with credentials in its "
                "environment), and start it with `rollout serve start BASE --live-policy` (its worker extension "
                "fetches the state)") from None
        return answer["results"][0]

    async def _probe_all(self, urls: list[str], probe: list[int], expected: list[float], *, reload: bool,
                         timings: dict[str, float]) -> list[float]:
        """Each replica reloaded (if `reload`), then scoring the probe; each replica's largest |difference| from
        `expected`. The trainer's side is computed before, not beside the reload: on 2 cores overlapping them was
        slower (bench/bench_weight_sync.py)."""
        async def timed(key: str, work):
            started = time.perf_counter()
            result = await work
            timings[key] = max(timings.get(key, 0.0), time.perf_counter() - started)
            return result

        clients = [EndpointClient(url, self.served_name, timeout_s=RELOAD_TIMEOUT_S) for url in urls]
        try:
            if reload:
                await asyncio.gather(*(timed("reload", self._reload(client, url))
                                       for client, url in zip(clients, urls)))
            served = await asyncio.gather(*(timed("score", self._score(client, url, probe))
                                            for client, url in zip(clients, urls)))
        finally:
            await asyncio.gather(*(client.aclose() for client in clients))
        return [float(np.max(np.abs(np.asarray(logprobs) - np.asarray(expected)))) for logprobs in served]

    async def _reload(self, client: EndpointClient, url: str) -> None:
        directory = await self._fetched(client, url) if self.remote else str(self.weights.directory)
        try:
            if self.adapter:
                await client.load_lora_adapter(self.served_name, directory)
            else:
                answer = await client.request("POST", "/collective_rpc", {
                    "method": "reload_policy_weights", "args": [directory]})
                self.reload_paths[url] = answer["results"][0]
        except ServingError as exc:
            raise self._request_failed(url, "weight reload failed", exc) from None

    async def _score(self, client: EndpointClient, url: str, probe: list[int]) -> list[float]:
        try:
            return await client.score(probe)
        except ServingError as exc:
            raise self._request_failed(url, "scoring the probe failed", exc) from None

    def _request_failed(self, url: str, what: str, exc: ServingError) -> PolicyServerError:
        """One line naming the replica; PolicyReplicaLost when it did not answer (it may have died)."""
        error = PolicyReplicaLost if isinstance(exc, ReplicaUnavailable) else PolicyServerError
        return error(f"policy server {url} ({self.name!r}): {what}: {exc.detail}")

    def close(self) -> None:
        """Close the pool and delete the weights directory and what was shipped (the deployment is stopped by its
        owner)."""
        asyncio.run(self.pool.aclose())
        self.weights.remove()
        if self.remote:
            self.store.remove_transfer(self.name)


def remote_deployment(base_urls: list[str], served_name: str | None = None) -> engine.Deployment:
    """Policy servers on other nodes, known by URL only (`policy_sampler.base_url`), as a deployment: the model
    name they serve (`served_name`, else the one their /v1/models lists) and no process of ours."""
    roots = [url.rstrip("/").removesuffix("/v1") for url in base_urls]
    if served_name is None:
        served_name = _served_name(roots[0])
    replicas = [engine.Replica(index=index, pid=0, port=urlsplit(root).port or 0, base_url=root, log="",
                               started_at="") for index, root in enumerate(roots)]
    return engine.Deployment(name=served_name, model=roots[0], model_dir="", runner="generate", max_model_len=0,
                             replicas=replicas, ready=True, live_policy=True)


def _served_name(root: str) -> str:
    try:
        # Its base alone: a LoRA policy server lists the adapter a run loaded on it beside its base, and the next
        # run (a rerun resuming) must still find the base's name.
        names = asyncio.run(base_model_names(root))
    except ServingError as exc:
        raise PolicyServerError(f"policy server {root} (algorithm.rl.policy_sampler.base_url): {exc.detail}") from None
    if len(names) != 1:
        raise PolicyServerError(f"policy server {root} serves {len(names)} models ({', '.join(names) or 'none'}): "
                                "name the policy's in algorithm.rl.policy_sampler.served_name")
    return names[0]
