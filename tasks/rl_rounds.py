"""Prefect tasks of DAPO dynamic sampling's rounds (rollout_lib/rl/dynamic_sampling.py decides, these store): each
replacement round is its own task runs, keyed on the ids of the rounds before it, so a kill inside round r of a
step reruns from round r with rounds 0..r-1 from cache, to the table an uninterrupted run keeps.

    draw-step-k-round-r              rounds 0..r-1 (rollouts, rewards ids) -> round r's prompts by env (None: the
                                                                               step's rounds are over)
    sample-step-k-round-r            policy state, round r's prompts       -> rollouts (staged or chunked scoring)
    sample-and-score-step-k-round-r  the same                              -> rollouts and their rewards (streamed)
    score-step-k-round-r             rollouts                              -> rewards (staged; round 0 is
                                                                               score-step-k; chunked scoring runs
                                                                               score-step-k-round-r-chunk-i)
    dynamic-sampling-step-k          every round                           -> the kept rows, their rewards, the
                                                                               scored table and the step's metrics

A round's rewards are RewardResults in row order (rl/score.rewards_json), as a list of ids (one, or one per chunk):
the rounds' bookkeeping needs each reward, and the kept table is scored once, like a streamed step's.
"""

from __future__ import annotations

import time

from prefect import task

from rollout_lib import wire
from rollout_lib.config import RlConfig
from rollout_lib.identity import sources
from rollout_lib.reward.loops import RewardLoops
from rollout_lib.rl.dynamic_sampling import Round, kept_rows, next_replacements
from rollout_lib.rl.sample import reload_metrics, rollout_metrics, sample_rollouts
from rollout_lib.rl.score import results_from_json, reward_results, rewards_json, scored_rollouts
from rollout_lib.rl.streamed import sample_and_score
from rollout_lib.store import ObjectStore
from tasks.common import TASK_OPTIONS, content_key, open_store
from tasks.rl import REWARD_SOURCES, RunResources, prompt_tables, round_run_name, synced_samplers, task_sources


def _rounds(store: ObjectStore, rounds: list[dict]) -> tuple[list[Round], dict[str, int]]:
    """The stored rounds (`{"rollouts": id, "rewards": [ids]}` each) as Rounds, and the reward models' counts
    summed over them."""
    parts, reward_model_metrics = [], {}
    for stored in rounds:
        results = []
        for rewards_id in stored["rewards"]:
            rewards = store.get_json(rewards_id)
            results.extend(results_from_json(rewards["results"]))
            for name, count in rewards["reward_model_metrics"]:
                reward_model_metrics[name] = reward_model_metrics.get(name, 0) + count
        parts.append(Round(store.get_table(stored["rollouts"], wire.ROLLOUTS), results))
    return parts, reward_model_metrics


@task(name="draw-round", task_run_name="draw-step-{step}-round-{round_index}", **TASK_OPTIONS,
      cache_key_fn=content_key())
def draw_round_task(config: RlConfig, *, prompts_ids: dict[str, str], step: int, round_index: int,
                    rounds: list[dict]) -> dict:
    """Round `round_index`'s prompts (`replacements`: env -> PROMPTS id), drawn after `rounds` (0..round_index-1);
    None when no env wants more groups or has prompts left."""
    if round_index != len(rounds):
        raise ValueError(f"draw-step-{step}-round-{round_index}: drawn after {len(rounds)} rounds")
    store = open_store(config)
    chosen = next_replacements(config, prompt_tables(config, prompts_ids), step, _rounds(store, rounds)[0])
    return {"replacements": {env: store.put_table(table) for env, table in chosen.items()} or None}


def _replacement_tables(store: ObjectStore, replacements: dict[str, str]) -> dict:
    return {env: store.get_table(prompts_id, wire.PROMPTS) for env, prompts_id in replacements.items()}


@task(name="sample-round", task_run_name="sample-step-{step}-round-{round_index}", **TASK_OPTIONS,
      cache_key_fn=content_key(extra=task_sources(sources.interaction_sources)))
