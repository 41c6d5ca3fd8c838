"""A run's samples, read straight from the tables its RL steps stored (`rollout runs samples`, docs/runs.md).

One row per rollout of a step, in the rollouts table's order: which rollout, its prompt and completion, the total
reward and each function's (None where the step stored only totals), the mean advantage over its policy tokens,
token counts, what sampled it, a multi-turn episode's turns, and with tokens=True each completion token's ids and
logprobs. The columns one by one: docs/runs.md, "rollout runs samples".
`behaviour_logprob`: what the trainer's ratio divides by (None where the step took its own training forward's);
`with_trainer_logprobs` adds `trainer_logprob` per token and `logprob_gap` per row (docs/runs.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from rollout_lib import wire
from rollout_lib.runlog.metrics_file import read_metrics
from rollout_lib.runlog.runs import check_run
from rollout_lib.runlog.eval_tables import read_rl_eval_tables, recorded_rl_evals
from rollout_lib.runlog.step_tables import read_step_tables, recorded_steps
from rollout_lib.store import ObjectNotFoundError, ObjectStore, StoreError


@dataclass(frozen=True)
class StepSamples:
    run: str
    step: int
    steps: list[int]  # every step of the run with samples
    rows: list[dict]


def read_samples(store: ObjectStore, run_name: str, step: int | None = None, *, tokens: bool = False) -> StepSamples:
    """Step ``step``'s samples (default: the latest step with samples). A StoreError naming the run, the step and
    what to do when there are none: an unknown run, a run that is not RL, a step out of range, tables gone."""
    check_run(store, run_name)
    steps = recorded_steps(store, run_name)
    if not steps:
        raise StoreError(_why_no_samples(store, run_name))
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise StoreError(f"run {run_name!r} in {store.root} has no samples of step {step}: its steps with samples "
                         f"are {_ranges(steps)}; pick one with --step")
    return StepSamples(run_name, step, steps, step_rows(store, run_name, step, tokens=tokens))


def step_rows(store: ObjectStore, run_name: str, step: int, *, tokens: bool = False) -> list[dict]:
    """Step ``step``'s rows, for a caller that knows the step has a record (the flow and the trackers, each step):
    the record read directly, not the run's steps listed (a listing a step would grow with the run)."""
    record = read_step_tables(store, run_name, step)
    if record is None:
        raise StoreError(f"run {run_name!r} in {store.root} has no samples of step {step}")
    try:
        return _rows(store, record, tokens)
    except ObjectNotFoundError as exc:
        raise StoreError(f"the tables of step {step} of run {run_name!r} are gone from {store.root} ({exc}; "
                         "`rollout gc` deletes them once the run is older than its grace period): rerun the run's "
                         "command to sample them again") from None


def read_eval_samples(store: ObjectStore, run_name: str, step: int | None = None, *,
                      tokens: bool = False) -> StepSamples:
    """An RL run's held-out evaluation at ``step`` (default: the last), every env evaluated then, env by env, in the
    rows of a step's samples (no advantage: nothing trains on them). A StoreError naming the run and what to do
    when there is none."""
    check_run(store, run_name)
    steps = recorded_rl_evals(store, run_name)
    if not steps:
        raise StoreError(f"run {run_name!r} in {store.root} has no held-out samples recorded: none of its envs has "
                         "an `eval`, or it evaluated before rollout stored them; rerun its command (its steps come "
                         "back from cache) to record them")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise StoreError(f"run {run_name!r} in {store.root} has no held-out evaluation at step {step}: it evaluated "
                         f"at steps {_ranges(steps)}; pick one with --step")
    rows = []
    try:
        for env, tables in read_rl_eval_tables(store, run_name, step)["envs"].items():
            rows.extend(_rows(store, {"scored": tables["scored"], "rewards": tables["rewards"],
                                      "prompts": {env: tables["prompts"]}}, tokens))
    except ObjectNotFoundError as exc:
        raise StoreError(f"the held-out samples of step {step} of run {run_name!r} are gone from {store.root} "
                         f"({exc}; `rollout gc` deletes them once the run is older than its grace period): rerun the "
                         "run's command to evaluate again") from None
    return StepSamples(run_name, step, steps, rows)


