"""The score stage: rewards for every rollout of a step, each env with its own reward functions, concurrently."""

from __future__ import annotations

import asyncio
import math

import pyarrow as pa

from rollout_lib.algo.stamping import group_rows
from rollout_lib.config.rl import EnvSettings, RlConfig, env_locator
from rollout_lib.hardware import hardware_of_config
from rollout_lib.reward.loop import (
    RewardLoop,
    RewardResult,
    raise_if_all_missing,
    raise_if_too_many_missing,
    reward_metrics,
)
from rollout_lib.reward.loops import RewardLoops
from rollout_lib.reward.tables import apply_rewards, reward_inputs


def run_reward_loops(config: RlConfig, served_models=None) -> RewardLoops:
    """The run's RewardLoops (reward/loops.py; close it, or `with run_reward_loops(...) as loops:`):
    `served_models` (serving.served.ServedModels) reaches judges and reward models served with vLLM."""
    return RewardLoops(config.settings.reward_loop, served_models, hardware=hardware_of_config(config))


def env_reward_loop(loops: RewardLoops, config: RlConfig, env: EnvSettings, *, held_out: bool = False) -> RewardLoop:
    """The loop of an env's rewards, or of its held-out evaluation's when that names its own (`eval.rewards`)."""
    index = [e.name for e in config.settings.envs].index(env.name)
    rubric = env_rubric(env)
    if held_out and env.eval.rewards:
        return loops.for_rewards(env.eval.rewards, env_locator(index, "eval.rewards"), rubric)
    return loops.for_rewards(env.rewards, env_locator(index, "rewards"), rubric)


def env_rubric(env: EnvSettings):
    """For an env running a verifiers environment: (key, weight -> its rubric's reward functions), what a
    `{ rubric = "verifiers" }` reward scores with (envs/verifiers_rubric.py); None for any other env."""
    if env.interaction is None or env.interaction.type != "verifiers":
        return None
    from rollout_lib.envs.verifiers_rubric import rubric_functions

    settings = env.interaction
    return settings.model_dump_json(), lambda weight: rubric_functions(settings, weight)


def score_rollouts(config: RlConfig, rollouts: pa.Table, prompt_tables: dict[str, pa.Table],
                   loops: RewardLoops) -> tuple[pa.Table, dict]:
    """Rewards (null + error when missing) for every rollout, each env with its own functions, all concurrently.

    Raises AllRewardsFailedError when not a single rollout of the step got a reward, and TooManyRewardsMissingError
    (the circuit breaker) when more than `reward_loop.max_missing_fraction` of them did not. With reward models,
    the metrics count what their inputs lost (`reward_model/prompt_truncated`, `reward_model/missing_too_long`,
    ...)."""
    return scored_rollouts(config, rollouts, *reward_results(config, rollouts, prompt_tables, loops))


def reward_results(config: RlConfig, rollouts: pa.Table, prompt_tables: dict[str, pa.Table],
                   loops: RewardLoops) -> tuple[list[RewardResult], dict[str, int]]:
    """Each rollout's RewardResult, row for row, and the reward models' counts (`reward_model/<count>`, none
    without one). Every result depends on its own row (a group function's on its group) alone: scoring the rows in
    chunks of whole groups (chunk_rows) and putting the results back by row (merged_results) gives the same list
    (the fan-out of a dask or ray task runner)."""
    envs = rollouts.column("env").to_pylist()
    rows_by_env = {env.name: [i for i, name in enumerate(envs) if name == env.name] for env in config.settings.envs}
    # outside the event loop: may connect a judge
    env_loops = [env_reward_loop(loops, config, env) for env in config.settings.envs]

    async def score_all():  # typed row indices: a chunk may hold no rows of an env
        return await asyncio.gather(*(
            loop.ascore(reward_inputs(rollouts.take(pa.array(rows_by_env[env.name], pa.int64())),
                                      prompt_tables[env.name]))
            for env, loop in zip(config.settings.envs, env_loops)
        ))

    results: list = [None] * rollouts.num_rows
    for env, env_results in zip(config.settings.envs, asyncio.run(score_all())):
        for row, result in zip(rows_by_env[env.name], env_results):
            results[row] = result
    return results, loops.take_reward_model_metrics()


def chunk_rows(rollouts: pa.Table, chunk: int, chunks: int) -> list[int]:
    """The rows, in row order, of chunk `chunk` of `chunks` of a step's rollouts: whole (env, example_id) groups, so
    a group reward function sees its group in one chunk; the groups, in order of first appearance, cut into runs
    whose counts differ by one at most (a chunk may hold none). One chunk: every row."""
    groups = list(group_rows(rollouts).values())
    first, stop = len(groups) * chunk // chunks, len(groups) * (chunk + 1) // chunks
    return sorted(row for group in groups[first:stop] for row in group)


