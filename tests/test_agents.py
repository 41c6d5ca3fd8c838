"""Agents over an OpenAI-compatible endpoint (envs/agent.py, agent_episodes.py, agent_server.py, agent_tokens.py):
the step serves chat completions backed by its sampler, each episode's requests are kept apart by path, sampled
tokens stay as sampled while requests extend the conversation, a history rewrite splits the episode (counted, each
sequence trained with the episode's advantage), and
an agent that raises or hangs fails its episode (counted, reward missing) without failing the step.

The policy is scripted (a generate function writing fixed turns one character per token through the real tiny
tokenizer, ids no re-tokenization produces), as in test_tool_calls.py; the agents are in tests/example_agents.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import blake3
import pyarrow as pa
import pytest

from rollout_lib import wire
from rollout_lib.plan_checks import load_config
from rollout_lib.config.rl import RlConfig
from rollout_lib.determinism import derived_seed
from rollout_lib.envs import build_interaction
from rollout_lib.envs.agent import AgentSettings, agent_reward
from rollout_lib.identity.sources import interaction_sources
from rollout_lib.model.chat import encode_prompt, use_chat_template
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.reward.contract import RewardInput
from rollout_lib.reward.loop import RewardLoop
from rollout_lib.reward.tables import reward_inputs
from rollout_lib.rl.sample import agent_metrics
from rollout_lib.sampling import SamplingParams
from rollout_lib.sampling.base import sample_episodes

ROOT = Path(__file__).resolve().parent.parent
TOOLS_TEMPLATE = ROOT / "configs/templates/chatml-tools.jinja"

# Drops the content of every assistant turn before the last user message, as reasoning templates drop <think>.
REWRITING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user %}{{- '(earlier)' }}"
    "{%- else %}{{- m['content'] }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("tiny:qwen2"))


def char_ids(tokenizer, text: str) -> list[int]:
    return [token for char in text for token in tokenizer(char, add_special_tokens=False)["input_ids"]]


class ScriptedPolicy:
    """Answers every request with `text` one character per token (then <|im_end|>), logprob -0.25 each, and keeps
    what it was asked (sequence, max_tokens, seed), thread-safely."""

    def __init__(self, tokenizer, text: str = "Hi there"):
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.ids = char_ids(tokenizer, text) + [self.end]
        self.calls: list[tuple[list[int], int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, sequences, params, seed):
        with self.lock:
            self.calls.extend((list(sequence), params.max_tokens, seed) for sequence in sequences)
        return [(list(self.ids), [-0.25] * len(self.ids)) for _ in sequences]


def prompts(n: int = 1) -> pa.Table:
    return pa.Table.from_pylist([{"example_id": f"q{i}", "env": "agents",
                                  "messages": [{"role": "user", "content": f"Question {i}?"}], "answer": "4",
                                  "info": None, "source_line": i + 1} for i in range(n)], schema=wire.PROMPTS)


def run(tokenizer, generate, agent: str | list[str], n_prompts: int = 1, group_size: int = 1, seed: int = 0,
        **settings):
    """Episodes of `agent`: a function of tests/example_agents.py by name, or a program's command."""
    named = {"command": agent} if isinstance(agent, list) else {"import_path": f"example_agents:{agent}"}
    interaction = build_interaction(AgentSettings(**named, **settings))
    table = prompts(n_prompts)
    prompt_ids = [encode_prompt(tokenizer, messages) for messages in table.column("messages").to_pylist()]
    rollouts = sample_episodes(generate, tokenizer, interaction, table, prompt_ids,
                               SamplingParams(group_size=group_size, max_tokens=32), seed,
                               [tokenizer.eos_token_id], 1024)
    return rollouts.to_pylist()


def record(row) -> dict:
    return json.loads(row["episode"])


