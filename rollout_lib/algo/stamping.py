"""Scored rollouts -> training samples: group, assign advantages, stamp the per-token streams of the wire.

For each rollout row, `input_ids = prompt_ids + completion_ids` and the streams (wire.TRAINING_SAMPLES) are

    loss_mask            False on prompt positions, True on completion tokens
    advantages           0 on prompt positions, the algorithm's per-token advantages on completion tokens
    <action>_weights     0 on prompt positions, 1 on completion tokens (0 when the sample cannot train:
                         its reward is missing and the algorithm needs one); other weight streams stay null
    inference_logprobs   0 on prompt positions, the sampler's logprob of each completion token

so that every stream is aligned with input_ids and the first token (always a prompt token) carries no weight.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

import pyarrow as pa

from rollout_lib import wire
from rollout_lib.algo.base import Algorithm, Group


def group_rows(rollouts: pa.Table) -> dict[tuple[str, str], list[int]]:
    """Row indices of each (env, example_id) group, groups in order of first appearance."""
    groups: dict[tuple[str, str], list[int]] = {}
    for row, key in enumerate(zip(rollouts.column("env").to_pylist(), rollouts.column("example_id").to_pylist())):
        groups.setdefault(key, []).append(row)
    return groups


def assign_advantages(rollouts: pa.Table, algorithms: Mapping[str, Algorithm]) -> list[list[float]]:
    """Per-token advantages of every row's completion, each group assigned by its env's algorithm."""
    rewards = rollouts.column("reward").to_pylist()
    lengths = [len(ids) for ids in rollouts.column("completion_ids").to_pylist()]
    advantages: list[list[float] | None] = [None] * rollouts.num_rows
    for (env, example_id), rows in group_rows(rollouts).items():
        if env not in algorithms:
            raise ValueError(f"rollouts of env {env!r} but no algorithm for it (envs: {sorted(algorithms)})")
        group = Group([rewards[row] for row in rows], [lengths[row] for row in rows])
        assigned = algorithms[env].assign(group)
        if len(assigned) != len(rows):
            raise ValueError(f"{type(algorithms[env]).__name__}.assign returned {len(assigned)} rows for {len(rows)}")
        for row, values in zip(rows, assigned):
            if len(values) != lengths[row]:
                raise ValueError(
                    f"{type(algorithms[env]).__name__}.assign: sample {row} of group {example_id!r} has "
                    f"{len(values)} advantages for {lengths[row]} completion tokens"
                )
            if not all(math.isfinite(value) for value in values):
                raise ValueError(f"{type(algorithms[env]).__name__}.assign: non-finite advantage in {example_id!r}")
            advantages[row] = [float(value) for value in values]
    return advantages  # type: ignore[return-value]


def stamp_training_samples(
    rollouts: pa.Table, advantages: list[list[float]], algorithms: Mapping[str, Algorithm], max_seq_len: int,
    temperatures: Mapping[str, float] | None = None,
) -> pa.Table:
    """TRAINING_SAMPLES rows, one per rollout row, truncated on the right to max_seq_len tokens.

    `temperatures`: env -> the temperature its completions were sampled at (1.0 when absent), stamped on the
    completion tokens so the trainer scores them under the same distribution."""
    columns = {name: rollouts.column(name).to_pylist() for name in
               ("sample_id", "env", "prompt_ids", "completion_ids", "sampling_logprobs", "reward")}
    records = []
    for row, sample_id in enumerate(columns["sample_id"]):
        algorithm = algorithms[columns["env"][row]]
        prompt, completion = columns["prompt_ids"][row], columns["completion_ids"][row]
        logprobs = columns["sampling_logprobs"][row]
        if not prompt:
            raise ValueError(f"sample {sample_id!r} has no prompt tokens (the first token is never trained)")
        if len(prompt) >= max_seq_len:
            raise ValueError(
                f"sample {sample_id!r}: its prompt has {len(prompt)} tokens, max_seq_len is {max_seq_len}; "
                "raise max_seq_len or shorten the prompt"
            )
        if len(logprobs) != len(completion) or len(advantages[row]) != len(completion):
            raise ValueError(f"sample {sample_id!r}: completion, logprobs and advantages are not aligned")
        trainable = columns["reward"][row] is not None or not algorithm.needs_reward
        n_prompt, n_completion = len(prompt), len(completion)
        keep = max_seq_len  # truncation drops completion tokens from the right
        record = {
            "sample_id": sample_id,
            "env": columns["env"][row],
            "input_ids": (prompt + completion)[:keep],
            "loss_mask": ([False] * n_prompt + [True] * n_completion)[:keep],
            "advantages": ([0.0] * n_prompt + advantages[row])[:keep] if algorithm.action_loss == "rl" else None,
            "rl_weights": None,
            "ce_weights": None,
            "ref_kl_weights": None,
            "ref_logprobs": None,
            "inference_logprobs": ([0.0] * n_prompt + [float(x) for x in logprobs])[:keep],
            "temperatures": None,
        }
        temperature = (temperatures or {}).get(columns["env"][row], 1.0)
        if temperature != 1.0:
            record["temperatures"] = ([1.0] * n_prompt + [temperature] * n_completion)[:keep]
        weight = 1.0 if trainable else 0.0
        record[f"{algorithm.action_loss}_weights"] = ([0.0] * n_prompt + [weight] * n_completion)[:keep]
        records.append(record)
    return pa.Table.from_pylist(records, schema=wire.TRAINING_SAMPLES)


async def score_for_shipping(samples: pa.Table, algorithms: Mapping[str, Algorithm]) -> pa.Table:
    """Run each env's ship-time `score` hook (concurrently across envs) and keep the rows in their order."""
    envs = samples.column("env").to_pylist()
    if not any(algorithm.has_score and env in envs for env, algorithm in algorithms.items()):
        return samples
    rows_by_env: dict[str, list[int]] = {}
    for row, env in enumerate(envs):
        rows_by_env.setdefault(env, []).append(row)

    async def ship(env: str, part: pa.Table) -> pa.Table:
        return await algorithms[env].score(part) if algorithms[env].has_score else part

    parts = await asyncio.gather(*(ship(env, samples.take(rows)) for env, rows in rows_by_env.items()))
    positions = [row for rows in rows_by_env.values() for row in rows]
    combined = pa.concat_tables([wire.conform(part, wire.TRAINING_SAMPLES) for part in parts])
    if combined.num_rows != samples.num_rows:
        raise ValueError("a ship-time score hook changed the number of samples")
    inverse = [0] * len(positions)
    for new_index, original in enumerate(positions):
        inverse[original] = new_index
    return combined.take(inverse)


