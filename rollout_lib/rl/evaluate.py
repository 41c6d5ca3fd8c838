"""Held-out evaluation of the live policy: every prompt of an env's `eval.source`, sampled (greedy by default, one
completion per prompt) and scored by the env's rewards or the evaluation's own (a true metric beside a learned
reward model). Nothing here trains: the metrics are what a user plots to see whether the policy got better at what
they care about, on prompts it never trained on.

Metrics, per env: `eval/<env>/reward_mean`, `eval/<env>/pass_rate` (share of prompts whose reward is at least
`PASS`, for 0/1 rewards the accuracy), `eval/<env>/<function>` (each reward function's unweighted mean when there
are several), `eval/<env>/missing_rewards`, `eval/<env>/completion_len_mean`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa

from rollout_lib.config.rl import EnvSettings, RlConfig
from rollout_lib.reward.loops import RewardLoops
from rollout_lib.rl.prompts import load_prompts
from rollout_lib.rl.sample import env_interaction
from rollout_lib.rl.score import env_reward_loop, function_means
from rollout_lib.reward.tables import apply_rewards, reward_inputs
from rollout_lib.determinism import derived_seed

PASS = 1.0 - 1e-9  # a reward of 1 (up to rounding) passes


def eval_env(env: EnvSettings) -> EnvSettings:
    """The env as its evaluation sees it: the held-out source and the evaluation's sampling."""
    return env.model_copy(update={"source": env.eval.source, "sampling": env.eval_sampling(), "prompts_per_step": 1})


def load_eval_prompts(env: EnvSettings) -> pa.Table:
    """The evaluation's PROMPTS: its source's (a verifiers environment's eval_dataset too), the first `max_prompts`
    of them when set."""
    table = load_prompts(eval_env(env), f"env {env.name!r}: eval.source")
    return table.slice(0, env.eval.max_prompts) if env.eval.max_prompts else table


@dataclass(frozen=True)
class HeldOut:
    """One evaluation: its metrics, and what they were computed from, for `rollout runs samples --eval`."""

    metrics: dict[str, float | int | None]
    scored: pa.Table  # the held-out rollouts with their rewards (wire.ROLLOUTS)
    results: list  # each row's RewardResult: the total, why it is missing, each function's reward


def evaluate_env(config: RlConfig, env: EnvSettings, prompts: pa.Table, sampler,
                 reward_loops: RewardLoops) -> HeldOut:
    """Sample every held-out prompt with `sampler` (the policy's, at the state being evaluated) and score it."""
    index = [e.name for e in config.settings.envs].index(env.name)
    target = eval_env(env)
    interaction = env_interaction(config, index)
    # The same seed at every step (common random numbers): the curve moves with the policy, not with the draws.
    rollouts = sampler.sample(prompts, target.sampling, derived_seed(config.run.seed, "eval", index),
                              interaction=interaction, context_limit=config.settings.max_seq_len)
    results = env_reward_loop(reward_loops, config, env, held_out=True).score(reward_inputs(rollouts, prompts))
    reward_loops.take_reward_model_metrics()  # the evaluation's reward-model counts are not the next step's
    lengths = [len(ids) for ids in rollouts.column("completion_ids").to_pylist()]
    return HeldOut(held_out_metrics(env.name, results, lengths), apply_rewards(rollouts, results), results)


def held_out_metrics(env_name: str, results: list, lengths: list[int]) -> dict[str, float | int | None]:
    present = [r.reward for r in results if r.reward is not None]
    prefix = f"eval/{env_name}"
    metrics: dict[str, float | int | None] = {
        f"{prefix}/reward_mean": math.fsum(present) / len(present) if present else None,
        f"{prefix}/pass_rate": sum(r >= PASS for r in present) / len(results) if results else None,
        f"{prefix}/missing_rewards": len(results) - len(present),
        f"{prefix}/completion_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
    }
    metrics.update({f"eval/{env_name}/{name.removeprefix('reward/')}": value
                    for name, value in function_means(None, results).items()})
    return metrics
