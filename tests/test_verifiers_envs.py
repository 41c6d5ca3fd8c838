"""verifiers environments run unchanged (envs/verifiers_env.py, verifiers_client.py, verifiers_data.py,
verifiers_rubric.py): a SingleTurnEnv and a ToolEnv written for verifiers 0.3.x (examples/), their datasets as the
prompts, their rollouts driven through rollout's vf.Client with every token the policy's as sampled, their Rubrics
scored by rollout's reward loop (a failing rubric function a counted missing reward, weight-0 metrics reported).

The unit tests drive the real environments with a scripted policy (fixed turns written one character per token
through the real tiny tokenizer, as tests/test_agents.py does), so the tokens each turn must carry are known; the
slow ones run each example config for 2 steps through the CLI."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers", reason="the verifiers extra is not installed (pip install 'rollout[verifiers]')")

from rollout_lib.config import ConfigError  # noqa: E402
from rollout_lib.plan_checks import load_config  # noqa: E402
from rollout_lib.config.rl import EnvSettings, RlConfig  # noqa: E402
from rollout_lib.data import DataError  # noqa: E402
from rollout_lib.envs import build_interaction  # noqa: E402
from rollout_lib.envs.verifiers_data import verifiers_prompts  # noqa: E402
from rollout_lib.model.chat import encode_prompt, use_chat_template  # noqa: E402
from rollout_lib.model.loading import load_tokenizer, resolve_model  # noqa: E402
from rollout_lib.reward.loops import RewardLoops  # noqa: E402
from rollout_lib.reward.results import reward_metrics  # noqa: E402
from rollout_lib.reward.settings import RewardLoopSettings  # noqa: E402
from rollout_lib.reward.tables import reward_inputs  # noqa: E402
from rollout_lib.rl.score import env_rubric, function_means  # noqa: E402
from rollout_lib.sampling import SamplingParams  # noqa: E402
from rollout_lib.sampling.base import sample_episodes  # noqa: E402
from test_agents import char_ids, tokenizer  # noqa: E402,F401 - the tiny tokenizer fixture, shared

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TOOLS_TEMPLATE = ROOT / "configs/templates/chatml-tools.jinja"


class ScriptedPolicy:
    """Answers the n-th model call of an episode with turns[n] one character per token, then <|im_end|>, logprob
    -0.25 each (the episode's turn is read from how many assistant turns its sequence holds)."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer = tokenizer
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.turns = [char_ids(tokenizer, text) + [self.end] for text in turns]
        self.sequences: list[list[int]] = []

    def __call__(self, sequences, params, seed):
        answers = []
        for sequence in sequences:
            self.sequences.append(list(sequence))
            done_turns = self.tokenizer.decode(sequence).count("<|im_start|>assistant") - 1
            ids = self.turns[min(done_turns, len(self.turns) - 1)]
            answers.append((list(ids), [-0.25] * len(ids)))
        return answers


def env_settings(env_id: str, **env_args) -> EnvSettings:
    return EnvSettings.model_validate({"name": "vf", "prompts_per_step": 2,
                                       "interaction": {"type": "verifiers", "env_id": env_id, "env_args": env_args}})


def run_episodes(tokenizer, env: EnvSettings, turns: list[str], rows: int = 2, group_size: int = 2):
    prompts = verifiers_prompts(env, "source").slice(0, rows)
    policy = ScriptedPolicy(tokenizer, turns)
    prompt_ids = [encode_prompt(tokenizer, messages) for messages in prompts.column("messages").to_pylist()]
    rollouts = sample_episodes(policy, tokenizer, build_interaction(env.interaction), prompts, prompt_ids,
                               SamplingParams(group_size=group_size, max_tokens=64), 7, [policy.end], 1024)
    return prompts, rollouts, policy


def score(env: EnvSettings, prompts, rollouts):
    with RewardLoops(RewardLoopSettings(timeout_s=60, sync_workers=1)) as loops:  # one worker loads verifiers
        return loops.for_rewards(env.rewards, "rewards", env_rubric(env)).score(reward_inputs(rollouts, prompts))


def test_a_single_turn_env_samples_the_policys_tokens_and_its_rubric_scores_them(tokenizer):
    env = env_settings("vf-reverse-env", raise_on=["god"])  # "dog" is example 1: its rubric function raises
    assert env.source.type == "verifiers" and env.rewards[0].rubric == "verifiers"  # filled in
    prompts, rollouts, policy = run_episodes(tokenizer, env, ["tac"])
    # the dataset as verifiers formats it: its system prompt, then the question; the answer kept
    first = prompts.to_pylist()[0]
    assert first["example_id"] == "vf/0" and first["answer"] == "tac"
    assert first["messages"] == [{"role": "system", "content": "Answer with the reversed word only."},
                                 {"role": "user", "content": "Reverse the word: cat"}]
    rows = rollouts.to_pylist()
    assert [row["sample_id"] for row in rows] == ["vf/0#0", "vf/0#1", "vf/1#0", "vf/1#1"]
    for index, row in enumerate(rows):  # one model call each: the tokens as sampled, on the prompt as rendered
        assert row["completion_ids"] == policy.turns[0] and row["sampling_logprobs"] == [-0.25] * len(policy.turns[0])
        assert row["prompt_ids"] == encode_prompt(tokenizer, prompts.to_pylist()[index // 2]["messages"])
        record = json.loads(row["episode"])
        assert record["sequences"] == 1 and record["state"]["verifiers"]["stop_condition"] == "max_turns_reached"
    results = score(env, prompts, rollouts)
    # exact_reverse 1.0 * 1 + shared_letters 1.0 * 0.5 + answer_length, distinct_answers, num_turns (weight 0)
    assert [r.reward for r in results[:2]] == [1.5, 1.5]
    assert results[0].per_function == {"exact_reverse": 1.0, "shared_letters": 1.0, "answer_length": 3.0,
                                       "distinct_answers": 0.5, "num_turns": 1.0}  # a group's two "tac"s: 1 of 2
    # "tac" is not "god": the failing function's rollouts lose their reward (verifiers would score 0), counted
    for result in results[2:]:
        assert result.reward is None and "shared_letters" in result.error and "told to fail on 'god'" in result.error
        assert result.per_function["exact_reverse"] == 0.0 and result.per_function["shared_letters"] is None
    assert reward_metrics(results)["n_missing"] == 2
    means = function_means(None, results)  # the weight-0 metrics reach the step's metrics too
    assert means["reward/answer_length"] == 3.0 and means["reward/num_turns"] == 1.0
    assert means["reward/distinct_answers"] == 0.5


def test_a_tool_env_runs_its_tool_and_keeps_every_sampled_token():
    tokenizer = use_chat_template(load_tokenizer(resolve_model("tiny:qwen2")), TOOLS_TEMPLATE)
    env = env_settings("vf_tool_env", max_turns=3)  # it stops because no tool was called, not at its limit
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    prompts, rollouts, policy = run_episodes(tokenizer, env, [call, "The answer is 7"], rows=1)
    for row in rollouts.to_pylist():
        record = json.loads(row["episode"])
        assert record["sequences"] == 1 and record["turns"] == 2  # the second call extended the first: no split
        assert record["state"]["verifiers"]["stop_condition"] == "no_tools_called"
        turns = row["completion_turns"]
        assert [(turn["role"], turn["sampled"]) for turn in turns] == [("assistant", True), ("tool", False),
                                                                      ("assistant", True)]
        ids = row["completion_ids"]
        assert ids[:turns[0]["length"]] == policy.turns[0]  # the call as sampled, not as re-rendered
        assert ids[turns[2]["start"]:] == policy.turns[1]
        tool = tokenizer.decode(ids[turns[1]["start"]:turns[1]["start"] + turns[1]["length"]])
        assert "<tool_response>\n7\n</tool_response>" in tool  # the env ran add(3, 4)
        assert row["sampling_logprobs"][turns[1]["start"]] is None  # the env's tokens carry no logprob
        # the second call was conditioned on exactly the first call's tokens, then the rendered tool turn
        assert row["prompt_ids"] + ids[:turns[2]["start"]] in policy.sequences
    _, again, _ = run_episodes(tokenizer, env, [call, "The answer is 7"], rows=1)
    assert again.equals(rollouts)  # no clock, uuid or call id of the environment's leaks into what is stored
    results = score(env, prompts, rollouts)
    assert [r.per_function for r in results] == [{"correct_sum": 1.0, "num_turns": 2.0, "total_tool_calls": 1.0,
                                                  "add_calls": 1.0}] * 2
    assert [r.reward for r in results] == [1.0, 1.0]


def test_held_out_evaluation_reads_the_environments_eval_dataset_and_its_rubric_scores_it(tokenizer):
    from rollout_lib.identity.sources import eval_sources
    from rollout_lib.rl.evaluate import eval_env, load_eval_prompts

    config = load_config(RlConfig, ROOT / "configs/rl-verifiers-single.toml")
    env = config.settings.envs[0]
    held_out = load_eval_prompts(env)  # examples/vf_reverse_env.py's eval_dataset: words the dataset does not have
    assert held_out.column("answer").to_pylist() == ["rats", "kcor", "fael", "niar"]
    assert held_out.column("messages").to_pylist()[0][-1]["content"] == "Reverse the word: star"
    target = eval_env(env)
    assert target.source.split == "eval" and target.sampling.temperature == 0 and target.sampling.group_size == 1
    prompt_ids = [encode_prompt(tokenizer, messages) for messages in held_out.column("messages").to_pylist()]
    policy = ScriptedPolicy(tokenizer, ["rats"])
    rollouts = sample_episodes(policy, tokenizer, build_interaction(env.interaction), held_out, prompt_ids,
                               target.sampling, 7, [policy.end], 1024)
    results = score(env, held_out, rollouts)  # the env's rubric on the held-out rows: only "star" is right
    assert [r.per_function["exact_reverse"] for r in results] == [1.0, 0.0, 0.0, 0.0]
    # The eval's key names the environment module's source (its eval_dataset is made there) and its arguments.
    key = eval_sources(config, env.name)["eval"]["source"]
    assert key["env_args"] == {"num_examples": 8} and list(key["env_source"]) == ["vf_reverse_env"]
    assert key["env_source"]["vf_reverse_env"] != "missing"


def test_settings_checks_name_the_module_and_the_extra(monkeypatch):
    with pytest.raises(ValueError, match="cannot find module 'no_such_env'.*env_id 'owner/no-such-env'"):
        env_settings("owner/no-such-env")
    with pytest.raises(ValueError, match="ends its episodes itself"):
        EnvSettings.model_validate({"name": "vf", "prompts_per_step": 2, "interaction": {
            "type": "verifiers", "env_id": "vf_tool_env", "max_turns": 3}})
    with pytest.raises(ValueError, match='source type "verifiers" is the dataset'):
        EnvSettings.model_validate({"name": "x", "prompts_per_step": 1, "source": {"type": "verifiers"},
                                    "rewards": [{"function": "exact_match"}]})
    with pytest.raises(ValueError, match="eval.source: a verifiers environment's episodes start from its own"):
        EnvSettings.model_validate({"name": "vf", "prompts_per_step": 2, "interaction": {
            "type": "verifiers", "env_id": "vf_tool_env"}, "eval": {"source": {
                "type": "jsonl_path", "path": str(ROOT / "data/rl-tiny-prompts.jsonl")}}})
    with pytest.raises(ValueError, match='eval.source type "verifiers" is a dataset of the env'):
        EnvSettings.model_validate({"name": "x", "prompts_per_step": 1, "rewards": [{"function": "exact_match"}],
                                    "source": {"type": "jsonl_path", "path": str(ROOT / "data/rl-tiny-prompts.jsonl")},
                                    "eval": {"source": {"type": "verifiers", "split": "eval"}}})
    real_version = importlib.metadata.version

    def version_without(installed: str | None):
        def version(name):
            if name != "verifiers":
                return real_version(name)
            if installed is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return installed
        return version

    config = ROOT / "configs/rl-verifiers-single.toml"
    monkeypatch.setattr(importlib.metadata, "version", version_without(None))  # the package's metadata is absent
    with pytest.raises(ConfigError) as missing:
        load_config(RlConfig, config)
    assert str(missing.value).count("\n") == 0
    assert "algorithm.rl.envs[0].interaction" in str(missing.value)
    assert "verifiers is not installed: install the `verifiers` extra (pip install 'rollout[verifiers]'" \
        in str(missing.value)
    monkeypatch.setattr(importlib.metadata, "version", version_without("0.4.0"))
    with pytest.raises(ConfigError, match=r"verifiers 0\.4\.0 is installed.*only 0\.3\.x has"):
        load_config(RlConfig, config)


def test_an_env_whose_load_environment_raises_is_one_line_at_plan_time(tmp_path, monkeypatch):
    from rollout_lib.plan import describe_plan

    (tmp_path / "vf_broken_env.py").write_text("def load_environment(**kwargs):\n"
                                                "    raise RuntimeError('no dataset here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(RlConfig, ROOT / "configs/rl-verifiers-single.toml",
                         ["algorithm.rl.envs[0].interaction.env_id=vf_broken_env"])
    with pytest.raises(DataError, match=r"^algorithm\.rl\.envs\[0\]\.source: verifiers environment 'vf_broken_env' "
                                        r"could not be loaded: RuntimeError: no dataset here$"):
        describe_plan(config)


def test_a_tool_env_without_a_template_that_renders_tools_is_refused_at_plan_time(tmp_path):
    from rollout_lib.plan import describe_plan

    text = (ROOT / "configs/rl-verifiers-tools.toml").read_text()
    assert 'chat_template = "configs/templates/chatml-tools.jinja"\n' in text
    (tmp_path / "rl.toml").write_text(text.replace('chat_template = "configs/templates/chatml-tools.jinja"\n', ""))
    config = load_config(RlConfig, tmp_path / "rl.toml")  # the tiny model's own template: it shows no tools
    with pytest.raises(ConfigError, match=r"algorithm\.rl\.envs\[0\]\.interaction: the policy's chat template does "
                                          r"not render tools.*algorithm\.rl\.chat_template"):
        describe_plan(config)


def test_a_missing_env_module_is_one_line_and_exit_2_from_the_cli():
    done = subprocess.run([sys.executable, "-m", "rollout_cli", "train", "rl", "--config",
                           str(ROOT / "configs/rl-verifiers-single.toml"), "--dry-run",
                           "--set", "algorithm.rl.envs[0].interaction.env_id=vf_not_installed"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "algorithm.rl.envs[0].interaction" in lines[0], done.stderr
    assert "cannot find module 'vf_not_installed'" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("config_name, metric", [("rl-verifiers-single", "reward/distinct_answers"),
                                                 ("rl-verifiers-tools", "reward/total_tool_calls")])
def test_two_steps_of_each_example_through_the_cli(prefect_server, tmp_path, config_name, metric):
    from clirun import run_rollout

    done = run_rollout("train", "rl", "--config", str(ROOT / f"configs/{config_name}.toml"), "--max-steps", "2",
                       "--set", f"run.store={tmp_path / 'store'}", PYTHONPATH=str(EXAMPLES))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = [json.loads(line) for line in
               (tmp_path / f"store/runs/{config_name}/metrics.jsonl").read_text().splitlines()]
    if config_name == "rl-verifiers-single":  # held-out on its eval_dataset before step 1 and at step 2
        assert [m["step"] for m in metrics if "eval/vf-reverse/reward_mean" in m] == [0, 2]
        assert all(m["eval/vf-reverse/missing_rewards"] == 0 for m in metrics if m["step"] in (0, 2))
        metrics = [m for m in metrics if m["step"] > 0]
    assert [m["step"] for m in metrics] == [1, 2]
    for step in metrics:  # every episode asked the policy at least once; the rubric's metrics are in the step's
        assert step["rollouts"] == 4 and step["agent_requests_mean"] >= 1 and step["agent_failures"] == 0
        assert step["completion_len_mean"] > 0 and step["verifiers_prompt_too_long"] == 0
        assert step[metric] is not None and step["reward/num_turns"] >= 1 and step["missing_rewards"] == 0


def test_an_environment_that_raises_fails_its_episode_counted_never_the_step(tmp_path, monkeypatch, tokenizer):
    (tmp_path / "vf_raising_env.py").write_text(
        "from datasets import Dataset\nimport verifiers as vf\n\n\n"
        "class Raising(vf.MultiTurnEnv):\n"
        "    async def env_response(self, messages, state, **kwargs):\n"
        "        raise KeyError('the environment broke')\n\n\n"
        "def load_environment():\n"
        "    return Raising(dataset=Dataset.from_list([{'question': 'Hi?', 'answer': 'x'}]), max_turns=3,\n"
        "                   rubric=vf.Rubric(funcs=[lambda completion: 1.0]))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = env_settings("vf_raising_env")
    prompts, rollouts, _ = run_episodes(tokenizer, env, ["Hello"], rows=1, group_size=1)
    (row,) = rollouts.to_pylist()
    record = json.loads(row["episode"])
    assert record["end"] == "error" and record["turns"] == 1  # the first turn was sampled, then the env raised
    assert "KeyError: 'the environment broke'" in record["state"]["episode_error"]
    (result,) = score(env, prompts, rollouts)
    assert result.reward is None and "the environment broke" in result.error


def test_a_nan_from_a_rubric_function_is_a_missing_reward_and_a_bool_counts_as_verifiers_reads_it(
        tmp_path, monkeypatch, tokenizer):
    (tmp_path / "vf_nan_env.py").write_text(
        "from datasets import Dataset\nimport verifiers as vf\n\n\n"
        "def said_hello(completion) -> bool:\n"
        "    return 'Hello' in completion[-1].content\n\n\n"
        "async def unmeasurable(completion, answer) -> float:\n"
        "    return float('nan') if answer == 'b' else 0.5\n\n\n"
        "def load_environment():\n"
        "    rows = [{'question': 'Hi?', 'answer': 'a'}, {'question': 'Yo?', 'answer': 'b'}]\n"
        "    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows),\n"
        "                            rubric=vf.Rubric(funcs=[said_hello, unmeasurable], weights=[1.0, 1.0]))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = env_settings("vf_nan_env")
    prompts, rollouts, _ = run_episodes(tokenizer, env, ["Hello"], rows=2, group_size=1)
    first, second = score(env, prompts, rollouts)
    assert first.reward == 1.5 and first.per_function == {"said_hello": 1.0, "unmeasurable": 0.5, "num_turns": 1.0}
    assert second.reward is None and "reward is not finite: nan" in second.error  # never 0, as verifiers' would be
    assert "unmeasurable" in second.error


VF_GROUP_ENV = '''from datasets import Dataset
import verifiers as vf


def said_yes(completion) -> float:
    return float("yes" in completion[-1].content)


def longest(completions, answers, parser) -> list[float]:  # a group function: 1 for the group's longest answer
    if "b" in answers:
        raise RuntimeError("longest was told to fail on 'b'")
    lengths = [len(parser.parse_answer(completion) or "") for completion in completions]
    return [float(k == lengths.index(max(lengths))) for k in range(len(lengths))]


async def group_size(states) -> list[float]:  # an async group metric (weight 0)
    return [float(len(states))] * len(states)


def load_environment():
    rows = Dataset.from_list([{"question": "A?", "answer": "a"}, {"question": "B?", "answer": "b"}])
    return vf.SingleTurnEnv(dataset=rows, eval_dataset=rows, rubric=vf.Rubric(
        funcs=[said_yes, longest, group_size], weights=[1.0, 0.5, 0.0]))
'''


class CyclingPolicy(ScriptedPolicy):
    """Answers its n-th request with turns[n % len(turns)], so the members of a group differ."""

    def __call__(self, sequences, params, seed):
        answers = []
        for sequence in sequences:
            ids = self.turns[len(self.sequences) % len(self.turns)]
            self.sequences.append(list(sequence))
            answers.append((list(ids), [-0.25] * len(ids)))
        return answers


def test_group_rubric_functions_score_each_group_as_verifiers_does_staged_streamed_or_chunked(
        tmp_path, monkeypatch, tokenizer):
    import asyncio

    import pyarrow as pa

    from rollout_lib.envs.verifiers_rubric import rebuilt_state
    from rollout_lib.envs.verifiers_env import load_verifiers_environment
    from rollout_lib.rl.score import chunk_rows, merged_results, reward_results
    from rollout_lib.rl.streamed import StreamedScoring

    (tmp_path / "vf_group_env.py").write_text(VF_GROUP_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(RlConfig, ROOT / "configs/rl-verifiers-single.toml", [
        "algorithm.rl.envs[0].interaction.env_id=vf_group_env", "algorithm.rl.envs[0].interaction.env_args={}",
        "algorithm.rl.envs[0].sampling.group_size=3", "algorithm.rl.reward_loop.sync_workers=1",
        "algorithm.rl.reward_loop.timeout_s=60"])
    env = config.settings.envs[0]
    prompts = verifiers_prompts(env, "source")
    policy = CyclingPolicy(tokenizer, ["yes", "no yes", "n"])
    rollouts = sample_episodes(policy, tokenizer, build_interaction(env.interaction), prompts,
                               [encode_prompt(tokenizer, m) for m in prompts.column("messages").to_pylist()],
                               env.sampling.model_copy(update={"max_tokens": 64}), 7, [policy.end], 1024)
    assert rollouts.column("example_id").to_pylist() == ["vf-reverse/0"] * 3 + ["vf-reverse/1"] * 3
    tables = {env.name: prompts}
    with RewardLoops(config.settings.reward_loop) as loops:
        staged, _ = reward_results(config, rollouts, tables, loops)
        with StreamedScoring(config, loops) as streamed:  # each row handed over as it would end: last row first
            hand_over = streamed.stream_to(env.name, prompts)
            for index, record in reversed(list(enumerate(rollouts.to_pylist()))):
                hand_over(index, record)
            assert streamed.results(rollouts, tables)[0] == staged
        chunks = [reward_results(config, rollouts.take(pa.array(chunk_rows(rollouts, chunk, 3), pa.int64())),
                                 tables, loops)[0] for chunk in range(3)]  # two groups in three chunks: each whole in one, one chunk empty
        assert merged_results(rollouts, chunks) == staged
    # verifiers' own Rubric.score_group on the first group's states gives the same rewards and function values
    states = [rebuilt_state(item) for item in reward_inputs(rollouts.slice(0, 3), prompts)]
    asyncio.run(load_verifiers_environment(env.interaction).rubric.score_group(states))
    assert [r.reward for r in staged[:3]] == [state["reward"] for state in states] == [1.0, 1.5, 0.0]
    assert [r.per_function for r in staged[:3]] == [state["metrics"] for state in states]
    assert staged[1].per_function == {"said_yes": 1.0, "longest": 1.0, "group_size": 3.0, "num_turns": 1.0}
    # the raising group function: the second group's rewards missing with its reason (verifiers would score 0)
    for result in staged[3:]:
        assert result.reward is None and result.per_function["longest"] is None
        assert result.error == "RuntimeError: reward fn 'longest': longest was told to fail on 'b'"
    means = function_means(None, staged)  # a group metric's mean reaches the step's metrics as any function's
    assert means["reward/group_size"] == 3.0 and means["reward/longest"] == 1 / 3
