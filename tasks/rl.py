"""Prefect tasks of the train-rl flow, one per stage of a step: thin wrappers that read ids from the store, call
rollout_lib.rl, write the result and return its id (plus JSON metrics).

    connect-frozen-models                             (serve / reach each frozen model, check its tokenizer)
    sample-step-k      policy state k-1, prompts      -> rollouts           (the resident policy or a frozen
                                                                            model, seeded; first the stage's
                                                                            weight sync: rl/sample.py)
    score-step-k       rollouts                       -> scored rollouts    (the reward loop; with a dask or ray
                                                                            task runner, score-step-k-chunk-i
                                                                            tasks on its workers, then a merge)
    (streamed, `reward_loop.streamed`: sample-and-score-step-k scores each rollout as it is sampled, and
    score-merge-step-k merges those rewards into the table: the same ids as the staged pair)
    (dynamic sampling, envs with `dynamic_sampling`: each replacement round's draw, sample and score task runs,
    then dynamic-sampling-step-k keeps the groups with signal: tasks/rl_rounds.py)
    advantages-step-k  scored rollouts                -> training samples   (per-env algorithms, stamping)
    pack-step-k        training samples               -> micro-batches
    train-step-k       policy state k-1, micro-batches -> policy state k     (one optimizer step)
    snapshot-step-k    policy state k                 -> checkpoint         (every checkpoint_interval steps
                                                                            and at the last)
    evaluate-env-step-k  policy state k, held-out prompts -> eval metrics  (envs with `eval`: before step 1,
                                                                            every `eval.every` steps, at the end)

The flow hands its open resources in one RunResources (never in a key: tasks.common.RESOURCE_PARAMETERS); the
tasks of many inputs take them by name. Cache keys come from those content ids and the training identity (every setting that decides the policy, not the
run's length or snapshot interval), never from the run id, so a rerun returns every completed stage from cache
and resumes where the last run stopped, and a finished run extended by raising max_steps continues from its end.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from rollout_lib import wire
from rollout_lib.config import RlConfig
from rollout_lib.identity import sources
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.rl.advantages import PolicyReference, algorithm_resources, training_samples
from rollout_lib.rl.curriculum import next_difficulty_pools
from rollout_lib.rl.dynamic_sampling import resamples
from rollout_lib.store import ObjectStore
from rollout_lib.rl.evaluate import evaluate_env, load_eval_prompts
from rollout_lib.rl.pack import pack
from rollout_lib.rl.policy import (
    initial_policy,
    policy_at,
    policy_inputs,
    sampling_policy,
    snapshot_policy,
    train_policy_step,
)
from rollout_lib.rl.prompts import load_prompts
from rollout_lib.rl.partial import PartialStage, sample_partial
from rollout_lib.rl.sample import (
    build_samplers,
    policy_sampler,
    reload_metrics,
    rollout_metrics,
    sample_rollouts,
)
from rollout_lib.rl.streamed import sample_and_score
from rollout_lib.reward.loops import RewardLoops
from rollout_lib.rl.score import (
    chunk_rows,
    merged_results,
    results_from_json,
    reward_results,
    rewards_json,
    run_reward_loops,
    score_rollouts,
    scored_rollouts,
)
from rollout_lib.serving.served import ServedModels
from rollout_lib.trainer.resident import ResidentTrainer
from tasks.common import TASK_OPTIONS, content_key, open_store


@dataclass(frozen=True)
class RunResources:
    """What the flow opened for the run and hands its tasks: they change how fast a task runs, never its result."""

    resident: ResidentTrainer
    served_models: ServedModels | None = None
    reward_loops: RewardLoops | None = None


def _env(config: RlConfig, name: str):
    return next(env for env in config.settings.envs if env.name == name)


def task_sources(*reads, env: bool = False):
    """A key's `extra`: what the task reads besides its settings and input ids (rollout_lib/identity/sources.py),
    each of `reads` called with the task's config (and, with `env`, its env's name)."""
    def extra(parameters: dict) -> dict:
        arguments = (parameters["config"], parameters["env"]) if env else (parameters["config"],)
        return {name: value for read in reads for name, value in read(*arguments).items()}
    return extra


REWARD_SOURCES = task_sources(sources.reward_sources)


def round_run_name(stage: str, suffix: str = ""):
    """A `task_run_name` for a stage a step may run once per dynamic-sampling round (tasks/rl_rounds.py):
    `<stage>-step-k` for the step's own draw (round 0), `<stage>-step-k-round-r` for round r, then `suffix`
    formatted with the task's parameters."""
    return functools.partial(_round_run_name, stage, suffix)