def test_the_endpoint_answers_with_the_sampled_text_and_logprobs_and_an_extension_keeps_one_sequence(tokenizer):
    policy = ScriptedPolicy(tokenizer)
    [row] = run(tokenizer, policy, "two_turns")
    first, second = [sequence for sequence, _, _ in policy.calls]
    question = encode_prompt(tokenizer, [{"role": "user", "content": "Question 0?"}])
    assert first == question and row["prompt_ids"] == question
    # The second request is conditioned on the first answer's tokens as sampled (one character each), then the
    # rendered follow-up: never on a re-tokenization of "Hi there".
    assert second[:len(first) + len(policy.ids)] == first + policy.ids
    assert tokenizer.decode(second[len(first) + len(policy.ids):]) == \
        "\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    assert row["completion_ids"] == second[len(first):] + policy.ids
    turns = row["completion_turns"]
    assert [(turn["role"], turn["sampled"]) for turn in turns] == [("assistant", True), ("user", False),
                                                                    ("assistant", True)]
    assert turns[1]["content"] == "Go on." and turns[0]["content"] == "Hi there"
    assert [lp is None for lp in row["sampling_logprobs"]] == \
        [False] * len(policy.ids) + [True] * turns[1]["length"] + [False] * len(policy.ids)
    assert record(row)["sequences"] == 1 and record(row)["turns"] == 2 and record(row)["end"] == "agent"
    assert record(row)["state"] == {"agent_reward": None, "requests": 2}


def test_a_template_that_rewrites_history_splits_the_episode_and_counts_it(tokenizer):
    rewriting = load_tokenizer(resolve_model("tiny:qwen2"))
    rewriting.chat_template = REWRITING_TEMPLATE
    policy = ScriptedPolicy(rewriting)
    [row] = run(rewriting, policy, "two_turns")
    first, second = [sequence for sequence, _, _ in policy.calls]
    assert "(earlier)" in rewriting.decode(second) and second[:len(first) + len(policy.ids)] != first + policy.ids
    # The episode's row is its last sequence (the rewritten history is prompt, the last answer sampled); the one
    # before rides along as `earlier_sequences`, trained too (below).
    assert row["prompt_ids"] == second and row["completion_ids"] == policy.ids
    assert [sequence["prompt_ids"] for sequence in row["earlier_sequences"]] == [first]
    assert [turn["sampled"] for turn in row["completion_turns"]] == [True]
    assert record(row)["sequences"] == 2
    assert agent_metrics([record(row)])["agent_sequence_splits"] == 1


def test_an_agent_that_edits_what_it_was_answered_splits_and_its_reward_is_read(tokenizer):
    rows = run(tokenizer, ScriptedPolicy(tokenizer), "rewrites_history", n_prompts=1, group_size=2)
    assert [record(row)["sequences"] for row in rows] == [2, 2]
    assert agent_metrics([record(row) for row in rows]) == {"agent_sequence_splits": 2, "agent_failures": 0,
                                                            "agent_requests_mean": 2.0}
    [item] = reward_inputs(pa.Table.from_pylist(rows[:1], schema=wire.ROLLOUTS))
    assert agent_reward(item) == 0.5


