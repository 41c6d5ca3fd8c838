"""Scored rollouts -> training samples: group, assign advantages, stamp the per-token streams of the wire.

What a sample trains is read off its algorithm's hooks, never off flags: the component its completion tokens train
under (`action_loss`), the advantages `assign` gave it (None: no rl credit), and whether it defines `score`.
For each rollout row, `input_ids = prompt_ids + completion_ids` and the streams (wire.TRAINING_SAMPLES) are

    loss_mask            False on prompt positions, True on completion tokens (the tokens the policy sampled)
    advantages           0 on prompt positions, the per-token advantages on completion tokens; null without rl credit
    rl_weights           null (weight 1 on every loss_mask token) for a sample with rl credit; zeros otherwise,
                         which is how a sample whose reward is missing, or of a ce / ref_kl algorithm, stays out of rl
    ce_weights,          for a ce or ref_kl algorithm: 0 on prompt positions, 1 on completion tokens; else null
    ref_kl_weights
    inference_logprobs   0 on prompt positions, the sampler's logprob of each completion token

so that every stream is aligned with input_ids and the first token (always a prompt token) carries no weight.

Multi-turn rollouts (`completion_turns` set) interleave tokens the policy sampled with tokens the environment
wrote. Only the sampled ones are "completion tokens" above: loss_mask, the ce / ref_kl weights of a ce or ref_kl
algorithm, the sampling temperature and inference_logprobs cover them alone; advantages are 0 on env tokens, so
env tokens never enter rl. The algorithm's `observation_weights` hook may give env tokens ce weights (echo); they
are added to ce_weights, and a weight on a sampled token is the hook's bug.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

import pyarrow as pa

from rollout_lib import wire
from rollout_lib.algo.base import Algorithm, Group, scores_at_ship_time, trains_env_tokens


def group_rows(rollouts: pa.Table) -> dict[tuple[str, str], list[int]]:
    """Row indices of each (env, example_id) group, groups in order of first appearance."""
    groups: dict[tuple[str, str], list[int]] = {}
    for row, key in enumerate(zip(rollouts.column("env").to_pylist(), rollouts.column("example_id").to_pylist())):
        groups.setdefault(key, []).append(row)
    return groups


def assign_advantages(rollouts: pa.Table, algorithms: Mapping[str, Algorithm]) -> list[list[float] | None]:
    """Per-token advantages of every row's completion (None: no rl credit), each group assigned by its env's
    algorithm."""
    rewards = rollouts.column("reward").to_pylist()
    lengths = [len(ids) for ids in rollouts.column("completion_ids").to_pylist()]
    advantages: list[list[float] | None] = [None] * rollouts.num_rows
    for (env, example_id), rows in group_rows(rollouts).items():
        if env not in algorithms:
            raise ValueError(f"rollouts of env {env!r} but no algorithm for it (envs: {sorted(algorithms)})")
        algorithm = algorithms[env]
        assigned = algorithm.assign(Group([rewards[row] for row in rows], [lengths[row] for row in rows]))
        named = f"{algorithm.where}: {type(algorithm).__name__}.assign"
        if assigned is None:
            if algorithm.action_loss == "rl":
                raise ValueError(f"{named} returned None; an rl algorithm returns one entry per sample")
            continue  # no rl credit for the whole group: its tokens train under ce or ref_kl
        if len(assigned) != len(rows):
            raise ValueError(f"{named} returned {len(assigned)} rows for {len(rows)}")
        for row, values in zip(rows, assigned):
            if values is None:
                continue
            if len(values) != lengths[row]:
                raise ValueError(f"{named}: sample {row} of group {example_id!r} has {len(values)} advantages for "
                                 f"{lengths[row]} completion tokens")
            if not all(math.isfinite(value) for value in values):
                raise ValueError(f"{named}: non-finite advantage in group {example_id!r}")
            advantages[row] = [float(value) for value in values]
    return advantages


def stamp_training_samples(
    rollouts: pa.Table, advantages: list[list[float] | None], algorithms: Mapping[str, Algorithm],
    max_seq_len: int, temperatures: Mapping[str, float] | None = None, keep_sampler: bool = False,
) -> pa.Table:
    """TRAINING_SAMPLES rows, one per rollout row (in its order), then one per earlier sequence of a split agent
    episode (`training_sample_sources` maps each back), truncated on the right to max_seq_len tokens.

    `temperatures`: env -> the temperature its completions were sampled at (1.0 when absent), stamped on the
    completion tokens so the trainer scores them under the same distribution. `keep_sampler`: a row whose
    `inference_logprobs` are the trainer's (ROLLOUTS `behaviour_logprobs`, partial rollouts) also carries the
    sampler's report as `sampler_logprobs`, which a mismatch correction weighs them against."""
    columns = {name: rollouts.column(name).to_pylist() for name in
               ("sample_id", "env", "prompt_ids", "completion_ids", "sampling_logprobs", "completion_turns")}
    # Partial rollouts on an engine: the trainer's logprobs under the version that drew each token (wire.ROLLOUTS).
    behaviour = (rollouts.column("behaviour_logprobs").to_pylist() if "behaviour_logprobs" in rollouts.column_names
                 else [None] * rollouts.num_rows)
    row_dicts: list[dict] = []  # every row as a dict, made once when an observation_weights hook first needs one

    def row_dict(row: int) -> dict:
        nonlocal row_dicts
        row_dicts = row_dicts or rollouts.to_pylist()
        return row_dicts[row]

    def stamp(row: int, sample_id: str, sequence: dict, advantage: list[float] | None, earlier: bool) -> dict:
        env = columns["env"][row]  # an earlier sequence is its episode's row with that sequence's tokens
        return _stamped(sample_id, env, algorithms[env], sequence, advantage, max_seq_len,
                        (temperatures or {}).get(env, 1.0),
                        lambda: {**row_dict(row), **sequence} if earlier else row_dict(row))

    records = []
    for row, sample_id in enumerate(columns["sample_id"]):
        sequence = {name: columns[name][row] for name in ("prompt_ids", "completion_ids", "completion_turns")}
        sequence["sampling_logprobs"] = behaviour[row] if behaviour[row] is not None else \
            columns["sampling_logprobs"][row]
        record = stamp(row, sample_id, sequence, advantages[row], earlier=False)
        if keep_sampler and behaviour[row] is not None:
            reported = columns["sampling_logprobs"][row]
            record[wire.SAMPLER_LOGPROBS] = ([0.0] * len(sequence["prompt_ids"]) + [float(x) for x in reported])[
                :max_seq_len]
        records.append(record)
    for row, position, sequence in _earlier_sequences(rollouts):
        # An agent episode's earlier sequences share its reward, so its advantage: the value the last sequence's
        # sampled tokens carry (every built-in algorithm gives an episode one; a per-token hook's mean otherwise).
        records.append(stamp(row, f"{columns['sample_id'][row]}/{position}", sequence,
                             _episode_advantage(records[row], len(sequence["completion_ids"])), earlier=True))
    return pa.Table.from_pylist(records, schema=wire.TRAINING_SAMPLES)