def sample_round_task(config: RlConfig, *, prompts_ids: dict[str, str], policy_state: str, step: int,
                      round_index: int, replacements: dict[str, str], resources: RunResources) -> dict:
    """Round `round_index`'s rollouts of its `replacements` prompts, seeded per (step, env, round), from the state
    the step samples from: sample_task's for a replacement round."""
    started = time.perf_counter()
    store = open_store(config)
    _, samplers = synced_samplers(config, store, prompts_ids, policy_state, resources)
    rollouts, metrics = sample_rollouts(config, samplers, prompt_tables(config, prompts_ids), step,
                                        replacements=_replacement_tables(store, replacements),
                                        round_index=round_index)
    return {"rollouts": store.put_table(rollouts),
            "metrics": {**metrics, **reload_metrics(samplers.values()), "sample_s": time.perf_counter() - started}}


@task(name="sample-and-score-round", task_run_name="sample-and-score-step-{step}-round-{round_index}",
      **TASK_OPTIONS, cache_key_fn=content_key(extra=task_sources(sources.interaction_sources,
                                                                  sources.reward_sources)))
def sample_and_score_round_task(config: RlConfig, *, prompts_ids: dict[str, str], policy_state: str, step: int,
                                round_index: int, replacements: dict[str, str], resources: RunResources) -> dict:
    """sample_round_task with each rollout scored as it is sampled (streamed scoring): `rewards`, the id of their
    results in row order."""
    started = time.perf_counter()
    store = open_store(config)
    _, samplers = synced_samplers(config, store, prompts_ids, policy_state, resources)
    streamed = sample_and_score(config, samplers, prompt_tables(config, prompts_ids), step, resources.reward_loops,
                                replacements=_replacement_tables(store, replacements), round_index=round_index)
    return {"rollouts": store.put_table(streamed.rollouts),
            "rewards": store.put_json(rewards_json(streamed.results, streamed.reward_model_metrics)),
            "metrics": {**streamed.sample_metrics, **reload_metrics(samplers.values()),
                        "sample_s": streamed.sampled_at - started}}


@task(name="score-rewards", task_run_name=round_run_name("score"), **TASK_OPTIONS,
      cache_key_fn=content_key(extra=REWARD_SOURCES))
def score_rewards_task(config: RlConfig, prompts_ids: dict[str, str], rollouts_id: str, step: int,
                       round_index: int, reward_loops: RewardLoops) -> str:
    """The rewards of a round's rollouts (staged scoring), in row order: the id of their results (rewards_json)."""
    store = open_store(config)
    rollouts = store.get_table(rollouts_id, wire.ROLLOUTS)
    results, reward_model_metrics = reward_results(config, rollouts, prompt_tables(config, prompts_ids), reward_loops)
    return store.put_json(rewards_json(results, reward_model_metrics))


@task(name="dynamic-sampling", task_run_name="dynamic-sampling-step-{step}", **TASK_OPTIONS,
      cache_key_fn=content_key(extra=REWARD_SOURCES))
def kept_rows_task(config: RlConfig, *, step: int, rounds: list[dict]) -> dict:
    """The step's kept rows over its `rounds` (rl/dynamic_sampling.kept_rows): `rollouts` and `rewards` (what a
    streamed sample stage gives), `scored` (what score-merge gives: the table, scored once, with the reward
    breakers over the kept rows), and the metrics of each (`sample_metrics`: the kept rows' and the rounds',
    `score_metrics`)."""
    started = time.perf_counter()
    store = open_store(config)
    parts, reward_model_metrics = _rounds(store, rounds)
    kept, metrics = kept_rows(config, parts)
    scored, score_metrics = scored_rollouts(config, kept.rollouts, kept.results, reward_model_metrics)
    return {"rollouts": store.put_table(kept.rollouts),
            "rewards": store.put_json(rewards_json(kept.results, reward_model_metrics)),
            "scored": store.put_table(scored),
            "sample_metrics": {**rollout_metrics(config, kept.rollouts), **metrics},
            "score_metrics": {**score_metrics, "score_s": time.perf_counter() - started}}
