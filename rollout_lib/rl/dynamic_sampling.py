"""DAPO dynamic sampling (envs with `dynamic_sampling`): a group whose rewards are all equal gives every sample
advantage 0 under a group-relative algorithm, so it is dropped and replaced by the group of a freshly drawn prompt,
sampled and scored like the step's own, for up to `max_rounds` rounds; then the step trains on the groups it kept
(`dynamic_sampling/short_by` says how many a full batch lacks).

Resume-identical: round r's prompts are a seeded draw (derived_seed(seed, "dynamic-sampling", step, env, r)) among
the env's prompts the step has not drawn yet, and its rollouts are seeded per (step, env, r), so the step's table is
a function of its inputs, as the step's first draw is. A step where no group of any env kept its signal trains on
its first round as it was (zero advantages: the step exists, it moves nothing but the KL terms).

The rounds are steps of a chain: `next_replacements` draws round r's prompts from rounds 0..r-1 (their rows and
rewards), `kept_rows` keeps the groups with signal once no round is left. A train-rl run runs each round as task
runs of its own, cached on the ids of the rounds before (flows/rl_rounds.py), so a kill inside round r reruns from
round r.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rollout_lib.config.rl import RlConfig
from rollout_lib.determinism import derived_seed
from rollout_lib.reward.loop import RewardResult

Group = tuple[str, str]  # (env, example_id)


@dataclass(frozen=True)
class Round:
    """One round's rollouts and their rewards, row for row."""

    rollouts: pa.Table
    results: list[RewardResult]


def resamples(config: RlConfig) -> bool:
    """Whether any env of the run replaces its uniform groups (`dynamic_sampling`)."""
    return any(env.dynamic_sampling is not None for env in config.settings.envs)


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


def next_replacements(config: RlConfig, prompt_tables: dict[str, pa.Table], step: int,
                      rounds: list[Round]) -> dict[str, pa.Table]:
    """The PROMPTS, by env, of the step's next round (round index `len(rounds)`), given its `rounds` so far (the
    first draw first): for each env with `dynamic_sampling` still short of `prompts_per_step` kept groups and rounds
    left, that many prompts it has not drawn; empty when the step's rounds are over. A function of the rounds' rows
    and rewards alone, so a rerun (or a round run by another process) draws the same."""
    settings = _resampled_envs(config)
    round_index = len(rounds)
    drawn, _, kept = _tally(rounds, settings)
    wanted = {name: env.prompts_per_step - kept[name] for name, (_, env) in settings.items()
              if kept[name] < env.prompts_per_step and round_index <= env.dynamic_sampling.max_rounds}
    chosen = {name: replacement_prompts(prompt_tables[name], drawn[name], count, seed=config.run.seed, step=step,
                                        env_index=settings[name][0], round_index=round_index)
              for name, count in wanted.items()}
    return {name: table for name, table in chosen.items() if table.num_rows}


def kept_rows(config: RlConfig, rounds: list[Round]) -> tuple[Round, dict]:
    """The step's kept rows (every round's groups that carry a signal, round by round, in row order) and the
    `dynamic_sampling/*` metrics: rounds run, groups dropped (every round), groups kept, groups a full batch lacks.
    None kept: the first round as it was."""
    settings = _resampled_envs(config)
    _, dropped, kept = _tally(rounds, settings)
    metrics = {"dynamic_sampling/rounds": len(rounds) - 1, "dynamic_sampling/dropped_groups": len(dropped),
               "dynamic_sampling/kept_groups": sum(kept.values()),
               "dynamic_sampling/short_by": sum(max(env.prompts_per_step - kept[name], 0)
                                                for name, (_, env) in settings.items())}
    tables, results = [], []
    for part in rounds:
        rows = [row for row, group in enumerate(_groups_of(part.rollouts)) if group not in dropped]
        tables.append(part.rollouts.take(pa.array(rows, pa.int64())))
        results.extend(part.results[row] for row in rows)
    if not results:  # nothing kept its signal: train the first round as it was, so the step exists
        return rounds[0], metrics
    return Round(pa.concat_tables(tables), results), metrics


def _resampled_envs(config: RlConfig) -> dict:
    """name -> (env index, env settings) of the envs with `dynamic_sampling`."""
    return {env.name: (index, env) for index, env in enumerate(config.settings.envs)
            if env.dynamic_sampling is not None}


def _groups_of(rollouts: pa.Table) -> list[Group]:
    return list(zip(rollouts.column("env").to_pylist(), rollouts.column("example_id").to_pylist()))


def _tally(rounds: list[Round], settings: dict) -> tuple[dict[str, set[str]], set[Group], dict[str, int]]:
    """Per env with `dynamic_sampling`: the example ids its rounds drew; the groups without signal (every round);
    and per env how many of its drawn groups kept a signal."""
    drawn: dict[str, set[str]] = {name: set() for name in settings}
    for part in rounds:
        for env, example_id in _groups_of(part.rollouts):
            if env in drawn:
                drawn[env].add(example_id)
    dropped = set().union(*(uniform_groups(part.rollouts, part.results, set(settings)) for part in rounds))
    return drawn, dropped, {name: len(drawn[name]) - sum(env == name for env, _ in dropped) for name in settings}