def training_sample_sources(rollouts: pa.Table) -> list[int]:
    """The rollout row each of `stamp_training_samples`' rows comes from."""
    return [*range(rollouts.num_rows), *(row for row, _, _ in _earlier_sequences(rollouts))]


def _earlier_sequences(rollouts: pa.Table):
    """(row, position, sequence) of every earlier sequence of a split agent episode, in row order."""
    if "earlier_sequences" not in rollouts.column_names:  # a table made without it (wire.LATER_COLUMNS)
        return
    for row, sequences in enumerate(rollouts.column("earlier_sequences").to_pylist()):
        for position, sequence in enumerate(sequences or ()):
            yield row, position, sequence


def _episode_advantage(last: dict, n_completion: int) -> list[float] | None:
    """The advantage of every completion token of an earlier sequence (0 on env tokens, as stamping makes it):
    the mean over the episode's last sequence's sampled tokens."""
    if last["advantages"] is None:
        return None
    values = [a for a, member in zip(last["advantages"], last["loss_mask"]) if member]
    return [sum(values) / len(values) if values else 0.0] * n_completion


def _stamped(sample_id: str, env: str, algorithm: Algorithm, sequence: dict, advantage: list[float] | None,
             max_seq_len: int, temperature: float, rollout) -> dict:
    """One TRAINING_SAMPLES record of a sequence (prompt_ids, completion_ids, sampling_logprobs, completion_turns);
    `rollout()`: the rollout row as an algorithm's observation_weights hook reads it."""
    component = algorithm.action_loss
    prompt, completion, logprobs = sequence["prompt_ids"], sequence["completion_ids"], sequence["sampling_logprobs"]
    turns = sequence["completion_turns"]
    sampled = sampled_mask(turns, len(completion), sample_id)
    if not prompt:
        raise ValueError(f"sample {sample_id!r} has no prompt tokens (the first token is never trained)")
    if len(prompt) >= max_seq_len:
        raise ValueError(
            f"sample {sample_id!r}: its prompt has {len(prompt)} tokens, max_seq_len is {max_seq_len}; "
            "raise max_seq_len or shorten the prompt"
        )
    if len(logprobs) != len(completion) or (advantage is not None and len(advantage) != len(completion)):
        raise ValueError(f"sample {sample_id!r}: completion, logprobs and advantages are not aligned")
    n_prompt = len(prompt)
    keep = max_seq_len  # truncation drops completion tokens from the right
    input_ids, loss_mask, token_temperatures = forward_streams(prompt, completion, sampled, max_seq_len, temperature)
    if advantage is not None:
        advantage = [a if member else 0.0 for a, member in zip(advantage, sampled)]
    record = {
        "sample_id": sample_id,
        "env": env,
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "advantages": None if advantage is None else ([0.0] * n_prompt + advantage)[:keep],
        # Null means weight 1 on every loss_mask token (wire.TRAINING_SAMPLE_DEFAULTS): plain rl ships nothing.
        "rl_weights": None if component == "rl" and advantage is not None else [0.0] * len(input_ids),
        "ce_weights": None,
        "ref_kl_weights": None,
        "ref_logprobs": None,
        "inference_logprobs": ([0.0] * n_prompt + [0.0 if x is None else float(x) for x in logprobs])[:keep],
        "temperatures": token_temperatures,
    }
    if component != "rl":
        record[f"{component}_weights"] = ([0.0] * n_prompt + [float(m) for m in sampled])[:keep]
    if turns is not None and trains_env_tokens(algorithm):
        observed = checked_observation_weights(algorithm, rollout(), sampled)
        if observed is not None and any(observed):
            ce = record["ce_weights"] or [0.0] * (n_prompt + len(completion))
            record["ce_weights"] = [c + o for c, o in zip(ce, [0.0] * n_prompt + observed)][:keep]
    return record