def _round_run_name(stage: str, suffix: str, *, parameters: dict) -> str:
    round_index = parameters.get("round_index", 0)
    return (f"{stage}-step-{parameters['step']}" + (f"-round-{round_index}" if round_index else "")
            + suffix.format(**parameters))


def prompt_tables(config: RlConfig, prompts_ids: dict[str, str]) -> dict:
    options = json.dumps(config.run.storage_options, sort_keys=True)
    return {env: _stored_prompts(config.run.store, options, prompts_id) for env, prompts_id in prompts_ids.items()}


@functools.lru_cache(maxsize=8)
def _stored_prompts(store: str, storage_options: str, prompts_id: str) -> pa.Table:
    """An env's PROMPTS, read once per process: several of every step's tasks read them, and an id names one content
    forever (the store is content-addressed), so a million-row set is read and verified once, not at every task
    (bench/bench_data_sources.py)."""
    return ObjectStore(store, json.loads(storage_options) or None).get_table(prompts_id, wire.PROMPTS)


@task(name="load-prompts", task_run_name="load-prompts-{env}", **TASK_OPTIONS,
      cache_key_fn=content_key(reads=lambda config: None, extra=task_sources(sources.prompt_sources, env=True)))
def load_prompts_task(config: RlConfig, env: str) -> dict:
    table = load_prompts(_env(config, env))
    return {"prompts": open_store(config).put_table(table), "rows": table.num_rows}


@task(name="load-eval-prompts", task_run_name="load-eval-prompts-{env}", **TASK_OPTIONS,
      cache_key_fn=content_key(reads=lambda config: None, extra=task_sources(sources.eval_sources, env=True)))
def load_eval_prompts_task(config: RlConfig, env: str) -> dict:
    table = load_eval_prompts(_env(config, env))
    return {"prompts": open_store(config).put_table(table), "rows": table.num_rows}


@task(name="evaluate", task_run_name="evaluate-{env}-step-{step}", **TASK_OPTIONS,
      cache_key_fn=content_key(extra=task_sources(sources.eval_sources, env=True)))
def evaluate_task(config: RlConfig, *, prompts_ids: dict[str, str], eval_prompts_id: str, env: str,
                  policy_state: str, step: int, resources: RunResources) -> dict:
    """The policy at `policy_state` on the env's held-out prompts (rollout_lib/rl/evaluate.py): its metrics, and
    the ids of its scored rollouts and reward results (`rollout runs samples --eval` reads them)."""
    started = time.perf_counter()
    store = open_store(config)
    policy = policy_at(policy_inputs(store, config, prompts_ids), policy_state, resources.resident)
    # The policy, on its own backend (embedded, or the run's policy server), whatever an env's rollouts come from.
    sampler = policy_sampler(config, policy.model, policy.tokenizer, resources.served_models, policy_state)
    sampler.sync()
    held_out = evaluate_env(config, _env(config, env), store.get_table(eval_prompts_id, wire.PROMPTS), sampler,
                            resources.reward_loops)
    return {"metrics": {**held_out.metrics, f"eval/{env}/eval_s": time.perf_counter() - started}, "env": env,
            "scored": store.put_table(held_out.scored), "rewards": store.put_json(rewards_json(held_out.results, {}))}


@task(name="init-policy", task_run_name="init-policy", **TASK_OPTIONS, cache_key_fn=content_key())
def init_policy_task(config: RlConfig, prompts_ids: dict[str, str], resident: ResidentTrainer) -> dict:
    return {"checkpoint": initial_policy(policy_inputs(open_store(config), config, prompts_ids), resident)}


