"""DAPO dynamic sampling (envs with `dynamic_sampling`): a group whose rewards are all equal gives every sample
advantage 0 under a group-relative algorithm, so it is dropped and replaced by the group of a freshly drawn prompt,
sampled and scored like the step's own, for up to `max_rounds` rounds; then the step trains on the groups it kept
(`dynamic_sampling/short_by` says how many a full batch lacks).

Resume-identical: round r's prompts are a seeded draw (derived_seed(seed, "dynamic-sampling", step, env, r)) among
the env's prompts the step has not drawn yet, and its rollouts are seeded per (step, env, r), so the step's table is
a function of its inputs, as the step's first draw is. A step where no group of any env kept its signal trains on
its first round as it was (zero advantages: the step exists, it moves nothing but the KL terms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa

from rollout_lib.config.rl import RlConfig
from rollout_lib.determinism import derived_seed
from rollout_lib.reward.loop import RewardResult
from rollout_lib.reward.loops import RewardLoops
from rollout_lib.rl.sample import rollout_metrics
from rollout_lib.rl.streamed import StreamedStep, sample_and_score

Group = tuple[str, str]  # (env, example_id)


@dataclass(frozen=True)
class Round:
    """One round's rollouts and their rewards, row for row."""

    rollouts: pa.Table
    results: list[RewardResult]


def uniform_groups(rollouts: pa.Table, results: list[RewardResult], envs: set[str]) -> set[Group]:
    """The groups of `envs` whose present rewards are all equal (none present included): no advantage signal."""
    rewards: dict[Group, set] = {}
    for env, example_id, result in zip(rollouts.column("env").to_pylist(), rollouts.column("example_id").to_pylist(),
                                       results):
        if env in envs:
            present = rewards.setdefault((env, example_id), set())
            if result.reward is not None:
                present.add(result.reward)
    return {group for group, present in rewards.items() if len(present) <= 1}


def replacement_prompts(prompts: pa.Table, drawn: set[str], count: int, *, seed: int, step: int, env_index: int,
                        round_index: int) -> pa.Table:
    """Up to `count` PROMPTS rows the step has not drawn (`drawn`: example ids), drawn at random for this
    (seed, step, env, round); fewer when the env has no more."""
    fresh = [row for row, example_id in enumerate(prompts.column("example_id").to_pylist()) if example_id not in drawn]
    rng = np.random.default_rng(derived_seed(seed, "dynamic-sampling", step, env_index, round_index))
    picked = rng.choice(len(fresh), size=min(count, len(fresh)), replace=False).tolist()
    return prompts.take(pa.array([fresh[i] for i in picked], pa.int64()))


def resampled(config: RlConfig, prompt_tables: dict[str, pa.Table], step: int, first: Round,
              sample_round: Callable[[dict[str, pa.Table], int], Round]) -> tuple[Round, dict]:
    """The step's kept rows, from its `first` round and as many replacement rounds (`sample_round(prompts by env,
    round index)`, round index from 1) as its envs' `dynamic_sampling` allow, and the `dynamic_sampling/*`
    metrics: rounds run, groups dropped (every round), groups kept, groups a full batch lacks."""
    settings = {env.name: (index, env) for index, env in enumerate(config.settings.envs)
                if env.dynamic_sampling is not None}
    rounds, dropped = [first], uniform_groups(first.rollouts, first.results, set(settings))
    drawn = {name: set() for name in settings}
    for env, example_id in zip(first.rollouts.column("env").to_pylist(),
                               first.rollouts.column("example_id").to_pylist()):
        if env in drawn:
            drawn[env].add(example_id)
    kept = {name: len(drawn[name]) - sum(env == name for env, _ in dropped) for name in settings}
    round_index = 0
    while True:
        round_index += 1
        wanted = {name: env.prompts_per_step - kept[name] for name, (_, env) in settings.items()
                  if kept[name] < env.prompts_per_step and round_index <= env.dynamic_sampling.max_rounds}
        chosen = {name: replacement_prompts(prompt_tables[name], drawn[name], count, seed=config.run.seed,
                                            step=step, env_index=settings[name][0], round_index=round_index)
                  for name, count in wanted.items()}
        chosen = {name: table for name, table in chosen.items() if table.num_rows}
        if not chosen:
            break
        extra = sample_round(chosen, round_index)
        uniform = uniform_groups(extra.rollouts, extra.results, set(chosen))
        for name, table in chosen.items():
            drawn[name].update(table.column("example_id").to_pylist())
            kept[name] += table.num_rows - sum(env == name for env, _ in uniform)
        rounds.append(extra)
        dropped |= uniform
    metrics = {"dynamic_sampling/rounds": len(rounds) - 1, "dynamic_sampling/dropped_groups": len(dropped),
               "dynamic_sampling/kept_groups": sum(kept.values()),
               "dynamic_sampling/short_by": sum(max(env.prompts_per_step - kept[name], 0)
                                                for name, (_, env) in settings.items())}
    tables, results = [], []
    for part in rounds:
        rows = [row for row, group in enumerate(zip(part.rollouts.column("env").to_pylist(),
                                                    part.rollouts.column("example_id").to_pylist()))
                if group not in dropped]
        tables.append(part.rollouts.take(pa.array(rows, pa.int64())))
        results.extend(part.results[row] for row in rows)
    if not results:  # nothing kept its signal: train the first round as it was, so the step exists
        return first, metrics
    return Round(pa.concat_tables(tables), results), metrics


def sample_and_score_resampled(config: RlConfig, samplers: dict, prompt_tables: dict[str, pa.Table], step: int,
                               loops: RewardLoops, curriculum_state: dict | None = None, policy_model=None,
                               policy_state: str | None = None) -> StreamedStep:
    """streamed.sample_and_score with dynamic sampling: every round streamed and scored as the first. The
    behaviour logprobs are left to the advantages stage (they would cover rows the step drops), which computes
    the same values."""
    del policy_model, policy_state  # the behaviour stream is off here (docstring)
    first = sample_and_score(config, samplers, prompt_tables, step, loops, curriculum_state)
    steps = [first]

    def sample_round(chosen: dict[str, pa.Table], round_index: int) -> Round:
        steps.append(sample_and_score(config, samplers, prompt_tables, step, loops, replacements=chosen,
                                      round_index=round_index))
        return Round(steps[-1].rollouts, steps[-1].results)

    kept, metrics = resampled(config, prompt_tables, step, Round(first.rollouts, first.results), sample_round)
    reward_model_metrics: dict[str, int] = {}
    for part in steps:
        for name, count in part.reward_model_metrics.items():
            reward_model_metrics[name] = reward_model_metrics.get(name, 0) + count
    curriculum = {name: value for name, value in first.sample_metrics.items() if name.startswith("curriculum/")}
    return StreamedStep(kept.rollouts, {**rollout_metrics(config, kept.rollouts), **curriculum, **metrics},
                        kept.results, reward_model_metrics, steps[-1].sampled_at, steps[-1].scored_at)