def forward_streams(prompt: list[int], completion: list[int], sampled: list[bool], max_seq_len: int,
                    temperature: float) -> tuple[list[int], list[bool], list[float] | None]:
    """A sample's `input_ids`, `loss_mask` and `temperatures` (None: 1.0 everywhere), what a forward of it reads:
    truncated on the right to max_seq_len. The one definition, for stamping and for the behaviour logprobs
    computed while a step samples (rl/behaviour_stream.py), which must see the very inputs stamping gives."""
    n_prompt = len(prompt)
    input_ids = (prompt + completion)[:max_seq_len]
    loss_mask = ([False] * n_prompt + sampled)[:max_seq_len]
    if temperature == 1.0:
        return input_ids, loss_mask, None
    return input_ids, loss_mask, ([1.0] * n_prompt + [temperature if m else 1.0 for m in sampled])[:max_seq_len]


def sampled_mask(turns: list[dict] | None, n_completion: int, sample_id: str) -> list[bool]:
    """Which completion tokens the policy sampled: all of them for a single-turn rollout; for an episode, those of
    its model turns. The turns must tile the completion (the episode driver's contract)."""
    if turns is None:
        return [True] * n_completion
    mask, position = [], 0
    for turn in turns:
        if turn["start"] != position:
            raise ValueError(f"sample {sample_id!r}: its turns do not tile the completion (a turn starts at "
                             f"{turn['start']}, the previous one ends at {position})")
        mask.extend([bool(turn["sampled"])] * turn["length"])
        position += turn["length"]
    if position != n_completion:
        raise ValueError(f"sample {sample_id!r}: its turns cover {position} tokens of a {n_completion}-token completion")
    return mask