@task(name="connect-frozen-models", task_run_name="connect-frozen-models", cache_policy=NO_CACHE, retries=0)
def connect_frozen_models_task(config: RlConfig, served_models: ServedModels,
                               reward_loops: RewardLoops | None = None) -> list[str]:
    """Serve (or reach) every frozen model and check it shares the policy's tokenizer, and serve every reward model
    the run scores with on vLLM, before any step runs: a wrong URL, served name or tokenizer fails here, in one
    line naming it, with nothing trained yet."""
    tokenizer = load_tokenizer(resolve_model(config.settings.base_model))
    judges = {where for where, _ in config.judges()}  # judges read text: any tokenizer will do
    connected = [
        f"{where}: {served_models.connect(settings, tokenizer=None if where in judges else tokenizer, where=where)}"
        for where, settings in config.frozen_models()]
    for where, reward in config.served_reward_models():
        if reward_loops is None:
            raise ValueError(f"{where}: a served reward model is served through the run's RewardLoops")
        scorer = reward_loops.reward_model(reward, where)
        connected.append(f"{where}: reward model {scorer.pool.model!r} at {scorer.pool.url_list}")
    return connected


@task(name="sample", task_run_name="sample-step-{step}", **TASK_OPTIONS,
      cache_key_fn=content_key(extra=task_sources(sources.interaction_sources)))
def sample_task(config: RlConfig, *, prompts_ids: dict[str, str], policy_state: str, step: int,
                resources: RunResources, curriculum: str | None = None, in_flight: str | None = None,
                final: bool = False) -> dict:
    """`curriculum`: the id of the difficulty pools to draw prompts with (envs with `curriculum`), or None.
    Partial rollouts (`algorithm.rl.partial_rollouts`, rl/partial.py): `in_flight`, the id of the requests the stage
    before carried (None: none); `final`, the run's last step (it samples every request to its end); the result's
    `in_flight` is what this stage carries on."""
    started = time.perf_counter()
    store = open_store(config)
    _, samplers = synced_samplers(config, store, prompts_ids, policy_state, resources)
    if config.settings.partial_rollouts is not None:
        carried = None if in_flight is None else store.get_table(in_flight, wire.IN_FLIGHT)
        rollouts, carry, partial_metrics = sample_partial(config, samplers, prompt_tables(config, prompts_ids),
                                                          PartialStage.of(config, step, policy_state, final), carried)
        return {"rollouts": store.put_table(rollouts), "in_flight": None if carry is None else store.put_table(carry),
                "metrics": {**rollout_metrics(config, rollouts), **partial_metrics,
                            "sample_s": time.perf_counter() - started}}
    rollouts, metrics = sample_rollouts(config, samplers, prompt_tables(config, prompts_ids), step,
                                        curriculum_state=None if curriculum is None else store.get_json(curriculum))
    return {"rollouts": open_store(config).put_table(rollouts),
            "metrics": {**metrics, **reload_metrics(samplers.values()), "sample_s": time.perf_counter() - started}}


def synced_samplers(config: RlConfig, store, prompts_ids: dict[str, str], policy_state: str,
                     resources: RunResources) -> tuple:
    """A sample stage's policy and samplers (by env), after its weight sync: the trainer's weights at
    `policy_state` published to the policy server, which reloads and probes them, before anything samples."""
    policy = sampling_policy(policy_inputs(store, config, prompts_ids), policy_state, resources.resident)
    samplers = build_samplers(config, policy.model, policy.tokenizer, resources.served_models,
                              policy_state=policy_state)
    for sampler in set(samplers.values()):  # envs on the live policy share one sampler
        sampler.sync()
    return policy, samplers


@task(name="sample-and-score", task_run_name="sample-and-score-step-{step}", **TASK_OPTIONS,
      cache_key_fn=content_key(extra=task_sources(sources.interaction_sources, sources.reward_sources)))
