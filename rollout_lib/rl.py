"""On-policy RL, one step at a time: sample -> score -> assign advantages -> pack -> train step.

Each stage is a plain function from tables to tables (the Prefect tasks in tasks/rl.py store their outputs and
pass ids). The policy's state at step k (weights + optimizer) lives in `PolicyTrainer`, driven by
`trainer/live.py`: the sample stage of step k+1 reads the live in-memory model of state k, and a process that
has no live state (a rerun after a crash) materialises it from the last snapshot by replaying the train steps
since. Replay needs no sampling: a train step reads its micro-batches from the store, and the pending-state
records form a chain that says which micro-batches each step trained on.

Determinism on CPU: prompts are drawn per (seed, step, env), sampling is seeded by (seed, step, env), training
seeds dropout from (seed, step) and the learning rate is a function of the step, so an interrupted-and-rerun
run reaches the same final checkpoint id as an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import atexit
import time
from dataclasses import dataclass, field

import blake3
import numpy as np
import pyarrow as pa
import torch

from rollout_lib import wire
from rollout_lib.algo import Algorithm, build_algorithm
from rollout_lib.algo.stamping import (
    advantage_metrics,
    assign_advantages,
    score_for_shipping,
    stamp_training_samples,
)
from rollout_lib.config.rl import EnvSettings, RlConfig
from rollout_lib.data import DataError, load_env_prompts
from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model
from rollout_lib.packing import batch_unpacked, pack_samples
from rollout_lib.reward.functions import resolve_reward_function
from rollout_lib.reward.loop import RewardLoop, raise_if_all_missing, reward_metrics
from rollout_lib.reward.tables import apply_rewards, reward_inputs
from rollout_lib.sampling import SAMPLERS, Sampler
from rollout_lib.store import ObjectStore, canonical_json
from rollout_lib.trainer import live
from rollout_lib.trainer.base import CheckpointedTrainer
from rollout_lib.trainer.causal import TIMING_METRICS, train_on_micro_batches
from rollout_lib.trainer.determinism import derived_seed, use_deterministic_torch
from rollout_lib.trainer.optim import build_optimizer

# --- prompts ---------------------------------------------------------------------------------------------------


def load_prompts(env: EnvSettings) -> pa.Table:
    """The env's PROMPTS, checked against what every step draws from it."""
    table = load_env_prompts(env)
    if env.prompts_per_step > table.num_rows:
        raise DataError(f"env {env.name!r}: prompts_per_step = {env.prompts_per_step} but its source has only "
                        f"{table.num_rows} prompts")
    return table


def check_distinct_examples(prompt_tables: dict[str, pa.Table]) -> None:
    """Example ids name groups and samples across envs, so two envs may not share one."""
    owner: dict[str, str] = {}
    for env, table in prompt_tables.items():
        for example_id in table.column("example_id").to_pylist():
            if example_id in owner:
                raise DataError(f"example id {example_id!r} is in envs {owner[example_id]!r} and {env!r}; "
                                "give the JSONL rows distinct ids")
            owner[example_id] = env


def select_prompts(prompts: pa.Table, count: int, *, seed: int, step: int, env_index: int) -> pa.Table:
    """`count` distinct prompts drawn at random for this (seed, step, env): any step's prompts are known without
    replaying the steps before it."""
    rng = np.random.default_rng(derived_seed(seed, "prompts", step, env_index))
    return prompts.take(rng.choice(prompts.num_rows, size=count, replace=False).tolist())


# --- sample ----------------------------------------------------------------------------------------------------


def build_sampler(config: RlConfig, model, tokenizer) -> Sampler:
    settings = config.settings.sampler
    sampler_cls = SAMPLERS[settings.type]
    return sampler_cls(settings, model, tokenizer)


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


# --- score -----------------------------------------------------------------------------------------------------

# Reward loops own worker processes: one per env settings, reused across steps of the process, closed at exit.
_REWARD_LOOPS: dict[str, RewardLoop] = {}