def merged_results(rollouts: pa.Table, chunk_results: list[list[RewardResult]]) -> list[RewardResult]:
    """The step's RewardResults in row order from each chunk's (chunk_rows of len(chunk_results) chunks)."""
    results: list = [None] * rollouts.num_rows
    for chunk, chunk_result in enumerate(chunk_results):
        rows = chunk_rows(rollouts, chunk, len(chunk_results))
        if len(rows) != len(chunk_result):
            raise ValueError(f"chunk {chunk} of {len(chunk_results)} has {len(chunk_result)} rewards for its "
                             f"{len(rows)} rows")
        for row, result in zip(rows, chunk_result):
            results[row] = result
    return results


def scored_rollouts(config: RlConfig, rollouts: pa.Table, results: list[RewardResult],
                    reward_model_metrics: dict[str, int]) -> tuple[pa.Table, dict]:
    """The rollouts with their rewards, and the step's reward metrics; raises when too many rewards are missing
    (score_rollouts)."""
    envs = rollouts.column("env").to_pylist()
    results_by_env = {env.name: [result for result, name in zip(results, envs) if name == env.name]
                      for env in config.settings.envs}
    metrics: dict = dict(reward_model_metrics)
    for env_name, env_results in results_by_env.items():
        if len(results_by_env) > 1:
            env_metrics = reward_metrics(env_results)
            metrics[f"reward_mean/{env_name}"] = env_metrics["reward_mean"]
            metrics[f"missing_rewards/{env_name}"] = env_metrics["n_missing"]
        metrics.update(function_means(env_name if len(results_by_env) > 1 else None, env_results))
    raise_if_all_missing(results)
    raise_if_too_many_missing(results, config.settings.reward_loop.max_missing_fraction,
                              setting="algorithm.rl.reward_loop.max_missing_fraction",
                              by_env=results_by_env if len(results_by_env) > 1 else None)
    overall = reward_metrics(results)
    errors = sorted({r.error for r in results if r.error})
    metrics.update({"reward_mean": overall["reward_mean"], "reward_std": overall["reward_std"],
                    "missing_rewards": overall["n_missing"], "reward_errors": errors[:3]})
    return apply_rewards(rollouts, results), metrics


def results_json(results: list[RewardResult]) -> list[dict]:
    """RewardResults as JSON (a chunk's, in the store): floats round-trip exactly, and per_function stays in
    function order (pairs: the store's JSON sorts keys)."""
    return [{"reward": r.reward, "error": r.error, "per_function": list(r.per_function.items()),
             **({"extra": list(r.extra.items())} if r.extra else {})} for r in results]


def results_from_json(rows: list[dict]) -> list[RewardResult]:
    return [RewardResult(row["reward"], row["error"], dict(row["per_function"]), dict(row.get("extra", ())))
            for row in rows]


def rewards_json(results: list[RewardResult], reward_model_metrics: dict[str, int]) -> dict:
    """Rewards of some rows, in row order, and the reward models' counts, as stored between a stage that scored
    them (a chunk of a dask or ray fan-out, a streamed sample stage) and the one that puts them into the table:
    pairs, not an object, for the counts, since the store's JSON sorts keys and the metrics keep their order."""
    return {"results": results_json(results), "reward_model_metrics": list(reward_model_metrics.items())}


def function_means(env_name: str | None, results: list) -> dict[str, float | None]:
    """`reward/<function>` (`reward/<env>/<function>` with several envs): each reward function's unweighted mean
    over the rollouts it scored, for envs with more than one (a weight-0 function is watched, not trained on); and
    `reward/<function>/<key>`: the mean of each number a function's reward dict carried beside its score (verl's
    reward_extra_info), over the rollouts that carried it."""
    prefix = f"reward/{env_name}/" if env_name else "reward/"
    means = {}
    names = list(results[0].per_function) if results else []
    if len(names) >= 2:
        for name in names:
            scores = [r.per_function[name] for r in results if r.per_function.get(name) is not None]
            means[prefix + name] = math.fsum(scores) / len(scores) if scores else None
    extra_keys = sorted({key for r in results for key in getattr(r, "extra", {})})
    for key in extra_keys:
        values = [r.extra[key] for r in results if key in r.extra]
        means[prefix + key] = math.fsum(values) / len(values)
    return means
