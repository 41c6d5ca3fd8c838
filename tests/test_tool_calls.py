"""OpenAI-format tool calls in the episode driver (envs/tool_calls.py, envs/tools/): calls parsed from the sampled
text, run with a time limit, answered by tool messages carrying their call ids, rendered token-exactly after the
sampled tokens by a tools-capable chat template (configs/templates/chatml-tools.jinja); every failure is a tool
error the model reads and the step counts; a template that cannot render tools is refused before anything runs.

The policy is scripted (a generate function writing fixed turns through the real tiny tokenizer), as in
test_multiturn.py, so the expected token sequence is known exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from rollout_lib import wire
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.plan_checks import load_config, validate_config
from rollout_lib.identity.training import training_hash
from rollout_lib.config.loading import apply_overrides, read_toml
from rollout_lib.envs import EnvReply, build_interaction
from rollout_lib.envs.tool_calls import ToolCallsSettings
from rollout_lib.envs.tools import ToolSettings
from rollout_lib.envs.tools.parsers.hermes import parse_hermes
from rollout_lib.model.chat import encode_prompt, tool_template_problem, use_chat_template
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.model.tiny import CHAT_TEMPLATE as TINY_TEMPLATE
from rollout_lib.rl.sample import tool_call_metrics
from rollout_lib.sampling import SamplingParams
from rollout_lib.sampling.base import sample_episodes

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "configs/templates/chatml-tools.jinja"
CONFIG = ROOT / "configs/rl-calculator.toml"
# The shipped calculator on the random tiny model, framed by the full-schema template, at a machinery test's size:
# calls parsed, run and answered, nothing learned (the warm-started run is measured in docs/environments.md).
MACHINERY = ["algorithm.rl.base_model=tiny:qwen2", f"algorithm.rl.chat_template={TEMPLATE}",
             "algorithm.rl.max_seq_len=768",  # the tools' schemas in the system turn take ~420 tiny tokens
             "algorithm.rl.envs[0].prompts_per_step=2", "algorithm.rl.envs[0].sampling.group_size=4",
             "algorithm.rl.envs[0].sampling.max_tokens=96", "algorithm.rl.envs[0].interaction.max_turns=2"]
QUESTION = [{"role": "user", "content": "What is 37 * 24?"}]
CALCULATE = "rollout_lib.envs.tools.calculate:calculate"


@pytest.fixture(scope="module")
def tokenizer():
    return use_chat_template(load_tokenizer(resolve_model("tiny:qwen2")), str(TEMPLATE))


def machinery_config(*overrides: str) -> RlConfig:
    return load_config(RlConfig, CONFIG, [*MACHINERY, *overrides])


def machinery_raw() -> dict:
    return apply_overrides(read_toml(CONFIG), MACHINERY)


def call(name: str, arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def char_ids(tokenizer, text: str) -> list[int]:
    """`text` one character per token: ids no tokenizer would produce from the text, so a re-tokenized turn shows."""
    return [token for char in text for token in tokenizer(char, add_special_tokens=False)["input_ids"]]


def scripted_policy(tokenizer, turns: list[str], encode=None):
    """A generate function whose k-th turn (counted per sequence from the assistant turns in it) is turns[k]."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    encode = encode or (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(sequences, params, seed):
        outputs = []
        for sequence in sequences:
            k = tokenizer.decode(sequence).count("<|im_start|>assistant") - 1
            ids = encode(turns[k]) + [end]
            outputs.append((ids, [-0.5] * len(ids)))
        return outputs

    return generate


def prompts_table() -> pa.Table:
    return pa.Table.from_pylist([{"example_id": "q0", "env": "calc", "messages": QUESTION, "answer": "888",
                                  "info": None, "source_line": 1}], schema=wire.PROMPTS)