def reward_loop(config: RlConfig, env: EnvSettings) -> RewardLoop:
    loop_settings = config.settings.reward_loop
    key = blake3.blake3(canonical_json([env.model_dump(mode="json")["rewards"],
                                        loop_settings.model_dump(mode="json")])).hexdigest()
    if key not in _REWARD_LOOPS:
        functions = [(resolve_reward_function(r.function, r.kwargs), r.weight) for r in env.rewards]
        _REWARD_LOOPS[key] = RewardLoop(functions, concurrency=loop_settings.concurrency,
                                        timeout_s=loop_settings.timeout_s, sync_workers=loop_settings.sync_workers)
    return _REWARD_LOOPS[key]


@atexit.register
def close_reward_loops() -> None:
    while _REWARD_LOOPS:
        _, loop = _REWARD_LOOPS.popitem()
        loop.close()


def score_rollouts(config: RlConfig, rollouts: pa.Table, prompt_tables: dict[str, pa.Table]) -> tuple[pa.Table, dict]:
    """Rewards (null + error when missing) for every rollout, each env with its own functions, all concurrently.

    Raises AllRewardsFailedError when not a single rollout of the step got a reward."""
    envs = rollouts.column("env").to_pylist()
    rows_by_env = {env.name: [i for i, name in enumerate(envs) if name == env.name] for env in config.settings.envs}

    async def score_all():
        return await asyncio.gather(*(
            reward_loop(config, env).ascore(reward_inputs(rollouts.take(rows_by_env[env.name]),
                                                          prompt_tables[env.name]))
            for env in config.settings.envs
        ))

    results: list = [None] * rollouts.num_rows
    metrics: dict = {}
    for env, env_results in zip(config.settings.envs, asyncio.run(score_all())):
        for row, result in zip(rows_by_env[env.name], env_results):
            results[row] = result
        if len(config.settings.envs) > 1:
            env_metrics = reward_metrics(env_results)
            metrics[f"reward_mean/{env.name}"] = env_metrics["reward_mean"]
            metrics[f"missing_rewards/{env.name}"] = env_metrics["n_missing"]
    raise_if_all_missing(results)
    overall = reward_metrics(results)
    errors = sorted({r.error for r in results if r.error})
    metrics.update({"reward_mean": overall["reward_mean"], "reward_std": overall["reward_std"],
                    "missing_rewards": overall["n_missing"], "reward_errors": errors[:3]})
    return apply_rewards(rollouts, results), metrics


# --- advantages and stamping ----------------------------------------------------------------------------------


def env_algorithms(config: RlConfig) -> dict[str, Algorithm]:
    return {env.name: build_algorithm(env.algo) for env in config.settings.envs}


def training_samples(config: RlConfig, scored: pa.Table) -> tuple[pa.Table, dict]:
    """TRAINING_SAMPLES from scored rollouts: group-time advantages, stamping, then ship-time scoring."""
    algorithms = env_algorithms(config)
    advantages = assign_advantages(scored, algorithms)
    temperatures = {env.name: env.sampling.temperature for env in config.settings.envs}
    samples = stamp_training_samples(scored, advantages, algorithms, config.settings.max_seq_len, temperatures)
    samples = asyncio.run(score_for_shipping(samples, algorithms))
    return samples, advantage_metrics(samples)


def pack(config: RlConfig, samples: pa.Table) -> tuple[pa.Table, dict]:
    settings = config.settings
    if settings.packing:
        micro_batches = pack_samples(samples, config.packed_tokens)
    else:
        micro_batches = batch_unpacked(samples, settings.sequences_per_micro_batch, max_seq_len=settings.max_seq_len)
    return micro_batches, {"packed_micro_batches": micro_batches.num_rows}


# --- the policy's training state -------------------------------------------------------------------------------


@dataclass
class RlRun:
    """Content ids and settings that define a run; everything a trainer needs to (re)build itself."""

    store: ObjectStore
    config: RlConfig
    settings_hash: str
    prompts_ids: dict[str, str]  # env name -> PROMPTS table id
    step_batches: dict[int, str] = field(default_factory=dict)  # step -> MICRO_BATCHES id it trains on


