"""Between the reward loop and the wire: RewardInputs from ROLLOUTS (+ PROMPTS) rows, rewards back into them."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from rollout_lib import wire
from rollout_lib.reward.contract import RewardInput
from rollout_lib.reward.results import RewardResult


# The ROLLOUTS columns a reward reads (a table may lack the multi-turn ones).
_READ = ("example_id", "env", "completion_text", "answer", "info", "completion_turns", "episode")


def prompt_messages(prompts: pa.Table, example_ids: list[str] | None = None) -> dict[str, list[dict]]:
    """Each PROMPTS row's chat messages by example_id: the `prompt` of its rollouts' RewardInputs. `example_ids`:
    only those rows (the ones a step's rollouts name), so that an env with a million prompts turns a step's few
    into Python objects, not all of them."""
    if example_ids is not None:
        wanted = pa.array(sorted(set(example_ids)), pa.string())
        prompts = prompts.filter(pc.is_in(prompts.column("example_id"), value_set=wanted))
    return dict(zip(prompts.column("example_id").to_pylist(), prompts.column("messages").to_pylist()))


def reward_input(row: dict, messages_by_example: dict[str, list[dict]] | None = None,
                 where: str = "rollout") -> RewardInput:
    """The RewardInput of one ROLLOUTS row as a dict (a table's row, or the record a sampler hands over before the
    table exists: sampling.base.RolloutRows); `messages_by_example`: prompt_messages of its PROMPTS rows (None: an
    empty prompt, which most rule-based rewards never read)."""
    example_id = row["example_id"]
    if messages_by_example is not None and example_id not in messages_by_example:
        raise ValueError(f"{where}: example_id {example_id!r} is not in the prompts table")
    info_text, turns = row.get("info"), row.get("completion_turns")
    if turns is None:  # single-turn: the completion is the one assistant turn
        completion = row["completion_text"]
        messages, state = [{"role": "assistant", "content": completion}], {}
    else:  # an episode: rewards read the policy's last turn, and may read every turn and the final state
        messages = [{"role": turn["role"], "content": turn["content"]} for turn in turns]
        completion = next((turn["content"] for turn in reversed(turns) if turn["sampled"]), "")
        state = json.loads(row["episode"])["state"]
    return RewardInput(
        prompt=messages_by_example[example_id] if messages_by_example is not None else [],
        completion_text=completion,
        answer=row.get("answer"),
        info=json.loads(info_text) if info_text else {},
        env=row.get("env"),
        turns=messages,
        state=state,
        example_id=example_id,
    )


def reward_inputs(rollouts: pa.Table, prompts: pa.Table | None = None) -> list[RewardInput]:
    """One RewardInput per rollout row (reward_input); prompt messages come from PROMPTS rows matched on
    example_id. Without a prompts table the prompt is empty."""
    messages_by_example = (None if prompts is None
                           else prompt_messages(prompts, rollouts.column("example_id").to_pylist()))
    columns = {name: rollouts.column(name).to_pylist() if name in rollouts.column_names else [None] * rollouts.num_rows
               for name in _READ}
    return [reward_input(dict(zip(_READ, values)), messages_by_example, f"rollout row {row}")
            for row, values in enumerate(zip(*(columns[name] for name in _READ)))]


def apply_rewards(rollouts: pa.Table, results: list[RewardResult]) -> pa.Table:
    """The rollouts with `reward` / `reward_error` replaced (or added) from results, row for row."""
    if len(results) != rollouts.num_rows:
        raise ValueError(f"{len(results)} reward results for {rollouts.num_rows} rollouts")
    for name, values in (
        ("reward", [r.reward for r in results]),
        ("reward_error", [r.error for r in results]),
    ):
        schema_field = wire.ROLLOUTS.field(name)
        column = pa.array(values, type=schema_field.type)
        index = rollouts.schema.get_field_index(name)
        if index == -1:
            rollouts = rollouts.append_column(schema_field, column)
        else:
            rollouts = rollouts.set_column(index, schema_field, column)
    return rollouts
