"""RL prompt sources: JSONL rows (prompt or messages, answer, info, id) with `path:lineno:` errors, reasoning-gym
sets that its own score_answer grades through the reward loop, and the per-step prompt draw."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from rollout_lib import wire
from rollout_lib.data import DataError, generate_reasoning_gym_prompts, load_jsonl_prompts
from rollout_lib.reward.functions import resolve_reward_function
from rollout_lib.reward.loop import score_inputs_sync
from rollout_lib.reward.tables import reward_inputs
from rollout_lib.rl.prompts import check_distinct_examples, select_prompts


def write(tmp_path, *lines: str):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_prompts_messages_answers_info_and_ids(tmp_path):
    path = write(
        tmp_path,
        '{"prompt": "What is 2+2?", "answer": 4}',
        "",
        '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],'
        ' "info": {"k": [1, 2]}, "id": "greeting"}',
    )
    table = load_jsonl_prompts(path, "math", system_prompt="Think.")
    assert table.schema == wire.PROMPTS
    rows = table.to_pylist()
    assert rows[0]["example_id"] == "math/1" and rows[0]["env"] == "math" and rows[0]["source_line"] == 1
    assert rows[0]["messages"] == [{"role": "system", "content": "Think."}, {"role": "user", "content": "What is 2+2?"}]
    assert rows[0]["answer"] == "4" and rows[0]["info"] is None
    # A conversation that brings its own system message keeps it.
    assert rows[1]["example_id"] == "greeting" and rows[1]["source_line"] == 3
    assert rows[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert json.loads(rows[1]["info"]) == {"k": [1, 2]} and rows[1]["answer"] is None


@pytest.mark.parametrize("line,reason", [
    ('{"answer": "4"}', "give exactly one of 'prompt' (a string) or 'messages' (a list)"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "give exactly one of"),
    ('{"prompt": 3}', "field 'prompt' must be a string, got int"),
    ('{"prompt": "  "}', "'prompt' is empty"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0]: role must be one of"),
    ('{"messages": [{"role": "user", "content": 1}]}', "messages[0]: content must be a string, got int"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
     "the last message is the assistant's"),
    ('{"prompt": "q", "answer": true}', "'answer' must be a string or a finite number"),
    ('{"prompt": "q", "info": [1]}', "'info' must be a JSON object, got list"),
    ('{"prompt": "q", "answr": "4"}', "unknown field(s) ['answr']"),
    ('{"prompt": "q"', "invalid JSON"),
    ('["q"]', "expected a JSON object, got list"),
])
def test_malformed_rows_are_path_lineno_errors(tmp_path, line, reason):
    path = write(tmp_path, '{"prompt": "fine"}', line)
    with pytest.raises(DataError) as info:
        load_jsonl_prompts(path, "env")
    assert str(info.value).startswith(f"{path}:2: ") and reason in str(info.value)


def test_repeated_ids_and_empty_files_are_errors(tmp_path):
    with pytest.raises(DataError, match=r":2: id 'a' repeats line 1"):
        load_jsonl_prompts(write(tmp_path, '{"prompt": "x", "id": "a"}', '{"prompt": "y", "id": "a"}'), "env")
    with pytest.raises(DataError, match="no prompts"):
        load_jsonl_prompts(write(tmp_path, ""), "env")
    with pytest.raises(DataError, match="dataset file not found"):
        load_jsonl_prompts(tmp_path / "nope.jsonl", "env")


def test_example_ids_must_be_distinct_across_envs(tmp_path):
    a = load_jsonl_prompts(write(tmp_path, '{"prompt": "x", "id": "same"}'), "a")
    b = load_jsonl_prompts(write(tmp_path, '{"prompt": "y", "id": "same"}'), "b")
    with pytest.raises(DataError, match="example id 'same' is in envs 'a' and 'b'"):
        check_distinct_examples({"a": a, "b": b})


def test_reasoning_gym_sets_are_seeded_and_scored_by_their_own_score_answer():
    def generate(seed):
        return generate_reasoning_gym_prompts("chain_sum", 5, seed, "sums", system_prompt="Use <answer> tags.")

    table = generate(3)
    assert table.schema == wire.PROMPTS and table.num_rows == 5
    assert table.equals(generate(3)) and not table.equals(generate(4))
    row = table.to_pylist()[0]
    assert row["example_id"] == "sums/0" and row["messages"][0]["role"] == "system"
    info = json.loads(row["info"])
    assert info["rg_dataset"] == "chain_sum" and info["rg_config"] == {"size": 5, "seed": 3}
    assert row["messages"][1]["content"] == info["rg_entry"]["question"]

    # Through the reward loop, as the score stage runs it: right, wrong and untagged answers.
    answer = row["answer"]
    rollouts = pa.Table.from_pylist([
        {"sample_id": f"s{i}", "example_id": row["example_id"], "env": "sums", "group_index": i,
         "prompt_ids": [1], "completion_ids": [2], "sampling_logprobs": [0.0], "completion_text": text,
         "answer": answer, "info": row["info"], "reward": None, "reward_error": None}
        for i, text in enumerate([f"<answer>{answer}</answer>", f"<answer>{int(answer) + 1}</answer>", "no idea"])
    ], schema=wire.ROLLOUTS)  # single-turn rows: completion_turns and episode null
    results = score_inputs_sync(reward_inputs(rollouts, table), [(resolve_reward_function("reasoning_gym"), 1.0)],
                                  concurrency=4, timeout_s=60)
    assert [r.reward for r in results] == [1.0, 0.0, 0.0]


def test_config_knobs_reach_the_generator_and_bad_ones_are_data_errors():
    table = generate_reasoning_gym_prompts("basic_arithmetic", 4, 0, "a",
                                           config={"min_terms": 2, "max_terms": 2, "operators": ["+"]})
    for row in table.to_pylist():
        assert json.loads(row["info"])["rg_entry"]["metadata"]["num_terms"] == 2
    with pytest.raises(DataError, match="reasoning-gym dataset 'basic_arithmetic'"):
        generate_reasoning_gym_prompts("basic_arithmetic", 4, 0, "a", config={"no_such_knob": 1})


def test_each_step_draws_distinct_prompts_from_its_own_seed(tmp_path):
    table = load_jsonl_prompts(write(tmp_path, *[json.dumps({"prompt": f"p{i}"}) for i in range(10)]), "e")
    first = select_prompts(table, 4, seed=1, step=3, env_index=0).column("example_id").to_pylist()
    assert len(set(first)) == 4
    assert first == select_prompts(table, 4, seed=1, step=3, env_index=0).column("example_id").to_pylist()
    assert first != select_prompts(table, 4, seed=1, step=4, env_index=0).column("example_id").to_pylist()
