"""Partial rollouts: a sample stage that does not wait for the longest completion, with interruption points that do
not depend on timing, so a rerun after a kill samples (and trains) exactly what the uninterrupted run did.

With `algorithm.rl.partial_rollouts = { token_budget = B }` the sample stage of step n (policy version
v = n-1-k, rl/schedule.py) continues every request in flight for at most B new tokens:

- in flight: the groups the stage before carried (wire.IN_FLIGHT, stored by content like every step output), then
  the prompts step n draws (uniformly, as select_prompts does, from the env's prompts less those in flight, so one
  prompt is in flight once at most and a step's groups never share an example id);
- a request that ends within B tokens (a stop token, or max_tokens) is finished; one that does not is carried and
  resubmitted next stage token-in (its prompt plus its tokens so far), so its later tokens are drawn by the newer
  version. Each token records the version that drew it (`token_policy_versions`) and its logprob under that version
  (`sampling_logprobs`: the behaviour logprob, behaviour_logprobs = "sampler"; on an engine, whose logprob bits
  vary with batch composition, the stage also computes the trainer's logprob of each new token under the version
  it holds, `behaviour_logprobs`, which the training samples take instead: bit-stable; with a mismatch
  correction set the embedded sampler's tokens are scored so too, and the training samples keep the sampler's
  report beside them as `sampler_logprobs`: π_old of each token is the trainer's under the version that drew it);
- a group trains at the step whose stage finishes its last sample: the step's rollouts are the groups complete
  after this stage, oldest draw first;
- the staleness bound S (`max_staleness`, default k + 1): a token drawn by version v trains at step m from state
  m-1, staleness m-1-v. A group whose oldest token would pass S if carried once more (n - v_oldest > S) is sampled
  to its end in this stage instead: the bound paces sampling and no sample is ever dropped (`partial/forced_groups`);
- progress: a stage that would finish no group runs its oldest group to its end, so every step trains something;
- the last step (`final`) drains: every group in flight is sampled to its end, so every prompt drawn is trained
  exactly once.

Everything is a function of content: the in-flight table, the draw (seeded by step), the seeds (run seed, step, env,
which call; an engine's per request, by its index in the call), and the order of requests (in-flight order, then
the draw's). The embedded sampler on CPU then gives the same tokens and logprobs bit for bit on a rerun; an engine
the same tokens, and the trainer's logprobs the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollout_lib import wire
from rollout_lib.config.rl import RlConfig
from rollout_lib.determinism import derived_seed
from rollout_lib.rl.behaviour import CHUNK_ROWS, ForwardInputs, chunk_logprobs, sampler_metrics
from rollout_lib.rl.prompts import select_prompts
from rollout_lib.rl.schedule import OffPolicySchedule
from rollout_lib.sampling.base import SamplingParams, encode_prompt, prompt_messages, sample_id, stop_token_ids


@dataclass(frozen=True)
class PartialStage:
    """One sample stage under partial rollouts: step `step` samples with policy version `version` (`state_id`)."""

    step: int
    version: int
    state_id: str
    budget: int
    bound: int
    final: bool
    # Whether the trainer scores the tokens of every sampler, not only of one whose bits vary (an engine): a mismatch
    # correction compares those scores, π_old, with the sampler's report.
    trainer_scores: bool = False

    @classmethod
    def of(cls, config: RlConfig, step: int, state_id: str, final: bool) -> "PartialStage":
        settings = config.settings
        version = OffPolicySchedule(settings.max_off_policy_steps).sampled_after(step)
        return cls(step, version, state_id, settings.partial_rollouts.token_budget, settings.staleness_bound, final,
                   trainer_scores=settings.loss.correction.active)


def sample_partial(config: RlConfig, samplers: dict, prompt_tables: dict[str, pa.Table], stage: PartialStage,
                   in_flight: pa.Table | None) -> tuple[pa.Table, pa.Table | None, dict]:
    """(the ROLLOUTS of the groups this stage completes, the IN_FLIGHT table carried to the next stage or None,
    the stage's partial-rollout metrics)."""
    rows = [] if in_flight is None else in_flight.to_pylist()
    resumed = sum(bool(row["completion_ids"]) and not row["finished"] for row in rows)
    drawn = 0
    for env_index, env in enumerate(config.settings.envs):
        fresh = _draw(config, samplers[env.name].tokenizer, prompt_tables[env.name], env_index, stage, rows)
        drawn += len(fresh) // env.sampling.group_size
        rows.extend(fresh)
    groups = _groups(rows)
    forced = {key for key, members in groups.items()
              if stage.final or stage.step - _oldest_version(rows, members, stage.version) > stage.bound}
    for env_index, env in enumerate(config.settings.envs):
        unfinished = [i for key, members in groups.items() if key[0] == env.name for i in members
                      if not rows[i]["finished"]]
        budgeted = [i for i in unfinished if _group_of(rows[i]) not in forced]
        _advance(samplers[env.name], rows, budgeted, env.sampling, stage, stage.budget,
                 derived_seed(config.run.seed, "partial", stage.step, env_index, "budget"))
        _advance(samplers[env.name], rows, [i for i in unfinished if _group_of(rows[i]) in forced], env.sampling,
                 stage, None, derived_seed(config.run.seed, "partial", stage.step, env_index, "to-the-end"))
    complete = [key for key, members in groups.items() if all(rows[i]["finished"] for i in members)]
    if not complete and groups:  # progress: the oldest group runs to its end, so the step trains something
        oldest = next(iter(groups))
        forced.add(oldest)
        env_index = next(i for i, env in enumerate(config.settings.envs) if env.name == oldest[0])
        env = config.settings.envs[env_index]
        _advance(samplers[env.name], rows, [i for i in groups[oldest] if not rows[i]["finished"]], env.sampling,
                 stage, None, derived_seed(config.run.seed, "partial", stage.step, env_index, "progress"))
        complete = [oldest]
    done = set(complete)
    trained = [rows[i] for key, members in groups.items() if key in done for i in members]
    carried = [rows[i] for key, members in groups.items() if key not in done for i in members]
    for row in trained:
        row["completion_text"] = samplers[row["env"]].tokenizer.decode(row["completion_ids"], skip_special_tokens=True)
        row["sampled_from"] = stage.state_id
    rollouts = pa.Table.from_pylist([{k: v for k, v in row.items() if k != "finished"} for row in trained],
                                    schema=wire.ROLLOUTS)
    carry = pa.Table.from_pylist(carried, schema=wire.IN_FLIGHT) if carried else None
    return rollouts, carry, _metrics(trained, carried, stage, drawn, resumed, len(done & forced))


def _draw(config: RlConfig, tokenizer, prompts: pa.Table, env_index: int, stage: PartialStage,
          rows: list[dict]) -> list[dict]:
    """The fresh in-flight rows of step `stage.step`'s draw for env `env_index`: its prompts drawn from those not in
    flight, `group_size` empty completions each."""
    env = config.settings.envs[env_index]
    busy = sorted({row["example_id"] for row in rows if row["env"] == env.name})
    free = prompts.filter(pc.invert(pc.is_in(prompts.column("example_id"), pa.array(busy, pa.string()))))
    if free.num_rows < env.prompts_per_step:
        raise ValueError(f"env {env.name!r}: step {stage.step} draws {env.prompts_per_step} prompts under partial "
                         f"rollouts, and only {free.num_rows} of its {prompts.num_rows} are not in flight: lower "
                         "prompts_per_step or max_staleness, or give the env more prompts")
    chosen = select_prompts(free, env.prompts_per_step, seed=config.run.seed, step=stage.step, env_index=env_index)
    fresh = []
    for row, messages in zip(chosen.to_pylist(), prompt_messages(chosen)):
        prompt_ids = encode_prompt(tokenizer, messages, None)
        for group_index in range(env.sampling.group_size):
            fresh.append({
                "sample_id": sample_id(row["example_id"], group_index), "example_id": row["example_id"],
                "env": row["env"], "group_index": group_index, "prompt_ids": prompt_ids, "completion_ids": [],
                "sampling_logprobs": [], "completion_text": "", "answer": row["answer"], "info": row["info"],
                "reward": None, "reward_error": None, "completion_turns": None, "episode": None,
                "sampled_from": None, "token_policy_versions": [], "drawn_at_step": stage.step,
                "behaviour_logprobs": None, "finished": False})
    return fresh


def _group_of(row: dict) -> tuple[str, str]:
    return row["env"], row["example_id"]


def _groups(rows: list[dict]) -> dict[tuple[str, str], list[int]]:
    """Row indices of each in-flight group, in order of first appearance (oldest draw first)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault(_group_of(row), []).append(index)
    return groups


def _oldest_version(rows: list[dict], members: list[int], current: int) -> int:
    """The version of the group's oldest token; `current` when it has none yet (they will be drawn now)."""
    return min((version for i in members for version in rows[i]["token_policy_versions"]), default=current)


def _advance(sampler, rows: list[dict], indices: list[int], params: SamplingParams, stage: PartialStage,
             budget: int | None, seed: int) -> None:
    """Continue rows `indices` token-in (prompt plus tokens so far) for at most `budget` new tokens (None: to
    their end), one generate call; each row's new tokens are appended with this version, and it is marked finished
    when it stopped or reached max_tokens."""
    if not indices:
        return
    remaining = {i: params.max_tokens - len(rows[i]["completion_ids"]) for i in indices}
    longest = max(remaining.values())
    call = params.model_copy(update={"max_tokens": longest if budget is None else min(budget, longest)})
    stops = set(stop_token_ids(sampler.tokenizer, getattr(sampler.model, "generation_config", None)))
    sequences = [rows[i]["prompt_ids"] + rows[i]["completion_ids"] for i in indices]
    drawn = []
    for i, (ids, logprobs) in zip(indices, sampler.generate(sequences, call, seed)):
        # A row with fewer tokens left than the call's max keeps only those: the tokens before are the same as a
        # call of that max would have drawn (sampling is token by token), so the cut is a function of content.
        ids, logprobs = ids[:remaining[i]], logprobs[:remaining[i]]
        row = rows[i]
        drawn.append(len(ids))
        row["completion_ids"] = row["completion_ids"] + list(ids)
        row["sampling_logprobs"] = row["sampling_logprobs"] + list(logprobs)
        row["token_policy_versions"] = row["token_policy_versions"] + [stage.version] * len(ids)
        row["finished"] = bool(ids and ids[-1] in stops) or len(row["completion_ids"]) >= params.max_tokens
    if stage.trainer_scores or not sampler.bit_stable_logprobs:
        _behaviour_logprobs(sampler, rows, indices, drawn, params)


def _behaviour_logprobs(sampler, rows: list[dict], indices: list[int], drawn: list[int],
                        params: SamplingParams) -> None:
    """On an engine, whose logprob bits vary with batch composition (or on any sampler, for a mismatch correction):
    each row's `drawn` new tokens scored by the trainer's forward under this version's weights (`sampler.model`, the
    state the engine was loaded with), in fixed chunks in row order (rl/behaviour.py), appended to its
    `behaviour_logprobs`: the same bits on a rerun."""
    temperature = params.temperature if params.temperature > 0 else 1.0  # greedy: the unscaled distribution
    pad = sampler.tokenizer.pad_token_id or 0
    inputs = []
    for i, count in zip(indices, drawn):
        ids = rows[i]["prompt_ids"] + rows[i]["completion_ids"]
        inputs.append(ForwardInputs(ids, [False] * (len(ids) - count) + [True] * count, [temperature] * len(ids)))
    for start in range(0, len(inputs), CHUNK_ROWS):
        chunk = inputs[start:start + CHUNK_ROWS]
        for i, count, item, values in zip(indices[start:], drawn[start:], chunk,
                                          chunk_logprobs(sampler.model, chunk, pad)):
            new = [float(value) for value in values[len(item.input_ids) - count:]] if count else []
            rows[i]["behaviour_logprobs"] = (rows[i]["behaviour_logprobs"] or []) + new


def _metrics(trained: list[dict], carried: list[dict], stage: PartialStage, drawn: int, resumed: int,
             forced: int) -> dict:
    """Staleness of the trained tokens (policy versions between the one that drew a token and the state it trains
    from, step - 1), and what the stage finished, carried and forced."""
    staleness = np.array([stage.step - 1 - version for row in trained for version in row["token_policy_versions"]])
    # Where the trainer scored the tokens: how far the sampler's report is from them (a correction's diagnostics).
    log_ratios = [mine - reported for row in trained if row["behaviour_logprobs"] is not None
                  for reported, mine in zip(row["sampling_logprobs"], row["behaviour_logprobs"])]
    diagnostics = sampler_metrics(log_ratios) if log_ratios else {}
    return {
        **diagnostics,
        "staleness_max": int(staleness.max()) if len(staleness) else 0,
        "staleness_mean": float(staleness.mean()) if len(staleness) else 0.0,
        "partial/drawn_prompts": drawn,
        "partial/completed_samples": len(trained),
        "partial/completed_groups": len({_group_of(row) for row in trained}),
        "partial/multi_version_samples": sum(len(set(row["token_policy_versions"])) > 1 for row in trained),
        "partial/resumed_samples": resumed,
        "partial/carried_samples": sum(not row["finished"] for row in carried),
        "partial/carried_groups": len({_group_of(row) for row in carried}),
        "partial/forced_groups": forced,
    }
