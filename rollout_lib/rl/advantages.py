"""The advantages stage: scored rollouts -> training samples, each env through its own algorithm."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.compute as pc

from rollout_lib.algo import ALGORITHMS, Algorithm, AlgorithmResources, build_algorithm
from rollout_lib.algo.stamping import (
    advantage_metrics,
    assign_advantages,
    score_for_shipping,
    stamp_training_samples,
)
from rollout_lib.config.rl import RlConfig, env_locator
from rollout_lib.rl.behaviour import mark_training_forward, recompute_behaviour_logprobs
from rollout_lib.model.chat import use_chat_template
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.wire import SAMPLER_LOGPROBS


def algorithm_resources(config: RlConfig, served_models=None, prompts=None, policy=None) -> AlgorithmResources:
    """The run's resources for its envs' algorithms; the policy tokenizer is loaded only when one requires it.
    `prompts`: env -> PROMPTS table; `policy`: a PolicyReference (both only read by algorithms that need them)."""
    required = set().union(*(ALGORITHMS[env.algo.type].requires for env in config.settings.envs))
    tokenizer = (use_chat_template(load_tokenizer(resolve_model(config.settings.base_model)),
                                   config.settings.chat_template) if "tokenizer" in required else None)
    return AlgorithmResources(tokenizer=tokenizer, served_models=served_models, prompts=prompts, policy=policy)


class PolicyReference:
    """The policy at the weights a step sampled from, for algorithms whose reference is the policy itself: its
    model is rebuilt (or taken from the resident trainer) only when first asked for; `initial_model()` is the
    frozen base model, loaded once."""

    def __init__(self, load_policy, base_model, state_id: str | None = None):
        self._load_policy = load_policy  # () -> the policy at the sampled state (rl.policy.sampling_policy)
        self._base_model = base_model
        self._initial = None
        self.state_id = state_id  # the sampled state's id, as the rollouts' `sampled_from` names it

    @property
    def model(self):
        return self._load_policy().model

    def initial_model(self):
        if self._initial is None:
            from rollout_lib.model.loading import load_causal_lm

            self._initial = load_causal_lm(resolve_model(self._base_model))
        return self._initial


def env_algorithms(config: RlConfig, resources: AlgorithmResources | None = None) -> dict[str, Algorithm]:
    resources = resources if resources is not None else algorithm_resources(config)
    return {env.name: build_algorithm(env.algo, resources, where=env_locator(index, "algo"))
            for index, env in enumerate(config.settings.envs)}


def training_samples(config: RlConfig, scored: pa.Table, resources: AlgorithmResources | None = None,
                     precomputed_behaviour: pa.Table | None = None) -> tuple[pa.Table, dict]:
    """TRAINING_SAMPLES from scored rollouts: group-time advantages, stamping, then ship-time scoring.

    `resources`: what the envs' algorithms are built with (default: the policy tokenizer if one needs it, and
    no frozen models). `precomputed_behaviour`: the behaviour logprobs the sample stage computed
    (rl/behaviour_stream.py, wire.BEHAVIOUR_LOGPROBS), adopted by the trainer's recompute."""
    algorithms = env_algorithms(config, resources)
    advantages = assign_advantages(scored, algorithms)
    temperatures = {env.name: env.sampling.temperature for env in config.settings.envs}
    # A mismatch correction reweights against the sampler: its report stays on the wire beside the trainer's.
    keep_sampler = config.settings.loss.correction.active
    samples = stamp_training_samples(scored, advantages, algorithms, config.settings.max_seq_len, temperatures,
                                     keep_sampler=keep_sampler)
    if keep_sampler and config.settings.partial_rollouts is not None:
        _check_partial_sampler_stream(samples)
    behaviour = {}
    source = config.settings.behaviour_logprobs_source
    if source != "sampler":
        policy = resources.policy if resources is not None else None
        if policy is None or policy.state_id is None:
            raise ValueError(f"algorithm.rl.behaviour_logprobs: {source!r} needs the state the rollouts were "
                             "sampled from, and the advantages stage was given none (AlgorithmResources.policy)")
        if source == "trainer":
            samples, behaviour = recompute_behaviour_logprobs(samples, scored, lambda: policy.model, policy.state_id,
                                                              precomputed=precomputed_behaviour,
                                                              keep_sampler=keep_sampler)
        else:  # "training_forward": the sampled state is the trained one (k = 0); nothing to run here
            samples, behaviour = mark_training_forward(samples, scored, policy.state_id, keep_sampler=keep_sampler)
    samples = asyncio.run(score_for_shipping(samples, algorithms))
    return samples, {**advantage_metrics(samples), **behaviour}


def _check_partial_sampler_stream(samples: pa.Table) -> None:
    """Under partial rollouts every stage scores its tokens when a correction is set (rl/partial.py); a sample
    without those scores would be weighed against this step's forward, folding the policy's drift into w."""
    missing = samples.column(SAMPLER_LOGPROBS).null_count
    if missing:
        first = samples.filter(pc.is_null(samples.column(SAMPLER_LOGPROBS))).column("sample_id")[0].as_py()
        raise ValueError(f"loss.correction with partial_rollouts: {missing} rollouts (first {first!r}) carry no "
                         "trainer logprobs (ROLLOUTS behaviour_logprobs), which their sample stages compute "
                         "when a correction is set")
