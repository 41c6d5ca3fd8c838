"""Between the reward loop and the wire: RewardInputs from ROLLOUTS (+ PROMPTS) rows, rewards back into them."""

from __future__ import annotations

import json

import pyarrow as pa

from rollout_lib import wire
from rollout_lib.reward.contract import RewardInput
from rollout_lib.reward.results import RewardResult


def reward_inputs(rollouts: pa.Table, prompts: pa.Table | None = None) -> list[RewardInput]:
    """One RewardInput per rollout row; prompt messages come from PROMPTS rows matched on example_id.

    Without a prompts table the prompt is empty (most rule-based rewards only need completion, answer, info).
    """
    messages_by_example: dict[str, list[dict]] = {}
    if prompts is not None:
        for example_id, messages in zip(
            prompts.column("example_id").to_pylist(), prompts.column("messages").to_pylist()
        ):
            messages_by_example[example_id] = messages
    names = ("example_id", "env", "completion_text", "answer", "info", "completion_turns", "episode")
    columns = {name: rollouts.column(name).to_pylist() if name in rollouts.column_names else [None] * rollouts.num_rows
               for name in names}
    inputs = []
    for row, example_id in enumerate(columns["example_id"]):
        if prompts is not None and example_id not in messages_by_example:
            raise ValueError(f"rollout row {row}: example_id {example_id!r} is not in the prompts table")
        info_text, turns = columns["info"][row], columns["completion_turns"][row]
        if turns is None:  # single-turn: the completion is the one assistant turn
            completion = columns["completion_text"][row]
            messages, state = [{"role": "assistant", "content": completion}], {}
        else:  # an episode: rewards read the policy's last turn, and may read every turn and the final state
            messages = [{"role": turn["role"], "content": turn["content"]} for turn in turns]
            completion = next((turn["content"] for turn in reversed(turns) if turn["sampled"]), "")
            state = json.loads(columns["episode"][row])["state"]
        inputs.append(
            RewardInput(
                prompt=messages_by_example.get(example_id, []),
                completion_text=completion,
                answer=columns["answer"][row],
                info=json.loads(info_text) if info_text else {},
                env=columns["env"][row],
                turns=messages,
                state=state,
            )
        )
    return inputs


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