class PolicyTrainer(CheckpointedTrainer):
    """The policy being trained, one optimizer step per RL step over that step's micro-batches."""

    kind_of_model = "policy"
    # Step metrics that measure the machine (stage times) stay out of the content-addressed manifest.
    timing_metrics = TIMING_METRICS | {"sample_s", "score_s", "advantages_s", "pack_s", "train_s"}

    @classmethod
    def build(cls, run: RlRun):
        use_deterministic_torch()
        resolved = resolve_model(run.config.settings.base_model)
        tokenizer = load_tokenizer(resolved)
        torch.manual_seed(run.config.run.seed)
        model = load_causal_lm(resolved)
        model.config.pad_token_id = tokenizer.pad_token_id
        optimizer = build_optimizer(model.parameters(), run.config.settings.optimizer)
        return model, tokenizer, optimizer

    def data_ids(self) -> dict[str, str]:
        return {f"prompts/{env}": prompts_id for env, prompts_id in sorted(self.run.prompts_ids.items())}

    def run_step(self, step: int) -> dict:
        if step not in self.run.step_batches:
            raise RuntimeError(f"no micro-batches recorded for step {step}")
        settings = self.run.config.settings
        started = time.perf_counter()
        micro_batches = self.run.store.get_table(self.run.step_batches[step], wire.MICRO_BATCHES)
        self.model.train()
        metrics = train_on_micro_batches(
            self.model, self.optimizer, micro_batches, packed=settings.packing,
            pad_token_id=self.tokenizer.pad_token_id, max_grad_norm=settings.optimizer.max_grad_norm,
            rl_kwargs=settings.loss.model_dump(),
        )
        return {**metrics, "train_s": time.perf_counter() - started}


def initial_policy(run: RlRun) -> str:
    """Step 0 snapshotted (the base model, a fresh optimizer), and kept live for the first sample stage."""
    trainer = PolicyTrainer.initial(run)
    live.hold(run.store, trainer.checkpoint_id, lambda checkpoint_id: trainer)
    return trainer.checkpoint_id


def replay_batches(store: ObjectStore, state_id: str) -> dict[int, str]:
    """step -> micro-batches id of every pending step between `state_id` and its last snapshot."""
    batches: dict[int, str] = {}
    while True:
        record = store.get_json(state_id)
        if record.get("kind") != live.PENDING_KIND:
            return batches
        batches[record["step"]] = record["micro_batches"]
        state_id = record["parent"]


def run_at(run: RlRun, state_id: str) -> RlRun:
    """The run with every step that state `state_id` depends on since its snapshot resolvable."""
    return RlRun(run.store, run.config, run.settings_hash, run.prompts_ids,
                 {**run.step_batches, **replay_batches(run.store, state_id)})


def policy_at(run: RlRun, state_id: str) -> PolicyTrainer:
    """The live policy of `state_id` (materialised from the store if this process has none), not advanced."""
    run = run_at(run, state_id)
    return live.hold(run.store, state_id, lambda checkpoint_id: PolicyTrainer.from_checkpoint(run, checkpoint_id))


def advance(run: RlRun, state_id: str, step: int, micro_batches_id: str) -> tuple[str, dict]:
    """Train step `step` of the policy at `state_id` on `micro_batches_id`; returns (pending state id, metrics)."""
    run = run_at(run, state_id)
    run.step_batches[step] = micro_batches_id
    trainer = live.live_trainer(state_id)
    if trainer is not None:
        trainer.run = run  # the live trainer learns where this step's micro-batches are
    return live.advance(
        run.store, state_id, step,
        open_checkpoint=lambda checkpoint_id: PolicyTrainer.from_checkpoint(run, checkpoint_id),
        identity={"settings_hash": run.settings_hash, "micro_batches": micro_batches_id, "parent": state_id},
    )


def snapshot(run: RlRun, state_id: str, metrics: dict) -> str:
    run = run_at(run, state_id)
    return live.snapshot(run.store, state_id, metrics,
                         open_checkpoint=lambda checkpoint_id: PolicyTrainer.from_checkpoint(run, checkpoint_id))