def tool_episode(tokenizer, turns: list[str], tools: list, max_turns: int = 3, encode=None, **settings) -> dict:
    interaction = build_interaction(ToolCallsSettings(max_turns=max_turns, **settings),
                                    [ToolSettings.model_validate(tool) for tool in tools])
    prompt_ids = [encode_prompt(tokenizer, QUESTION, interaction.tool_schemas)]
    table = sample_episodes(scripted_policy(tokenizer, turns, encode), tokenizer, interaction, prompts_table(),
                            prompt_ids, SamplingParams(group_size=1, max_tokens=64), seed=0,
                            stop_ids=[tokenizer.eos_token_id], context_limit=2048)
    return table.to_pylist()[0]


# --- parsing --------------------------------------------------------------------------------------------------


def test_hermes_parses_each_call_and_strips_well_formed_ones_from_the_content():
    text = "Let me compute.\n" + call("calculate", {"expression": "37 * 24"}) + "\n" + call("add", {"a": 1, "b": 2})
    parsed = parse_hermes(text)
    assert parsed.content == "Let me compute."
    assert [(c.name, c.arguments, c.problem) for c in parsed.calls] == [
        ("calculate", {"expression": "37 * 24"}, None), ("add", {"a": 1, "b": 2}, None)]
    assert parse_hermes("The answer is 888.").calls == []


@pytest.mark.parametrize("text, problem", [
    ("<tool_call>{not json}</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>["calculate"]</tool_call>', "JSON object"),
    ('<tool_call>{"name": "calculate", "arguments": [1]}</tool_call>', "not a JSON object"),
    ('<tool_call>{"name": "calculate", "arguments": {}}', "without its closing"),
])
def test_hermes_reports_a_malformed_call_and_keeps_it_in_the_content(text, problem):
    parsed = parse_hermes(text)
    assert len(parsed.calls) == 1 and problem in parsed.calls[0].problem
    assert parsed.content == text.strip()


def test_hermes_reads_arguments_written_as_a_json_string():
    parsed = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert parsed.calls[0].arguments == {"x": 1}


# --- the episode, token-exact ---------------------------------------------------------------------------------


def test_a_tool_call_episode_is_the_template_rendering_with_ids_sampled_verbatim(tokenizer):
    first = call("calculate", {"expression": "37 * 24"})
    row = tool_episode(tokenizer, [first, "The answer is 888."], [CALCULATE],
                       encode=lambda text: char_ids(tokenizer, text))
    schema = build_interaction(ToolCallsSettings(), [ToolSettings.model_validate(CALCULATE)]).tool_schemas
    conversation = [*QUESTION,
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1_0", "type": "function",
                                                                         "function": {"name": "calculate", "arguments":
                                                                                      {"expression": "37 * 24"}}}]},
                    {"role": "tool", "tool_call_id": "call_1_0", "name": "calculate", "content": "888"},
                    {"role": "assistant", "content": "The answer is 888."}]
    rendered = tokenizer.apply_chat_template(conversation, tools=schema, tokenize=False).removesuffix("\n")
    # The prompt shows the tool's schema; the whole episode decodes to the template's rendering of the conversation
    # with the structured call, while the model's tokens are the ones it "sampled" (one per character), not the
    # tokenizer's encoding of its text.
    assert '"name": "calculate"' in tokenizer.decode(row["prompt_ids"])
    assert tokenizer.decode(row["prompt_ids"] + row["completion_ids"]) == rendered
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert row["completion_ids"][:len(first) + 1] == char_ids(tokenizer, first) + [end]
    assert char_ids(tokenizer, first) != tokenizer(first, add_special_tokens=False)["input_ids"]

    turns = row["completion_turns"]
    assert [(t["role"], t["sampled"]) for t in turns] == [("assistant", True), ("tool", False), ("assistant", True)]
    tool = turns[1]
    tool_ids = row["completion_ids"][tool["start"]:tool["start"] + tool["length"]]
    assert tokenizer.decode(tool_ids) == ("\n<|im_start|>user\n<tool_response>\n888\n</tool_response><|im_end|>\n"
                                          "<|im_start|>assistant\n")
    assert tool_ids == tokenizer(tokenizer.decode(tool_ids), add_special_tokens=False)["input_ids"]  # as rendered
    assert tokenizer.decode(row["completion_ids"][tool["body_start"]:tool["body_start"] + tool["body_length"]]) == "888"
    assert json.loads(row["episode"]) == {"end": "env", "turns": 2, "tool_calls": 1, "tool_errors": 0,
                                          "state": {"tool_calls": 1, "tool_errors": 0}}