def advantage_metrics(samples: pa.Table) -> dict[str, float | int]:
    """Advantage statistics over trainable samples (each sample's mean completion advantage) and token counts."""
    per_sample: list[float] = []
    trainable_tokens = 0
    for mask, advantages, weights in zip(samples.column("loss_mask").to_pylist(),
                                         samples.column("advantages").to_pylist(),
                                         samples.column("rl_weights").to_pylist()):
        if weights is None or not any(weights):
            continue
        values = [a for a, keep, w in zip(advantages or [0.0] * len(mask), mask, weights) if keep and w]
        trainable_tokens += len(values)
        per_sample.append(math.fsum(values) / len(values) if values else 0.0)
    n = len(per_sample)
    center = math.fsum(per_sample) / n if n else 0.0
    return {
        "advantage_mean": center,
        "advantage_std": math.sqrt(math.fsum((a - center) ** 2 for a in per_sample) / n) if n else 0.0,
        "advantage_min": min(per_sample, default=0.0),
        "advantage_max": max(per_sample, default=0.0),
        "zero_advantage_fraction": (sum(1 for a in per_sample if a == 0.0) / n) if n else 0.0,
        "trainable_samples": n,
        "samples": samples.num_rows,
        "rl_tokens": trainable_tokens,
        "tokens": sum(len(ids) for ids in samples.column("input_ids").to_pylist()),
    }
