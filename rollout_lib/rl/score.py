"""The score stage: rewards for every rollout of a step, each env with its own reward functions, concurrently."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import blake3
import pyarrow as pa

from rollout_lib.config.rl import (
    EnvSettings,
    JudgeSettings,
    RewardFunctionSettings,
    RewardModelSettings,
    RlConfig,
    env_locator,
)
from rollout_lib.reward.functions import resolve_reward_function
from rollout_lib.reward.judge import JudgeClient, LlmJudge, WithJudge
from rollout_lib.reward.loop import (
    RewardLoop,
    RewardResult,
    is_async_callable,
    raise_if_all_missing,
    raise_if_too_many_missing,
    reward_metrics,
)
from rollout_lib.reward.reward_model import COUNTS, RewardModelScorer, ServedRewardModelScorer, load_scorer
from rollout_lib.reward.tables import apply_rewards, reward_inputs
from rollout_lib.store import canonical_json


class RewardLoops:
    """The reward loops of a run (they own worker processes), one per distinct reward settings, and its reward
    models (each loaded once, shared by every env that names it), created on first use and reused across steps.
    Whoever creates it closes it (`with RewardLoops(...) as loops:`)."""

    def __init__(self, config: RlConfig, frozen_models=None):
        """`frozen_models` (serving.frozen.FrozenModels): the run's, for rewards that call a judge model and reward
        models served with vLLM."""
        self.config = config
        self.settings = config.settings.reward_loop
        self.frozen_models = frozen_models
        self._loops: dict[str, RewardLoop] = {}
        self._scorers: dict[str, RewardModelScorer | ServedRewardModelScorer] = {}

    def for_env(self, env: EnvSettings, rewards: list | None = None, where: str = "rewards") -> RewardLoop:
        """The loop of the env's rewards, or of `rewards` (its held-out evaluation's: `where` = "eval.rewards")."""
        rewards = env.rewards if rewards is None else rewards
        # A reward model's store is a locator the settings dump leaves out; two stores are two models.
        stores = [r.reward_model.store for r in rewards if isinstance(r, RewardModelSettings)]
        key = blake3.blake3(canonical_json([[r.model_dump(mode="json") for r in rewards], stores,
                                            self.settings.model_dump(mode="json")])).hexdigest()
        if key not in self._loops:
            index = [e.name for e in self.config.settings.envs].index(env.name)
            functions = [(self._reward(r, env_locator(index, f"{where}[{r_index}]")), r.weight)
                         for r_index, r in enumerate(rewards)]
            self._loops[key] = RewardLoop(functions, concurrency=self.settings.concurrency,
                                          timeout_s=self.settings.timeout_s, sync_workers=self.settings.sync_workers)
        return self._loops[key]

    def _reward(self, reward, where: str):
        if isinstance(reward, JudgeSettings):
            client = self._judge_client(reward.judge, reward.max_tokens, reward.temperature, where)
            return LlmJudge(client, reward.template, reward.pattern, reward.score_range, reward.system_prompt)
        if isinstance(reward, RewardFunctionSettings):
            if reward.judge is None:
                return resolve_reward_function(reward.function, reward.kwargs)
            function = resolve_reward_function(reward.function)
            if not is_async_callable(function):
                raise ValueError(f"{where}.function: {reward.function!r} is sync; a reward function that calls a "
                                 "judge is async (sync functions run in worker processes, away from the run's pool)")
            return WithJudge(function, self._judge_client(reward.judge, reward.judge_max_tokens, 0.0, where),
                             reward.kwargs)
        return self.reward_model(reward, f"{where}.reward_model")

    def reward_model(self, reward: RewardModelSettings, where: str) -> RewardModelScorer | ServedRewardModelScorer:
        """The scorer of a reward model, loaded (or served) on first use and shared by every env that names it."""
        key = canonical_json([reward.model_dump(mode="json", exclude={"weight"}), reward.reward_model.store])
        if key not in self._scorers:
            if reward.engine == "vllm" and self.frozen_models is None:
                raise ValueError(f"{where}: a served reward model needs the run's FrozenModels "
                                 "(RewardLoops(config, frozen_models))")
            from rollout_lib.hardware import hardware_of_config  # torch: only where a model loads

            self._scorers[key] = load_scorer(reward, self.frozen_models, where,
                                             hardware=hardware_of_config(self.config))
        return self._scorers[key]

    def _judge_client(self, judge, max_tokens: int, temperature: float, where: str) -> JudgeClient:
        if self.frozen_models is None:
            raise ValueError(f"{where}.judge: a judge needs the run's FrozenModels "
                             "(RewardLoops(config, frozen_models))")
        return JudgeClient(self.frozen_models.pool(judge, where=f"{where}.judge"), max_tokens, temperature)

    def take_reward_model_metrics(self) -> dict[str, int]:
        """`reward_model/<count>` summed over the run's reward models since the last call (none without one)."""
        counts: Counter = Counter()
        for scorer in self._scorers.values():
            counts.update(scorer.take_counts())
        return {f"reward_model/{name}": counts[name] for name in COUNTS} if self._scorers else {}

    def close(self) -> None:
        while self._loops:
            _, loop = self._loops.popitem()
            loop.close()
        while self._scorers:
            _, scorer = self._scorers.popitem()
            scorer.close()

    def __enter__(self) -> "RewardLoops":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


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
    without one). Every result depends on its own row alone: scoring the rows in chunks and concatenating the
    results gives the same list (the fan-out of a dask or ray task runner)."""
    envs = rollouts.column("env").to_pylist()
    rows_by_env = {env.name: [i for i, name in enumerate(envs) if name == env.name] for env in config.settings.envs}
    env_loops = [loops.for_env(env) for env in config.settings.envs]  # outside the event loop: may connect a judge

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
    return [{"reward": r.reward, "error": r.error, "per_function": list(r.per_function.items())} for r in results]


def results_from_json(rows: list[dict]) -> list[RewardResult]:
    return [RewardResult(row["reward"], row["error"], dict(row["per_function"])) for row in rows]


def function_means(env_name: str | None, results: list) -> dict[str, float | None]:
    """`reward/<function>` (`reward/<env>/<function>` with several envs): each reward function's unweighted mean
    over the rollouts it scored, for envs with more than one (a weight-0 function is watched, not trained on)."""
    names = list(results[0].per_function) if results else []
    if len(names) < 2:
        return {}
    prefix = f"reward/{env_name}/" if env_name else "reward/"
    means = {}
    for name in names:
        scores = [r.per_function[name] for r in results if r.per_function.get(name) is not None]
        means[prefix + name] = math.fsum(scores) / len(scores) if scores else None
    return means