def test_call_ids_are_per_turn_and_index_and_several_calls_get_one_message_each(tokenizer):
    interaction = build_interaction(ToolCallsSettings(), [ToolSettings.model_validate(CALCULATE),
                                                          ToolSettings.model_validate("example_tools:add")])
    state = interaction.start({})
    text = call("calculate", {"expression": "6 * 7"}) + "\n" + call("add", {"a": 2, "b": 3})
    messages = [*QUESTION, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "y"},
                {"role": "assistant", "content": text}]
    reply = interaction.respond(state, messages)
    assert reply.messages == [{"role": "tool", "tool_call_id": "call_2_0", "name": "calculate", "content": "42"},
                              {"role": "tool", "tool_call_id": "call_2_1", "name": "add", "content": "5"}]
    assert [c["id"] for c in reply.assistant["tool_calls"]] == ["call_2_0", "call_2_1"]
    assert reply.assistant["tool_calls"][1]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert interaction.respond(state, messages) == reply  # a rerun replays the same ids and results


def test_every_failed_call_is_a_tool_error_the_model_reads_and_the_step_counts(tokenizer):
    failing = "\n".join([call("search", {"q": "x"}), call("explode", {"reason": "boom"}), call("hang", {"seconds": 5}),
                         call("calculate", {"expr": "1 + 1"}), "<tool_call>{oops</tool_call>",
                         call("calculate", {"expression": "2 ** 10"})])
    row = tool_episode(tokenizer, [failing, "The answer is 888."],
                       [CALCULATE, "example_tools:explode", "example_tools:hang"], timeout_s=0.3, max_calls_per_turn=5)
    tool_turns = [t for t in row["completion_turns"] if t["role"] == "tool"]
    contents = [t["content"] for t in tool_turns]
    assert contents[0] == "error: unknown tool 'search'; tools: calculate, explode, hang"
    assert contents[1] == "error: explode raised RuntimeError: boom"
    assert contents[2] == "error: hang timed out after 0.3 s"
    assert contents[3].startswith("error: calculate: bad arguments (") and "expr" in contents[3]
    assert contents[4].startswith("error: the tool call is not JSON (")
    assert contents[5] == "error: more than 5 tool calls in one turn; this one was not run"
    # Each rendered in its own tool_response, token-exactly after the sampled turn; the episode went on to answer.
    decoded = tokenizer.decode(row["prompt_ids"] + row["completion_ids"])
    assert all(f"<tool_response>\n{content}\n</tool_response>" in decoded for content in contents)
    record = json.loads(row["episode"])
    assert (record["end"], record["tool_calls"], record["tool_errors"]) == ("env", 6, 6)
    metrics = tool_call_metrics([record, {**record, "tool_calls": 2, "tool_errors": 0}])
    assert metrics == {"tool_calls_mean": 4.0, "tool_call_error_fraction": 0.75}


def test_an_async_tool_runs_and_a_turn_without_calls_ends_the_episode(tokenizer):
    row = tool_episode(tokenizer, [call("add", {"a": 20, "b": 22}), "42"], ["example_tools:add"])
    assert [t["content"] for t in row["completion_turns"]] == [call("add", {"a": 20, "b": 22}), "42", "42"]
    assert json.loads(row["episode"])["end"] == "env"
    assert tool_call_metrics([json.loads(row["episode"])]) == {"tool_calls_mean": 1.0, "tool_call_error_fraction": 0.0}


