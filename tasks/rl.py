"""Prefect tasks of the train-rl flow, one per stage of a step: thin wrappers that read ids from the store, call
rollout_lib.rl, write the result and return its id (plus JSON metrics).

    sample-step-k      policy state k-1, prompts      -> rollouts           (live in-memory policy, seeded)
    score-step-k       rollouts                       -> scored rollouts    (the reward loop)
    advantages-step-k  scored rollouts                -> training samples   (per-env algorithms, stamping)
    pack-step-k        training samples               -> micro-batches
    train-step-k       policy state k-1, micro-batches -> policy state k     (one optimizer step)
    snapshot-step-k    policy state k                 -> checkpoint

Cache keys come from those content ids and the settings hash, never from the run id, so a rerun returns every
completed stage from cache and resumes where the last run stopped.
"""

from __future__ import annotations

import time

from prefect import task

from rollout_lib import rl, wire
from rollout_lib.config import RlConfig
from rollout_lib.config.loading import training_hash
from tasks.common import TASK_OPTIONS, content_key, file_digest, module_digest, open_store


def _run(config: RlConfig, prompts_ids: dict[str, str]) -> rl.RlRun:
    return rl.RlRun(open_store(config), config, training_hash(config), dict(prompts_ids))


def _env(config: RlConfig, name: str):
    return next(env for env in config.settings.envs if env.name == name)


def _source_digest(parameters: dict) -> dict:
    source = _env(parameters["config"], parameters["env"]).source
    return {"file": file_digest(source.path)} if source.type == "jsonl_path" else {}


def _reward_sources(parameters: dict) -> dict:
    """User reward functions ("pkg.module:attr") are outside the project's code version: the source file of each
    one's module enters the score key, so editing a reward function re-scores on the next run instead of returning
    the old scores from cache. (Only that file: helpers it imports from elsewhere are not followed.)"""
    specs = {reward.function for env in parameters["config"].settings.envs for reward in env.rewards}
    return {"reward_sources": {spec: module_digest(spec.partition(":")[0]) for spec in sorted(specs) if ":" in spec}}


def _prompt_tables(run: rl.RlRun) -> dict:
    return {env: run.store.get_table(prompts_id, wire.PROMPTS) for env, prompts_id in run.prompts_ids.items()}


@task(name="load-prompts", task_run_name="load-prompts-{env}", **TASK_OPTIONS,
      cache_key_fn=content_key(extra=_source_digest))
def load_prompts_task(config: RlConfig, env: str) -> dict:
    table = rl.load_prompts(_env(config, env))
    return {"prompts": open_store(config).put_table(table), "rows": table.num_rows}


@task(name="init-policy", task_run_name="init-policy", **TASK_OPTIONS, cache_key_fn=content_key())
def init_policy_task(config: RlConfig, prompts_ids: dict[str, str]) -> dict:
    return {"checkpoint": rl.initial_policy(_run(config, prompts_ids))}


@task(name="sample", task_run_name="sample-step-{step}", **TASK_OPTIONS, cache_key_fn=content_key())
def sample_task(config: RlConfig, prompts_ids: dict[str, str], state_id: str, step: int) -> dict:
    started = time.perf_counter()
    run = _run(config, prompts_ids)
    policy = rl.policy_at(run, state_id)
    sampler = rl.build_sampler(config, policy.model, policy.tokenizer)
    rollouts, metrics = rl.sample_rollouts(config, sampler, _prompt_tables(run), step)
    return {"rollouts": run.store.put_table(rollouts),
            "metrics": {**metrics, "sample_s": time.perf_counter() - started}}


@task(name="score", task_run_name="score-step-{step}", **TASK_OPTIONS, cache_key_fn=content_key(extra=_reward_sources))
def score_task(config: RlConfig, prompts_ids: dict[str, str], rollouts_id: str, step: int) -> dict:
    started = time.perf_counter()
    run = _run(config, prompts_ids)
    rollouts = run.store.get_table(rollouts_id, wire.ROLLOUTS)
    scored, metrics = rl.score_rollouts(config, rollouts, _prompt_tables(run))
    return {"rollouts": run.store.put_table(scored),
            "metrics": {**metrics, "score_s": time.perf_counter() - started}}


@task(name="advantages", task_run_name="advantages-step-{step}", **TASK_OPTIONS, cache_key_fn=content_key())
def advantages_task(config: RlConfig, scored_id: str, step: int) -> dict:
    started = time.perf_counter()
    store = open_store(config)
    samples, metrics = rl.training_samples(config, store.get_table(scored_id, wire.ROLLOUTS))
    return {"samples": store.put_table(samples), "metrics": {**metrics, "advantages_s": time.perf_counter() - started}}


@task(name="pack", task_run_name="pack-step-{step}", **TASK_OPTIONS, cache_key_fn=content_key())
def pack_task(config: RlConfig, samples_id: str, step: int) -> dict:
    started = time.perf_counter()
    store = open_store(config)
    micro_batches, metrics = rl.pack(config, store.get_table(samples_id, wire.TRAINING_SAMPLES))
    return {"micro_batches": store.put_table(micro_batches),
            "metrics": {**metrics, "pack_s": time.perf_counter() - started}}


@task(name="train-step", task_run_name="train-step-{step}", **TASK_OPTIONS, cache_key_fn=content_key())
def train_step_task(config: RlConfig, prompts_ids: dict[str, str], state_id: str, micro_batches_id: str,
                    step: int) -> dict:
    state, metrics = rl.advance(_run(config, prompts_ids), state_id, step, micro_batches_id)
    return {"state": state, "metrics": metrics}


@task(name="snapshot", task_run_name="snapshot-step-{step}", **TASK_OPTIONS,
      cache_key_fn=content_key(ignore=("metrics",)))
def snapshot_task(config: RlConfig, prompts_ids: dict[str, str], state_id: str, step: int, metrics: dict) -> dict:
    return {"checkpoint": rl.snapshot(_run(config, prompts_ids), state_id, metrics)}
