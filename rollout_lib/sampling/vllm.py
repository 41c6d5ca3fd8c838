"""The live policy sampled on a vLLM engine: the run's policy server (serving/policy_server.py), owned by the run's
ServedModels and reached through the stage's SamplingContext.

Before a stage samples, it calls `sync` (tasks/rl.py): the server is brought to the policy state the stage samples
from (`SamplingContext.policy_state`), reloaded in place from the trainer's in-memory weights and verified with the
probe (`probe_tolerance`, default 1e-3: serving/policy_server.py says why); a server that already holds that state
(same state id, same replica processes) is not reloaded. A probe beyond the tolerance fails the stage, naming the
replica's URL and the difference: nothing samples from unknown weights.

Sampling then goes through the replica pool as the frozen sampler's does: prompts sent as token ids (the policy's
chat template), one request per completion, seeded by (seed, sequence index). For a single-turn stage the
sequence index is `row * group_size + group index`, so each completion's seed is a function of (seed, prompt
row, group index) and the tokens do not depend on batching, request order or the replica that answered. The
rollouts' `sampling_logprobs` are the engine's (rollout's servers report processed logprobs: the distribution
each token was drawn from); they vary in the last bits with batch composition (../shared/notes/serving.md).

A replica that dies mid-stage: the pool fails the requests over to another replica; those no replica could answer
are sent again, with the same seeds, after the sampler restarted the dead replicas and reloaded (and checked) them.
One that dies during the hold (inside the reload or the probe: PolicyReplicaLost) is restarted the same way and the
hold done again. Both count against `max_recoveries`, restarts per stage; a replica that stopped answering but did
not die (hung), or one on another node (not rollout's to restart), fails the stage naming its URL.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import torch
from pydantic import Field, model_validator

from rollout_lib.adapters import is_adapted
from rollout_lib.sampling.base import Sampler, SamplerSettings, SamplingParams, stop_token_ids
from rollout_lib.serving.policy_server import (
    BF16_PROBE_TOLERANCE,
    DEFAULT_TOLERANCE,
    PolicyReplicaLost,
    PolicyServerSpec,
)
from rollout_lib.determinism import derived_seed
from rollout_lib.settings_base import GpuList, replica_gpus_problem

log = logging.getLogger(__name__)


class VllmSamplerSettings(SamplerSettings):
    type: Literal["vllm"] = "vllm"
    replicas: int = Field(1, ge=1)  # policy server replicas (the machine's cores are split between them)
    # Requests in flight from one stage: the engine batches what is in flight, so a step's whole group of samples
    # at once samples fastest (8 x 8 on SmolLM2 here, reloads included: 150.8 tokens/s at 64, 137.2 at 32).
    concurrency: int = Field(64, ge=1)
    timeout_s: float = Field(120.0, gt=0)  # per request; must cover queueing behind `concurrency` others
    max_attempts: int = Field(3, ge=1)  # one request, tried on distinct replicas
    # The engine's weights and activations: "bfloat16" samples ~1.7x faster on a CPU with AMX/AVX512-bf16 (and on
    # GPUs), from a distribution a little off the fp32 trainer's; the trainer's recomputed behaviour logprobs and
    # the behaviour/sampler_* metrics see the difference (docs/serving.md, "Engine precision").
    dtype: Literal["float32", "bfloat16"] = "float32"
    compile: bool = False  # torch.compile the engine's model (no --enforce-eager): slower start, faster steps
    # max |served - trainer| probe logprob after a reload; default 1e-3 in float32, 2.0 in bfloat16 (whose
    # rounding alone moved the probe's logprobs by up to 0.98 in a 25-step run: serving/policy_server.py)
    probe_tolerance: float | None = Field(None, gt=0)
    max_recoveries: int = Field(2, ge=0)  # restarts of dead replicas within one stage
    # A LoRA policy (algorithm.rl.adapter) on the engine: "lora" serves the base once and loads each step's adapter
    # in place (vLLM's LoRA: a few MB a step, the way on GPUs); "merged" folds the adapter into the base weights and
    # reloads them whole, as a full fine-tune's (sampling at the base model's speed where vLLM's LoRA kernels are
    # slow: ~6x on these CPUs, docs/serving.md "LoRA on the engine"). Ignored without an adapter.
    adapter_serving: Literal["lora", "merged"] = "lora"
    # Policy servers on other nodes, started there with `rollout serve start BASE --live-policy` and reached by URL
    # only: each state's weights (or adapter) are shipped through the run's store, which those servers read
    # themselves (serving/store_fetch.py), then reloaded and probed as a local server's. None: rollout starts the
    # policy server on this machine (`replicas` of them). `served_name`: the model they serve, if not the one
    # their /v1/models lists. Where the policy samples, never what: not in the identity.
    base_url: list[str] | None = Field(None, min_length=1)
    served_name: str | None = None
    # The GPUs of this node the policy server takes (docs/scale.md, "GPUs placed"), split into `replicas` equal
    # consecutive shares: replica j sees only its own (CUDA_VISIBLE_DEVICES). Disjoint from the trainer's
    # (hardware.gpus), checked at plan time. None: every replica sees every GPU, as before. Not in the identity.
    gpus: GpuList = Field(None, min_length=1)

    @model_validator(mode="after")
    def _gpus_shared_evenly(self) -> "VllmSamplerSettings":
        problem = replica_gpus_problem(self.gpus, self.replicas, remote=self.base_url is not None)
        if problem:
            raise ValueError(problem)
        return self

    def identity_settings(self) -> dict:
        # Replicas, concurrency, timeouts and the tolerance are resources or checks: they never decide which tokens
        # are sampled (seeds are per completion), so changing them reuses every finished step. The engine's
        # precision and kernels do: they enter when not the defaults (existing identities unchanged).
        chosen = {"dtype": self.dtype} if self.dtype != "float32" else {}
        if self.adapter_serving != "lora":  # the engine computes the adapter another way: other last bits
            chosen["adapter_serving"] = self.adapter_serving
        return {"type": self.type, **chosen, **({"compile": True} if self.compile else {})}

    def server_spec(self, base_model, model) -> PolicyServerSpec:
        """The run's policy server for these settings and the policy `model` (a LoRA one served as an adapter
        under `adapter_serving = "lora"`): the one place a PolicyServerSpec is built. Beyond engine.SERVER_FLAGS
        (float32, eager), the engine's dtype and kernels."""
        lora = is_adapted(model) and self.adapter_serving == "lora"
        return PolicyServerSpec(
            base_model, replicas=self.replicas, timeout_s=self.timeout_s, max_attempts=self.max_attempts,
            tolerance=self.tolerance, probe_dtype=torch.bfloat16 if self.dtype == "bfloat16" else torch.float32,
            extra_args=(*(["--dtype", self.dtype] if self.dtype != "float32" else []),
                        *(["--no-enforce-eager"] if self.compile else [])),
            adapter_rank=model.peft_config["default"].r if lora else None, remote_urls=tuple(self.base_url or ()),
            served_name=self.served_name, gpus=tuple(self.gpus or ()))

    @property
    def tolerance(self) -> float:
        if self.probe_tolerance is not None:
            return self.probe_tolerance
        return BF16_PROBE_TOLERANCE if self.dtype == "bfloat16" else DEFAULT_TOLERANCE