def sample_and_score_task(config: RlConfig, *, prompts_ids: dict[str, str], policy_state: str, step: int,
                          resources: RunResources, curriculum: str | None = None) -> dict:
    """A streamed step's sample stage (`algorithm.rl.reward_loop.streamed`): sample_task's rollouts and metrics,
    each rollout scored the moment it is sampled (rl/streamed.py). `rewards`: the id of their results in row order,
    which score_merge_task (score-merge-step-k) puts into the table: the table, id and metrics score_task gives.
    `score_tail_s`: how long the stage waited for rewards after its last rollout. `behaviour`: off-policy, the id of
    the behaviour logprobs computed while sampling (rl/behaviour_stream.py), which advantages_task adopts; else
    None."""
    started = time.perf_counter()
    store = open_store(config)
    policy, samplers = synced_samplers(config, store, prompts_ids, policy_state, resources)
    # With dynamic sampling the step's rows are known after its rounds (tasks/rl_rounds.py): the behaviour
    # logprobs are left to the advantages stage, which computes the same values for the rows kept.
    streamed = sample_and_score(config, samplers, prompt_tables(config, prompts_ids), step, resources.reward_loops,
                                curriculum_state=None if curriculum is None else store.get_json(curriculum),
                                policy_model=None if resamples(config) else policy.model, policy_state=policy_state)
    return {"rollouts": store.put_table(streamed.rollouts),
            "rewards": store.put_json(rewards_json(streamed.results, streamed.reward_model_metrics)),
            "behaviour": None if streamed.behaviour is None else store.put_table(streamed.behaviour),
            "metrics": {**streamed.sample_metrics, **reload_metrics(samplers.values()), **streamed.behaviour_metrics,
                        "sample_s": streamed.sampled_at - started,
                        "score_tail_s": streamed.scored_at - streamed.sampled_at}}


@task(name="score", task_run_name="score-step-{step}", **TASK_OPTIONS, cache_key_fn=content_key(extra=REWARD_SOURCES))
def score_task(config: RlConfig, prompts_ids: dict[str, str], rollouts_id: str, step: int,
               reward_loops: RewardLoops) -> dict:
    started = time.perf_counter()
    store = open_store(config)
    rollouts = store.get_table(rollouts_id, wire.ROLLOUTS)
    scored, metrics = score_rollouts(config, rollouts, prompt_tables(config, prompts_ids), reward_loops)
    return {"rollouts": store.put_table(scored), "metrics": {**metrics, "score_s": time.perf_counter() - started}}


@task(name="score-chunk", task_run_name=round_run_name("score", "-chunk-{chunk}"), **TASK_OPTIONS,
      cache_key_fn=content_key(extra=REWARD_SOURCES))
def score_chunk_task(config: RlConfig, prompts_ids: dict[str, str], rollouts_id: str, step: int, chunk: int,
                     chunks: int, round_index: int = 0) -> str:
    """The rewards of one chunk of a step's rollouts (rl.score.chunk_rows: whole groups), scored where the run's
    task runner put this task (a Dask or Ray worker): with reward functions built here, since the flow's RewardLoops cannot travel.
    Judges and reward models served over HTTP are reached from here; an embedded reward model loads here, once
    per chunk. Returns the id of the chunk's results (JSON: rollout_lib.rl.score.rewards_json). `round_index`: the
    dynamic-sampling round whose rollouts these are (0: the step's own draw; tasks/rl_rounds.py)."""
    store = open_store(config)
    rollouts = store.get_table(rollouts_id, wire.ROLLOUTS)
    rows = pa.array(chunk_rows(rollouts, chunk, chunks), pa.int64())
    with ServedModels(config.run.store) as served_models, run_reward_loops(config, served_models) as reward_loops:
        results, reward_model_metrics = reward_results(config, rollouts.take(rows),
                                                       prompt_tables(config, prompts_ids), reward_loops)
    return store.put_json(rewards_json(results, reward_model_metrics))


@task(name="score-merge", task_run_name="score-merge-step-{step}", **TASK_OPTIONS,
      cache_key_fn=content_key(extra=REWARD_SOURCES))
def score_merge_task(config: RlConfig, rollouts_id: str, step: int, chunk_ids: list[str]) -> dict:
    """The step's scored rollouts from its chunks' results, put back in row order (a streamed step's: one chunk,
    scored as it was sampled): the table (and its id) and metrics score_task gives."""
    started = time.perf_counter()
    store = open_store(config)
    rollouts = store.get_table(rollouts_id, wire.ROLLOUTS)
    chunk_results, reward_model_metrics = [], {}
    for chunk_id in chunk_ids:
        chunk = store.get_json(chunk_id)
        chunk_results.append(results_from_json(chunk["results"]))
        for name, count in chunk["reward_model_metrics"]:
            reward_model_metrics[name] = reward_model_metrics.get(name, 0) + count
    scored, metrics = scored_rollouts(config, rollouts, merged_results(rollouts, chunk_results), reward_model_metrics)
    return {"rollouts": store.put_table(scored), "metrics": {**metrics, "score_s": time.perf_counter() - started}}