def select(rows: list[dict], *, worst: int | None = None, best: int | None = None,
           failed: bool = False) -> list[dict]:
    """The rows a selection asks for (one of them at most; none: every row)."""
    if worst:
        return _worst(rows, worst)
    if best:
        return _best(rows, best)
    return _failed(rows) if failed else rows


def shown_first(rows: list[dict], limit: int) -> list[dict]:
    """At most ``limit`` rows for a bounded view (the UI's per-step table): the failed ones first, then the worst
    and the best in turn (lowest, highest, second lowest, ...), each row once."""
    ranked = sorted((row for row in rows if row["reward"] is not None), key=lambda row: row["reward"])
    turns = [row for pair in zip(ranked, reversed(ranked)) for row in pair][:len(ranked)]
    chosen, seen = [], set()
    for row in [*_failed(rows), *turns]:
        if row["sample_id"] not in seen and len(chosen) < limit:
            seen.add(row["sample_id"])
            chosen.append(row)
    return chosen


def flat_row(row: dict, text_chars: int = 400) -> dict:
    """One sample as a flat row of short cells, for a table that shows a few (the UI's): the prompt's last user
    message and the completion cut to ``text_chars``, each function's reward in one cell."""
    prompt = next((message["content"] for message in reversed(row["prompt"] or []) if message["role"] == "user"), "")
    flat = {"sample": f"{row['example_id']}#{row['group_index']}", "reward": _short(row["reward"]),
            "reward_error": row["reward_error"] or "",
            "rewards": ", ".join(f"{name} {value:.4g}" if value is not None else f"{name} failed"
                                 for name, value in (row["rewards"] or {}).items()),
            "advantage": _short(row["advantage"]), "completion": _cut(row["completion"] or "", text_chars),
            "prompt": _cut(prompt, text_chars), "tokens": f"{row['prompt_tokens']} + {row['completion_tokens']}",
            "sampled_from": row["sampled_from"]}
    if row["turns"] is not None:
        flat.update(model_turns=row["model_turns"], tool_calls=row["tool_calls"], end=row["end"])
    return flat


def _short(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.6g}")


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars - 1] + "…"


def _worst(rows: list[dict], count: int) -> list[dict]:
    """The ``count`` scored rows of lowest total reward, lowest first (ties: table order)."""
    return sorted((row for row in rows if row["reward"] is not None), key=lambda row: row["reward"])[:count]


def _best(rows: list[dict], count: int) -> list[dict]:
    """The ``count`` scored rows of highest total reward, highest first (ties: table order)."""
    return sorted((row for row in rows if row["reward"] is not None), key=lambda row: -row["reward"])[:count]


def _failed(rows: list[dict]) -> list[dict]:
    """The rows whose reward is missing (the reward loop's error says why)."""
    return [row for row in rows if row["reward"] is None]


def _why_no_samples(store: ObjectStore, run_name: str) -> str:
    history = read_metrics(store, run_name)
    if history and not any("reward_mean" in record for record in history):
        return (f"run {run_name!r} in {store.root} is not an RL run: only train-rl keeps samples "
                "(`rollout runs show` has its metrics)")
    return (f"run {run_name!r} in {store.root} has no samples recorded: it trained before rollout recorded them, or "
            "has not finished a step yet; rerun its command (finished steps come back from cache) to record them")


def _ranges(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1)) else ", ".join(map(str, steps))


def _rows(store: ObjectStore, record: dict, tokens: bool) -> list[dict]:
    scored = store.get_table(record["scored"], wire.ROLLOUTS)
    samples = store.get_table(record["samples"], wire.TRAINING_SAMPLES) if record.get("samples") else None
    messages = {}
    asked = scored.column("example_id").unique()
    for prompts_id in record["prompts"].values():
        prompts = store.get_table(prompts_id, wire.PROMPTS)
        prompts = prompts.filter(pc.is_in(prompts.column("example_id"), value_set=asked))  # not a whole prompt set
        messages.update(zip(prompts.column("example_id").to_pylist(), prompts.column("messages").to_pylist()))
    per_function = _per_function(store, record.get("rewards"), scored.num_rows)
    by_sample = {} if samples is None else {  # a held-out evaluation trains nothing: no samples
        row["sample_id"]: row for row in _columns(samples, ("sample_id", "input_ids", "loss_mask", "advantages",
                                                            "inference_logprobs"))}
    rows = []
    for index, rollout in enumerate(scored.to_pylist()):
        sample = by_sample.get(rollout["sample_id"])
        row = {
            "sample_id": rollout["sample_id"], "env": rollout["env"], "example_id": rollout["example_id"],
            "group_index": rollout["group_index"], "prompt": messages.get(rollout["example_id"]),
            "completion": rollout["completion_text"], "reward": rollout["reward"],
            "rewards": per_function[index], "reward_error": rollout["reward_error"],
            "advantage": _advantage(sample), "prompt_tokens": len(rollout["prompt_ids"]),
            "completion_tokens": len(rollout["completion_ids"]), "sampled_from": rollout["sampled_from"],
            **_episode(rollout),
        }
        if tokens:
            row["tokens"] = _tokens(rollout, sample)
        rows.append(row)
    return rows