def test_a_split_episode_trains_every_sequence_with_the_episodes_advantage_and_behaviour_logprobs(tokenizer):
    import math

    from rollout_lib.algo.grpo import Grpo, GrpoSettings
    from rollout_lib.algo.stamping import assign_advantages, stamp_training_samples, training_sample_sources
    from rollout_lib.model.loading import load_causal_lm
    from rollout_lib.rl.behaviour import ForwardInputs, chunk_logprobs, mark_training_forward, \
        recompute_behaviour_logprobs

    policy = ScriptedPolicy(tokenizer)
    rows = run(tokenizer, policy, "rewrites_history", n_prompts=1, group_size=2)
    first_request = policy.calls[0][0]
    for row, reward in zip(rows, (1.0, 0.0)):
        row.update(reward=reward, sampled_from="state-a")
        # The sequence before the rewrite, kept as sampled: its request's tokens, then the answer's.
        [earlier] = row["earlier_sequences"]
        assert earlier["prompt_ids"] == first_request and earlier["completion_ids"] == policy.ids
        assert earlier["sampling_logprobs"] == [-0.25] * len(policy.ids)
        assert [turn["sampled"] for turn in earlier["completion_turns"]] == [True]
    rollouts = pa.Table.from_pylist(rows, schema=wire.ROLLOUTS)
    algorithms = {"agents": Grpo(GrpoSettings(), where="envs[0].algo")}
    samples = stamp_training_samples(rollouts, assign_advantages(rollouts, algorithms), algorithms, 1024)

    # Every rollout's row first (the row order the behaviour stream chunks), then the earlier sequences.
    assert samples.column("sample_id").to_pylist() == ["q0#0", "q0#1", "q0#0/0", "q0#1/0"]
    assert training_sample_sources(rollouts) == [0, 1, 0, 1]
    stamped = {sample["sample_id"]: sample for sample in samples.to_pylist()}
    for member, advantage in (("q0#0", 0.5), ("q0#1", -0.5)):  # grpo: reward minus the group's mean
        for sample_id, prompt in ((member, rows[0]["prompt_ids"]), (f"{member}/0", first_request)):
            sample = stamped[sample_id]
            assert sample["input_ids"] == prompt + policy.ids
            trained = [position for position, member in enumerate(sample["loss_mask"]) if member]
            assert trained == list(range(len(prompt), len(prompt) + len(policy.ids)))
            assert [sample["advantages"][position] for position in trained] == [advantage] * len(trained)
            assert sample["rl_weights"] is None  # weight 1 on every sampled token
            assert [sample["inference_logprobs"][position] for position in trained] == [-0.25] * len(trained)

    # The trainer's recompute covers the earlier sequences too (in chunks of their own, after the rollouts').
    model = load_causal_lm(resolve_model("tiny:qwen2")).eval()
    recomputed, metrics = recompute_behaviour_logprobs(samples, rollouts, lambda: model, "state-a")
    assert metrics["behaviour/recomputed"] == 4
    for sample in recomputed.to_pylist():
        [expected] = chunk_logprobs(model, [ForwardInputs.of(sample["input_ids"], sample["loss_mask"], None)])
        trained = [position for position, member in enumerate(sample["loss_mask"]) if member]
        assert [sample["inference_logprobs"][position] for position in trained] == \
            pytest.approx([float(expected[position]) for position in trained], abs=1e-6)
        assert all(sample["inference_logprobs"][position] != -0.25 for position in trained)
    marked, metrics = mark_training_forward(samples, rollouts, "state-a")
    assert metrics == {"behaviour/training_forward": 4}
    assert all(math.isnan(value) for sample in marked.to_pylist()
               for value, member in zip(sample["inference_logprobs"], sample["loss_mask"]) if member)


def test_concurrent_episodes_are_kept_apart(tokenizer):
    policy = ScriptedPolicy(tokenizer)
    rows = run(tokenizer, policy, "interleaved", n_prompts=2, group_size=2)
    assert len(policy.calls) == 12
    for row in rows:  # every follow-up an episode recorded is its own prompt's, all in one sequence
        contents = [turn["content"] for turn in row["completion_turns"] if not turn["sampled"]]
        assert contents == [f"{row['example_id']} round 0", f"{row['example_id']} round 1"]
        assert record(row)["sequences"] == 1 and record(row)["state"]["agent_reward"] == 1.0
        assert f"Question {row['example_id'][1]}?" in tokenizer.decode(row["prompt_ids"])
    # Each request was seeded by its own (example, group index, request index).
    assert sorted(seed for _, _, seed in policy.calls) == sorted(
        derived_seed("agent-request", 0, f"q{p}", g, r) for p in range(2) for g in range(2) for r in range(3))


def test_an_agent_that_hangs_or_raises_fails_its_episode_counted_with_its_reason(tokenizer, caplog):
    [hung] = run(tokenizer, ScriptedPolicy(tokenizer), "hangs", timeout_s=0.3)
    assert record(hung)["end"] == "error" and record(hung)["turns"] == 0 and hung["completion_ids"] == []
    assert "timed out after 0.3s" in record(hung)["state"]["episode_error"]
    [raised] = run(tokenizer, ScriptedPolicy(tokenizer), "explodes")
    assert record(raised)["state"]["episode_error"] == "agent example_agents:explodes: RuntimeError: no luck with q0"
    assert any("no luck with q0" in message for message in caplog.messages)
    assert agent_metrics([record(hung), record(raised)])["agent_failures"] == 2

    async def always_one(item):
        return 1.0

    # The reward of a failed episode is missing with its reason, never a score of what it left behind.
    with RewardLoop([(always_one, 1.0)]) as loop:
        [result] = loop.score(reward_inputs(pa.Table.from_pylist([raised], schema=wire.ROLLOUTS)))
        [fine] = loop.score([RewardInput(prompt=[], completion_text="x")])
    assert result.reward is None and "episode failed" in result.error and "no luck with q0" in result.error
    assert fine.reward == 1.0


