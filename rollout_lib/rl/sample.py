"""The sample stage: every env's rollouts of a step from the live policy, seeded per (seed, step, env)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from rollout_lib.config.rl import RlConfig
from rollout_lib.rl.prompts import select_prompts
from rollout_lib.sampling import SAMPLERS, Sampler
from rollout_lib.trainer.determinism import derived_seed


def build_sampler(config: RlConfig, model, tokenizer) -> Sampler:
    settings = config.settings.sampler
    return SAMPLERS[settings.type](settings, model, tokenizer)


def sample_rollouts(config: RlConfig, sampler: Sampler, prompt_tables: dict[str, pa.Table],
                    step: int) -> tuple[pa.Table, dict]:
    """ROLLOUTS of every env for `step` (rewards null), and sampling metrics."""
    parts = []
    for env_index, env in enumerate(config.settings.envs):
        chosen = select_prompts(prompt_tables[env.name], env.prompts_per_step, seed=config.run.seed, step=step,
                                env_index=env_index)
        parts.append(sampler.sample(chosen, env.sampling, derived_seed(config.run.seed, "sample", step, env_index)))
    rollouts = pa.concat_tables(parts)
    lengths = [len(ids) for ids in rollouts.column("completion_ids").to_pylist()]
    max_tokens = {env.name: env.sampling.max_tokens for env in config.settings.envs}
    truncated = sum(length >= max_tokens[env] for length, env in zip(lengths, rollouts.column("env").to_pylist()))
    return rollouts, {
        "rollouts": rollouts.num_rows,
        "completion_len_mean": float(np.mean(lengths)) if lengths else 0.0,
        "truncated_fraction": truncated / len(lengths) if lengths else 0.0,
    }