# `behaviour`, the behaviour logprobs the sample stage computed, is not in the key: they are the bits the advantages
# stage would compute itself (rl/behaviour_stream.py), so the training samples are the same with or without them.
@task(name="advantages", task_run_name="advantages-step-{step}", **TASK_OPTIONS,
      cache_key_fn=content_key(extra=task_sources(sources.algorithm_sources), ignore=("behaviour",)))
def advantages_task(config: RlConfig, *, prompts_ids: dict[str, str], policy_state: str, scored_id: str,
                    step: int, resources: RunResources, curriculum: str | None = None,
                    behaviour: str | None = None) -> dict:
    """`resources.served_models`: the run's, for algorithms that score samples with a frozen model at ship time; the
    prompts and the policy at `policy_state` (the weights the step sampled from), for those whose reference is the
    policy itself (and for the behaviour logprobs the trainer recomputes, less those in `behaviour`, the id of
    the ones its sample stage computed, or None). `curriculum`: the id of the difficulty pools after the step
    before; the result's `curriculum` is the id of the pools after this step's groups."""
    started = time.perf_counter()
    store = open_store(config)
    policy = PolicyReference(
        lambda: sampling_policy(policy_inputs(store, config, prompts_ids), policy_state, resources.resident),
        config.settings.base_model, state_id=policy_state)
    algorithm = algorithm_resources(config, resources.served_models, prompt_tables(config, prompts_ids), policy)
    scored = store.get_table(scored_id, wire.ROLLOUTS)
    precomputed = None if behaviour is None else store.get_table(behaviour, wire.BEHAVIOUR_LOGPROBS)
    samples, metrics = training_samples(config, scored, algorithm, precomputed)
    result = {"samples": store.put_table(samples)}
    if curriculum is not None:
        pools, pool_metrics = next_difficulty_pools(config, store.get_json(curriculum), scored,
                                                    prompt_tables(config, prompts_ids))
        result["curriculum"], metrics = store.put_json(pools), {**metrics, **pool_metrics}
    return {**result, "metrics": {**metrics, "advantages_s": time.perf_counter() - started}}


@task(name="pack", task_run_name="pack-step-{step}", **TASK_OPTIONS, cache_key_fn=content_key())
def pack_task(config: RlConfig, samples_id: str, step: int) -> dict:
    started = time.perf_counter()
    store = open_store(config)
    micro_batches, metrics = pack(config, store.get_table(samples_id, wire.TRAINING_SAMPLES))
    return {"micro_batches": store.put_table(micro_batches),
            "metrics": {**metrics, "pack_s": time.perf_counter() - started}}


@task(name="train-step", task_run_name="train-step-{step}", **TASK_OPTIONS, cache_key_fn=content_key())
def train_step_task(config: RlConfig, *, prompts_ids: dict[str, str], policy_state: str, micro_batches_id: str,
                    step: int, resources: RunResources) -> dict:
    """One optimizer step: the new policy state (a step record: its id never depends on when the run snapshots)."""
    started = time.perf_counter()
    inputs = policy_inputs(open_store(config), config, prompts_ids)
    state, metrics = train_policy_step(inputs, policy_state, step, micro_batches_id, resources.resident)
    return {"state": state, "metrics": {**metrics, "train_s": time.perf_counter() - started}}


@task(name="snapshot", task_run_name="snapshot-step-{step}", cache_policy=NO_CACHE, retries=0)
def snapshot_task(config: RlConfig, *, prompts_ids: dict[str, str], policy_state: str, step: int,
                  step_metrics: dict, resources: RunResources) -> str:
    """The checkpoint of `policy_state` for the run's interval: found in the store's index (a rerun: the trainer
    in hand, if any, adopts it as its last snapshot), else written and indexed (rl/policy_state.py); its manifest
    keeps `step_metrics`. Not cached: the index is its cache, and a lookup also tells the resident trainer."""
    inputs = policy_inputs(open_store(config), config, prompts_ids)
    return snapshot_policy(inputs, policy_state, resources.resident, step_metrics)