def checked_observation_weights(algorithm: Algorithm, rollout: dict, sampled: list[bool]) -> list[float] | None:
    weights = algorithm.observation_weights(rollout)
    if weights is None:
        return None
    named = f"{algorithm.where}: {type(algorithm).__name__}.observation_weights"
    if len(weights) != len(sampled):
        raise ValueError(f"{named} returned {len(weights)} weights for {len(sampled)} completion tokens")
    weights = [float(w) for w in weights]
    if any(w != 0 and member for w, member in zip(weights, sampled)):
        raise ValueError(f"{named} weighted a token the policy sampled; it weights environment tokens only")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"{named} returned a negative or non-finite weight")
    return weights


async def score_for_shipping(samples: pa.Table, algorithms: Mapping[str, Algorithm]) -> pa.Table:
    """Run each env's ship-time `score` hook (concurrently across envs) and keep the rows in their order."""
    envs = samples.column("env").to_pylist()
    if not any(scores_at_ship_time(algorithm) and env in envs for env, algorithm in algorithms.items()):
        return samples
    rows_by_env: dict[str, list[int]] = {}
    for row, env in enumerate(envs):
        rows_by_env.setdefault(env, []).append(row)

    async def ship(env: str, part: pa.Table) -> pa.Table:
        return await algorithms[env].score(part) if scores_at_ship_time(algorithms[env]) else part

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
    """Advantage statistics over the samples that train rl (each one's mean completion advantage), how many
    samples train any component, and token counts."""
    per_sample: list[float] = []
    rl_tokens = trainable = 0
    columns = [samples.column(name).to_pylist() for name in
               ("loss_mask", "advantages", "rl_weights", "ce_weights", "ref_kl_weights")]
    for mask, advantages, rl_weights, ce_weights, ref_kl_weights in zip(*columns):
        # Null rl_weights: weight 1 on every loss_mask token (wire.TRAINING_SAMPLE_DEFAULTS).
        rl = [keep and (rl_weights is None or rl_weights[t] != 0) for t, keep in enumerate(mask)]
        trainable += any(rl) or any(ce_weights or ()) or any(ref_kl_weights or ())
        if not any(rl) or advantages is None:  # rl tokens without advantages: the pack stage names the bug
            continue
        values = [a for a, member in zip(advantages, rl) if member]
        rl_tokens += len(values)
        per_sample.append(math.fsum(values) / len(values))
    n = len(per_sample)
    center = math.fsum(per_sample) / n if n else 0.0
    return {
        "advantage_mean": center,
        "advantage_std": math.sqrt(math.fsum((a - center) ** 2 for a in per_sample) / n) if n else 0.0,
        "advantage_min": min(per_sample, default=0.0),
        "advantage_max": max(per_sample, default=0.0),
        "zero_advantage_fraction": (sum(1 for a in per_sample if a == 0.0) / n) if n else 0.0,
        "trainable_samples": trainable,
        "samples": samples.num_rows,
        "rl_tokens": rl_tokens,
        "tokens": sum(len(ids) for ids in samples.column("input_ids").to_pylist()),
    }