class VllmSampler(Sampler):
    type_name = "vllm"
    settings_class = VllmSamplerSettings
    streams_completions = True  # each request's completion, as it comes back
    bit_stable_logprobs = False  # ~1e-5 with batch composition (../shared/notes/serving.md)

    def __init__(self, settings: VllmSamplerSettings, model, tokenizer, context=None):
        super().__init__(settings, model, tokenizer, context)
        if self.context.served_models is None or self.context.base_model is None:
            raise ValueError('algorithm.rl.policy_sampler: type = "vllm" samples on the run\'s policy server, and this '
                             "stage was given none (SamplingContext.served_models and base_model)")
        if self.context.policy_state is None:
            raise ValueError('algorithm.rl.policy_sampler: type = "vllm" needs the policy state id it samples from '
                             "(SamplingContext.policy_state): the server is loaded and checked per state")
        self.server = self.context.served_models.policy_server(settings.server_spec(self.context.base_model, model))
        self.hold_reports: list = []  # serving.policy_server.HoldReport of every hold this sampler made (metrics, tests)
        self.held_state: str | None = None  # the state this sampler's last hold brought the server to
        self.recoveries = 0  # restarts of dead replicas so far in this stage (a sampler lives for one stage)

    def sync(self) -> None:
        """The stage's weight sync: the server brought to the stage's state (written from the trainer, reloaded,
        probed; nothing to do where it holds it already); a replica lost during the hold is restarted and the hold
        done again (`_restart_dead_replicas`)."""
        while True:
            try:
                self.hold_reports.append(self.server.hold(self.context.policy_state, self.model, self.tokenizer))
                break
            except PolicyReplicaLost as lost:
                self._restart_dead_replicas(lost, "a replica was lost during the hold")
        self.held_state = self.context.policy_state

    def _restart_dead_replicas(self, error: Exception, what: str) -> None:
        """A replica stopped answering (`error`): restart the dead ones (PolicyServer.recover); `error` itself when
        this stage's `max_recoveries` are spent or none had died (hung or overloaded, or on another node: a restart
        here would not help)."""
        if self.recoveries >= self.settings.max_recoveries:
            raise error
        restarted = self.server.recover()
        if not restarted:
            raise error
        self.recoveries += 1
        log.warning("policy server %s: %s (%s); restarted %s, reloading state %s", self.server.name, what, error,
                    ", ".join(restarted), self.context.policy_state)

    def generate(self, sequences: list[list[int]], params: SamplingParams, seed: int,
                 on_done=None) -> list[tuple[list[int], list[float]]]:
        from rollout_lib.serving.client import ReplicaUnavailable
        from rollout_lib.serving.pool import PoolUnavailable

        if self.held_state != self.context.policy_state:
            raise RuntimeError("VllmSampler.generate before sync(): the stage syncs the policy server's weights first "
                               "(tasks/rl.py)")
        stops = stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        seeds = [derived_seed("policy-engine", seed, index) for index in range(len(sequences))]
        results: list[tuple[list[int], list[float]] | None] = [None] * len(sequences)
        pending = list(range(len(sequences)))
        while True:
            outcomes = asyncio.run(self._generate_some(pending, sequences, params, seeds, stops, on_done))
            failed = []
            for index, outcome in zip(pending, outcomes):
                if isinstance(outcome, BaseException):
                    if not isinstance(outcome, (PoolUnavailable, ReplicaUnavailable)):
                        raise outcome
                    failed.append((index, outcome))
                else:
                    results[index] = (outcome.token_ids, outcome.logprobs)
            if not failed:
                return results  # type: ignore[return-value]
            self._restart_dead_replicas(failed[0][1], f"{len(failed)} of {len(sequences)} requests failed, sent again "
                                                      "after the reload")
            self.sync()
            pending = [index for index, _ in failed]

    async def _generate_some(self, indices: list[int], sequences: list[list[int]], params: SamplingParams,
                             seeds: list[int], stops: list[int], on_done=None) -> list:
        gate = asyncio.Semaphore(self.settings.concurrency)
        pool = self.server.pool

        async def one(index: int):
            async with gate:
                generation = await pool.generate(sequences[index], max_tokens=params.max_tokens,
                                                 temperature=params.temperature, top_p=params.top_p,
                                                 seed=seeds[index], stop_token_ids=stops)
            if on_done is not None:  # a streamed step scores it now, while the other requests sample
                on_done(index, (generation.token_ids, generation.logprobs))
            return generation

        return await asyncio.gather(*(one(index) for index in indices), return_exceptions=True)