def with_trainer_logprobs(rows: list[dict], trainer: dict[str, list[float | None]], *,
                          keep_tokens: bool) -> list[dict]:
    """``rows`` (read with tokens) with the trainer's logprobs (sample_id -> per completion token,
    rl/trainer_logprobs.py): each token's ``trainer_logprob``, each row's ``logprob_gap``; the tokens dropped
    after unless ``keep_tokens``."""
    for row in rows:
        values = trainer.get(row["sample_id"]) or [None] * len(row["tokens"])
        gaps = []
        for token, value in zip(row["tokens"], values):
            token["trainer_logprob"] = value
            if value is not None and token["sampled"] and token["sampler_logprob"] is not None:
                gaps.append(abs(token["sampler_logprob"] - value))
        row["logprob_gap"] = max(gaps) if gaps else None
        if not keep_tokens:
            del row["tokens"]
    return rows


def _columns(table: pa.Table, names: tuple[str, ...]) -> list[dict]:
    return table.select(list(names)).to_pylist()


def _per_function(store: ObjectStore, rewards_id: str | None, num_rows: int) -> list[dict | None]:
    """Each row's rewards by function, from a streamed step's reward results (row order); Nones without them."""
    if rewards_id is None:
        return [None] * num_rows
    results = store.get_json(rewards_id)["results"]
    if len(results) != num_rows:
        raise StoreError(f"reward results {rewards_id} hold {len(results)} rows for a table of {num_rows}")
    return [dict(result["per_function"]) for result in results]


def _advantage(sample: dict | None) -> float | None:
    if sample is None or sample["advantages"] is None:
        return None
    values = [a for a, member in zip(sample["advantages"], sample["loss_mask"]) if member]
    return math.fsum(values) / len(values) if values else None


def _episode(rollout: dict) -> dict:
    turns = rollout["completion_turns"]
    if turns is None:
        return {"turns": None, "model_turns": None, "tool_calls": None, "end": None}
    episode = json.loads(rollout["episode"]) if rollout["episode"] else {}
    return {"turns": [{"role": turn["role"], "sampled": turn["sampled"], "content": turn["content"]}
                      for turn in turns],
            "model_turns": episode.get("turns", sum(turn["sampled"] for turn in turns)),
            "tool_calls": sum(turn["role"] == "tool" for turn in turns), "end": episode.get("end")}


def _tokens(rollout: dict, sample: dict | None) -> list[dict]:
    """Per completion token; the sample's streams past max_seq_len (truncated) are None."""
    offset = len(rollout["prompt_ids"])
    sampled = _sampled_mask(rollout)
    streams = sample or {}

    def at(name: str, position: int) -> float | None:
        values = streams.get(name)
        if values is None or offset + position >= len(values):
            return None
        value = values[offset + position]
        return None if value is None or math.isnan(value) else value

    return [{"id": token, "sampled": sampled[i], "sampler_logprob": rollout["sampling_logprobs"][i],
             "behaviour_logprob": at("inference_logprobs", i) if sampled[i] else None,
             "advantage": at("advantages", i)}
            for i, token in enumerate(rollout["completion_ids"])]


def _sampled_mask(rollout: dict) -> list[bool]:
    """Which completion tokens the policy sampled (an episode's env segments it did not)."""
    turns = rollout["completion_turns"]
    if turns is None:
        return [True] * len(rollout["completion_ids"])
    mask = [False] * len(rollout["completion_ids"])
    for turn in turns:
        for position in range(turn["start"], turn["start"] + turn["length"]):
            mask[position] = turn["sampled"]
    return mask