def test_tool_calls_are_answered_structured_and_their_results_extend_the_sequence():
    tools_tokenizer = use_chat_template(load_tokenizer(resolve_model("tiny:qwen2")), str(TOOLS_TEMPLATE))
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
    policy = ScriptedPolicy(tools_tokenizer, call)
    [row] = run(tools_tokenizer, policy, "calls_a_tool")
    assert record(row)["state"]["agent_reward"] == 1.0 and record(row)["sequences"] == 1
    first, second = [sequence for sequence, _, _ in policy.calls]
    assert second[:len(first) + len(policy.ids)] == first + policy.ids
    tool_turn = row["completion_turns"][1]
    assert (tool_turn["role"], tool_turn["content"], tool_turn["sampled"]) == ("tool", "4", False)


def test_a_request_refused_at_the_context_limit_leaves_the_episode_as_it_was(tokenizer):
    [row] = run(tokenizer, ScriptedPolicy(tokenizer), "retries_shorter")
    assert record(row)["state"] == {"agent_reward": 1.0, "requests": 3} and record(row)["sequences"] == 1
    assert [(turn["content"], turn["sampled"]) for turn in row["completion_turns"]] == [
        ("Hi there", True), ("short", False), ("Hi there", True)]


def test_requests_past_max_requests_are_refused(tokenizer):
    [row] = run(tokenizer, ScriptedPolicy(tokenizer), "greedy_asker", max_requests=2)
    assert "429" in record(row)["state"]["episode_error"] and record(row)["turns"] == 2


def test_a_rerun_samples_the_same_tokens(tokenizer):
    def seeded(sequences, params, seed):  # a policy whose tokens are a function of its seed alone
        draw = random.Random(seed)
        ids = [draw.randrange(100, 1000) for _ in range(5)] + [tokenizer.eos_token_id]
        return [(ids, [-1.0] * len(ids)) for _ in sequences]

    first = run(tokenizer, seeded, "two_turns", group_size=2, seed=7)
    again = run(tokenizer, seeded, "two_turns", group_size=2, seed=7)
    other = run(tokenizer, seeded, "two_turns", group_size=2, seed=8)
    assert [row["completion_ids"] for row in first] == [row["completion_ids"] for row in again]
    assert first[0]["completion_ids"] != first[1]["completion_ids"]  # group members draw their own seeds
    assert [row["completion_ids"] for row in first] != [row["completion_ids"] for row in other]


PROGRAM = [sys.executable, str(ROOT / "examples/agent_program.py")]


def test_an_agent_program_reads_its_task_talks_to_its_endpoint_and_its_printed_reward_is_read(tokenizer):
    # One answer without a call: the program asks once and scores it against the task's answer ("4").
    [right] = run(tokenizer, ScriptedPolicy(tokenizer, "It is 4"), PROGRAM)
    assert record(right)["state"] == {"agent_reward": 1.0, "requests": 1} and record(right)["end"] == "agent"
    # Calls answered round after round, as many as its kwargs allow; tokens recorded as sampled, one sequence.
    policy = ScriptedPolicy(tokenizer, "calc: 2 * 2")
    [calls] = run(tokenizer, policy, PROGRAM, group_size=2, kwargs={"max_rounds": 2})[:1]
    assert record(calls)["state"] == {"agent_reward": 0.0, "requests": 2} and record(calls)["sequences"] == 1
    assert [(turn["content"], turn["sampled"]) for turn in calls["completion_turns"]] == [
        ("calc: 2 * 2", True), ("result: 4", False), ("calc: 2 * 2", True)]
    assert calls["completion_ids"][:len(policy.ids)] == policy.ids


