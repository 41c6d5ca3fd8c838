"""The advantages stage: scored rollouts -> training samples, each env through its own algorithm."""

from __future__ import annotations

import asyncio

import pyarrow as pa

from rollout_lib.algo import Algorithm, build_algorithm
from rollout_lib.algo.stamping import (
    advantage_metrics,
    assign_advantages,
    score_for_shipping,
    stamp_training_samples,
)
from rollout_lib.config.rl import RlConfig


def env_algorithms(config: RlConfig) -> dict[str, Algorithm]:
    return {env.name: build_algorithm(env.algo) for env in config.settings.envs}


def training_samples(config: RlConfig, scored: pa.Table) -> tuple[pa.Table, dict]:
    """TRAINING_SAMPLES from scored rollouts: group-time advantages, stamping, then ship-time scoring."""
    algorithms = env_algorithms(config)
    advantages = assign_advantages(scored, algorithms)
    temperatures = {env.name: env.sampling.temperature for env in config.settings.envs}
    samples = stamp_training_samples(scored, advantages, algorithms, config.settings.max_seq_len, temperatures)
    samples = asyncio.run(score_for_shipping(samples, algorithms))
    return samples, advantage_metrics(samples)