def test_env_replies_admit_tool_call_ids_and_names_on_tool_messages_only():
    assert EnvReply(messages=[{"role": "tool", "tool_call_id": "call_1_0", "name": "f", "content": "1"}])
    with pytest.raises(ValueError, match="an env message is"):
        EnvReply(messages=[{"role": "user", "tool_call_id": "call_1_0", "content": "1"}])
    with pytest.raises(ValueError, match="an env message is"):
        EnvReply(messages=[{"role": "tool", "content": "1", "extra": "x"}])
    with pytest.raises(ValueError, match="EnvReply.assistant is"):
        EnvReply(messages=[{"role": "tool", "content": "1"}],
                 assistant={"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {}}]})
    with pytest.raises(ValueError, match="tool_errors"):
        EnvReply(messages=[{"role": "user", "content": "1"}], tool_errors=1)


def test_the_sample_stage_frames_prompts_with_the_tools_records_tool_messages_and_counts_calls(tokenizer):
    from rollout_lib.envs.tools.calculate import calculate_answer, calculate_call_ran
    from rollout_lib.reward.tables import reward_inputs
    from rollout_lib.rl.prompts import load_prompts
    from rollout_lib.rl.sample import sample_rollouts
    from rollout_lib.sampling.base import Sampler

    policy = scripted_policy(tokenizer, [call("calculate", {"expression": "56 * 77"}), "It is 4312."])

    class Scripted(Sampler):  # the stage's own Sampler.sample (framing, episodes, rows) around a scripted generate
        def generate(self, sequences, params, seed):
            return policy(sequences, params, seed)

    config = machinery_config()
    env = config.settings.envs[0]
    prompts = load_prompts(env)
    rollouts, metrics = sample_rollouts(config, {env.name: Scripted(None, None, tokenizer)}, {env.name: prompts}, 1)
    assert (metrics["tool_calls_mean"], metrics["tool_call_error_fraction"], metrics["turns_mean"]) == (1.0, 0.0, 2.0)
    rows = rollouts.to_pylist()
    assert len(rows) == env.prompts_per_step * env.sampling.group_size
    for row in rows:
        assert "<tools>" in tokenizer.decode(row["prompt_ids"]) and '"name": "calculate"' in tokenizer.decode(
            row["prompt_ids"])
        assert [(t["role"], t["content"]) for t in row["completion_turns"] if not t["sampled"]] == [("tool", "4312")]
    chosen = {row["example_id"]: row["answer"] for row in prompts.to_pylist()}
    scores = [calculate_answer(inp) for inp in reward_inputs(rollouts)]
    assert scores == [float(chosen[row["example_id"]] == "4312") for row in rows]
    assert [calculate_call_ran(inp) for inp in reward_inputs(rollouts)] == [1.0] * len(rows)  # the call ran


def test_the_call_bonus_is_for_calls_that_ran_and_gave_a_number():
    from rollout_lib.envs.tools.calculate import calculate_call_ran
    from rollout_lib.reward.contract import RewardInput

    def episode(*results: str, errors: int = 0) -> RewardInput:
        turns = [{"role": "assistant", "content": ""}]
        turns += [{"role": "tool", "content": result} for result in results]
        turns += [{"role": "assistant", "content": "It is 888."}]
        return RewardInput(prompt=[], completion_text="It is 888.", answer="888", turns=turns,
                           state={"tool_calls": len(results), "tool_errors": errors})

    assert calculate_call_ran(episode("888")) == 1.0
    assert calculate_call_ran(RewardInput(prompt=[], completion_text="888", answer="888",
                                          turns=[{"role": "assistant", "content": "888"}],
                                          state={"tool_calls": 0, "tool_errors": 0})) == 0.0  # no call
    assert calculate_call_ran(episode("error: the tool call is not JSON (...)", errors=1)) == 0.0  # malformed
    assert calculate_call_ran(episode("error: name 'x' is not allowed; use numbers")) == 0.0  # the calculator refused
    assert calculate_call_ran(episode("888", "error: operator ** is not allowed")) == 0.0  # one of two failed


# --- the template requirement, settings and identity ------------------------------------------------------------


def test_the_shipped_template_renders_tools_and_the_tiny_one_does_not():
    tiny = load_tokenizer(resolve_model("tiny:qwen2"))
    assert "does not render the tools, the call's name, the call's arguments" in tool_template_problem(tiny)
    assert tool_template_problem(use_chat_template(tiny, str(TEMPLATE))) is None
    # Without tools the shipped template frames a conversation as the tiny model's own ChatML does.
    plain = [{"role": "system", "content": "Be brief."}, *QUESTION, {"role": "assistant", "content": "888"}]
    tiny.chat_template = TINY_TEMPLATE
    ours = use_chat_template(load_tokenizer(resolve_model("tiny:qwen2")), str(TEMPLATE))
    assert ours.apply_chat_template(plain, tokenize=False) == tiny.apply_chat_template(plain, tokenize=False)


def test_an_env_with_tools_and_a_template_without_them_is_refused_in_one_line_before_anything_runs(
        tmp_path, monkeypatch, capsys):
    from rollout_cli.main import main

    monkeypatch.chdir(ROOT)
    (tmp_path / "plain.jinja").write_text(TINY_TEMPLATE)
    sets = [arg for setting in [*MACHINERY, f"algorithm.rl.chat_template={tmp_path / 'plain.jinja'}"]
            for arg in ("--set", setting)]
    code = main(["train", "rl", "--config", "configs/rl-calculator.toml", "--dry-run", *sets])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "algorithm.rl.envs[0].tools: algorithm.rl.chat_template (" in err
    assert "does not render tools or tool calls" in err

    from rollout_lib.plan import describe_plan

    raw = machinery_raw()
    del raw["algorithm"]["rl"]["chat_template"]
    with pytest.raises(ConfigError) as refused:
        describe_plan(validate_config(RlConfig, raw))
    assert str(refused.value).startswith("algorithm.rl.envs[0].tools: the policy's chat template does not render "
                                         "tools or tool calls")
    assert "give one that does in algorithm.rl.chat_template (e.g. configs/templates/chatml-tools.jinja)" in str(
        refused.value)


@pytest.mark.parametrize("change, expected", [
    ({"tools": ["no_such_module:f"]},
     "algorithm.rl.envs[0].tools[0]: tool function 'no_such_module:f': cannot find module 'no_such_module'"),
    ({"tools": [CALCULATE, "rollout_lib.envs.tools.calculate:nope"]},
     "algorithm.rl.envs[0].tools[1]: tool function 'rollout_lib.envs.tools.calculate:nope': "),
    ({"interaction": {"type": "calculator"}}, 'tools are called through interaction = { type = "tools" }'),
    ({"tools": []}, 'interaction type "tools" needs tools'),
    ({"tools": [CALCULATE, CALCULATE]}, "two tools named 'calculate'"),
    ({"interaction": {"type": "tools", "parser": "nope"}}, "no tool-call parser 'nope' (known: hermes)"),
])
def test_tool_settings_fail_naming_the_setting(change, expected):
    raw = machinery_raw()
    raw["algorithm"]["rl"]["envs"][0].update(change)
    with pytest.raises(ConfigError) as failed:
        validate_config(RlConfig, raw)
    assert expected in str(failed.value) and str(failed.value).startswith("algorithm.rl.envs[0]")


def test_the_tools_and_the_template_are_in_the_training_identity(tmp_path):
    base = machinery_config()
    other_tool = machinery_config('algorithm.rl.envs[0].tools=["example_tools:add"]')
    schema = {"name": "calculate", "description": "Arithmetic.", "parameters": {"type": "object", "properties": {}}}
    schema_tool = validate_config(RlConfig, _with_tools(machinery_raw(), [
        {"type": "function", "import_path": CALCULATE, "function": schema}]))
    copy = tmp_path / "template.jinja"
    copy.write_text(TEMPLATE.read_text())
    same_template = training_hash(machinery_config(f"algorithm.rl.chat_template={copy}"))
    copy.write_text(TEMPLATE.read_text().replace("You may call functions.", "You may call tools."))
    edited_template = training_hash(machinery_config(f"algorithm.rl.chat_template={copy}"))
    assert same_template == training_hash(base)  # its content, not its path
    hashes = {training_hash(base), training_hash(other_tool), training_hash(schema_tool), edited_template}
    assert len(hashes) == 4


def test_a_tool_module_outside_the_project_is_in_the_sample_stage_key(tmp_path, monkeypatch):
    from rollout_lib.identity.sources import interaction_sources

    (tmp_path / "my_tools.py").write_text('def f(x: int) -> int:\n    """F.\n\n    Args:\n        x: x\n    """\n'
                                          '    return x\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    config = validate_config(RlConfig, _with_tools(machinery_raw(), [CALCULATE, "my_tools:f"]))
    before = interaction_sources(config)
    assert list(before["interaction_sources"]) == ["my_tools"]  # the project's own tools are in its code version
    (tmp_path / "my_tools.py").write_text((tmp_path / "my_tools.py").read_text().replace("return x", "return -x"))
    assert interaction_sources(config) != before


def test_a_tool_without_a_schema_fails_when_the_episodes_start_naming_its_setting(tmp_path, monkeypatch):
    from rollout_lib.rl.sample import env_interaction

    (tmp_path / "bare_tools.py").write_text("def g(x):\n    return x\n")  # no type hints, no docstring
    monkeypatch.syspath_prepend(str(tmp_path))
    config = validate_config(RlConfig, _with_tools(machinery_raw(), [CALCULATE, "bare_tools:g"]))  # found: valid
    with pytest.raises(ConfigError) as failed:
        env_interaction(config, 0)
    assert str(failed.value).startswith("algorithm.rl.envs[0].tools[1]: tool function 'bare_tools:g': no schema "
                                        "from its signature and docstring")


def _with_tools(raw: dict, tools: list) -> dict:
    raw["algorithm"]["rl"]["envs"][0]["tools"] = tools
    return raw


# --- end to end ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rollout_train_rl_runs_a_tools_env_and_records_its_episodes_and_tool_metrics(prefect_server, tmp_path):
    """The shipped config through the CLI, on the random tiny model (MACHINERY). It writes no call (the warm start
    that does, configs/sft-calculator-tools-tiny.toml, takes minutes to train), so the run shows the framing, the
    episode records and the metrics; test_the_sample_stage_... shows calls answered inside the same stage."""
    from clirun import final_result, run_rollout
    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.runlog.step_tables import read_step_tables
    from rollout_lib.store import ObjectStore

    store = ObjectStore(str(tmp_path / "store"))
    sets = [arg for setting in MACHINERY for arg in ("--set", setting)]
    run = run_rollout("train", "rl", "--config", "configs/rl-calculator.toml", *sets, "--max-steps", "2",
                      "--store", store.root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(final_result(run)["reward_curve"]) == 2
    steps = read_metrics(store, "rl-calculator")
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        assert step["tool_calls_mean"] >= 0 and 0 <= step["tool_call_error_fraction"] <= 1, step
    tokenizer = use_chat_template(load_tokenizer(resolve_model("tiny:qwen2")), str(TEMPLATE))
    for step in (1, 2):
        scored = read_step_tables(store, "rl-calculator", step)["scored"]
        rows = store.get_table(scored, wire.ROLLOUTS).to_pylist()
        assert len(rows) == 8
        for row in rows:
            record = json.loads(row["episode"])
            assert record["tool_calls"] == record["state"]["tool_calls"] and record["end"] in ("env", "truncated",
                                                                                             "max_turns", "context")
            assert '<tools>\n{"type": "function", "function": {"name": "calculate"' in tokenizer.decode(
                row["prompt_ids"])
            tool_turns = [turn for turn in row["completion_turns"] if turn["role"] == "tool"]
            assert len(tool_turns) <= record["tool_calls"]  # each tool message written answers a counted call