def test_an_agent_program_that_fails_hangs_or_prints_no_result_fails_its_episode_with_the_reason(tokenizer):
    [failed] = run(tokenizer, ScriptedPolicy(tokenizer), [*PROGRAM, "--mode", "fail"])
    assert record(failed)["end"] == "error"
    assert record(failed)["state"]["episode_error"].endswith("exited with code 1; stderr: no luck with q0")
    [silent] = run(tokenizer, ScriptedPolicy(tokenizer), [*PROGRAM, "--mode", "silent"])
    assert "printed no result" in record(silent)["state"]["episode_error"]
    hanging = [*PROGRAM, "--mode", "hang"]
    [hung] = run(tokenizer, ScriptedPolicy(tokenizer), hanging, timeout_s=2.0)
    assert "timed out after 2.0s" in record(hung)["state"]["episode_error"]
    assert record(hung)["state"]["requests"] == 1  # it did ask before it hung
    still_running = subprocess.run(["pgrep", "-f", " ".join(hanging)], capture_output=True, text=True)
    assert still_running.stdout == "", "the timed-out program's process outlived its episode"
    assert agent_metrics([record(failed), record(silent), record(hung)])["agent_failures"] == 3


def test_an_agent_program_is_checked_at_plan_time_and_its_script_enters_the_sample_key(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        AgentSettings(import_path="example_agents:two_turns", command=PROGRAM)
    with pytest.raises(ValueError, match="exactly one"):
        AgentSettings()
    with pytest.raises(ValueError, match=r"agent program '/no/such/agent' cannot be run: not an executable file "
                                         r"\(command\[0\]\)"):
        AgentSettings(command=["/no/such/agent"])
    with pytest.raises(ValueError, match="nor a name on PATH"):
        AgentSettings(command=["no-such-agent-program"])
    script = tmp_path / "agent.py"
    script.write_text("print(1.0)\n")
    config = load_config(RlConfig, ROOT / "configs/rl-agent-tiny.toml", [
        f'algorithm.rl.envs[0].interaction={{type = "agent", command = ["{sys.executable}", "{script}"]}}'])
    before = interaction_sources(config)
    script.write_text("print(0.0)\n")
    after = interaction_sources(config)
    # The script is read, the interpreter named (not read).
    assert before["interaction_files"] == {str(script): blake3.blake3(b"print(1.0)\n").hexdigest()}
    assert after["interaction_files"] != before["interaction_files"]
    script.write_text("#!/usr/bin/env python3\nprint(1.0)\n")
    script.chmod(0o755)
    itself = load_config(RlConfig, ROOT / "configs/rl-agent-tiny.toml", [
        f'algorithm.rl.envs[0].interaction={{type = "agent", command = ["{script}", "--fast"]}}'])
    assert list(interaction_sources(itself)["interaction_files"]) == [str(script)]  # a script as the program
    # A function agent's settings dump as before the program option (no `command: null`): ids do not move.
    assert "command" not in AgentSettings(import_path="example_agents:two_turns").model_dump()


def test_settings_name_the_agent_and_are_checked_without_importing_it():
    with pytest.raises(ValueError, match="agent function 'example_agents:missing'"):
        AgentSettings(import_path="example_agents:missing")
    with pytest.raises(ValueError, match="bounded by max_requests"):
        AgentSettings(import_path="example_agents:two_turns", max_turns=3)
    config = load_config(RlConfig, ROOT / "configs/rl-agent-tiny.toml")
    assert config.settings.envs[0].interaction.type == "agent"


@pytest.mark.slow
def test_a_two_step_run_with_an_agent_env(prefect_server, tmp_path):
    from clirun import run_rollout

    done = run_rollout("train", "rl", "--config", str(ROOT / "configs/rl-agent-tiny.toml"), "--max-steps", "2",
                       "--set", f"run.store={tmp_path / 'store'}", PYTHONPATH=str(ROOT / "tests"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(json.loads(done.stdout)["reward_curve"]) == 2
    metrics_file = tmp_path / "store/runs/rl-agent-tiny/metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for step in metrics:  # every episode's agent asked at least once and returned its reward
        assert step["rollouts"] == 8 and step["agent_requests_mean"] >= 1 and step["agent_failures"] == 0
        assert step["missing_rewards"] == 0 and step["agent_sequence_splits"] == 0
