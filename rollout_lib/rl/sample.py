"""The sample stage: every env's rollouts of a step, seeded per (seed, step, env), from the env's sampler: the live
policy (the `policy_sampler` backend) or a frozen model (sampling/frozen.py, through a served pool)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from rollout_lib.config.rl import RlConfig
from rollout_lib.envs import build_interaction
from rollout_lib.envs.episodes import EpisodeError
from rollout_lib.rl.prompts import select_prompts
from rollout_lib.sampling import SAMPLERS
from rollout_lib.sampling.frozen import FrozenSampler
from rollout_lib.trainer.determinism import derived_seed


def env_locator(index: int) -> str:
    return f"algorithm.rl.envs[{index}].sampler.source"


def build_samplers(config: RlConfig, model, tokenizer, frozen_models=None) -> dict:
    """The sampler of every env, by env name; envs on the live policy share one. `frozen_models`
    (serving.frozen.FrozenModels) connects the frozen ones."""
    samplers, policy_sampler = {}, None
    for index, env in enumerate(config.settings.envs):
        frozen = env.sampler.frozen
        if frozen is None:
            if policy_sampler is None:
                settings = config.settings.policy_sampler
                policy_sampler = SAMPLERS[settings.type](settings, model, tokenizer)
            samplers[env.name] = policy_sampler
        else:
            if frozen_models is None:
                raise ValueError(f"{env_locator(index)}: a frozen model needs the run's FrozenModels")
            pool = frozen_models.pool(frozen, tokenizer=tokenizer, where=env_locator(index))
            samplers[env.name] = FrozenSampler(pool, tokenizer, frozen.concurrency)
    return samplers


def sample_rollouts(config: RlConfig, samplers: dict, prompt_tables: dict[str, pa.Table],
                    step: int) -> tuple[pa.Table, dict]:
    """ROLLOUTS of every env for `step` (rewards null), and sampling metrics."""
    parts = []
    for env_index, env in enumerate(config.settings.envs):
        chosen = select_prompts(prompt_tables[env.name], env.prompts_per_step, seed=config.run.seed, step=step,
                                env_index=env_index)
        interaction = build_interaction(env.interaction) if env.interaction is not None else None
        try:
            parts.append(samplers[env.name].sample(chosen, env.sampling,
                                                   derived_seed(config.run.seed, "sample", step, env_index),
                                                   interaction=interaction, context_limit=config.settings.max_seq_len))
        except EpisodeError as exc:
            raise EpisodeError(f"algorithm.rl.envs[{env_index}].interaction: {exc}") from exc
    rollouts = pa.concat_tables(parts)
    lengths = [len(ids) for ids in rollouts.column("completion_ids").to_pylist()]
    max_tokens = {env.name: env.sampling.max_tokens for env in config.settings.envs}
    episodes = [json.loads(text) if text else None for text in rollouts.column("episode").to_pylist()]
    # A single-turn completion is cut when it fills max_tokens; an episode, when a model turn ends without a stop.
    truncated = sum(length >= max_tokens[env] if episode is None else episode["end"] == "truncated"
                    for length, env, episode in zip(lengths, rollouts.column("env").to_pylist(), episodes))
    metrics = {
        "rollouts": rollouts.num_rows,
        "completion_len_mean": float(np.mean(lengths)) if lengths else 0.0,
        "truncated_fraction": truncated / len(lengths) if lengths else 0.0,
    }
    multi_turn = [episode for episode in episodes if episode is not None]
    if multi_turn:
        env_tokens = sum(turn["length"] for turns in rollouts.column("completion_turns").to_pylist()
                         for turn in turns or () if not turn["sampled"])
        metrics["turns_mean"] = float(np.mean([episode["turns"] for episode in multi_turn]))
        metrics["env_token_fraction"] = env_tokens / max(sum(lengths), 1)
    return rollouts, metrics
