"""SFT on tool-call conversations (data/tool_messages.py, sft/tokenize.py): a row's `tools` and its assistant's
OpenAI `tool_calls` render through the chat template given in `algorithm.sft.chat_template`, the loss covers the
calls and the final answer but never the tools' schemas or the tool results, bad rows fail naming `path:line:`,
data with tools and a template that ignores them is refused before anything runs, and the template's content is
in the training identity only when set."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollout_lib.config import SftConfig
from rollout_lib.data import DataError, load_examples
from rollout_lib.data.tool_messages import template_messages, template_tools
from rollout_lib.identity.data_keys import sft_tokenizer_reads
from rollout_lib.identity.training import training_hash, training_settings
from rollout_lib.model.chat import use_chat_template
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.plan_checks import load_config
from rollout_lib.sft.tokenize import sft_tokenizer, tokenize_examples
from test_sft_tokenize import trained_text  # the trained tokens, decoded run by run

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "configs/templates/chatml-tools.jinja"
TOOL = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def row(arguments=None, **call_changes) -> dict:
    """system, user, an assistant turn that calls the tool, its result, the final answer."""
    function = {"name": "calculate", "arguments": {"expression": "27 * 682"} if arguments is None else arguments}
    function.update(call_changes)
    return {"tools": [TOOL], "messages": [
        {"role": "system", "content": "You have a calculator."},
        {"role": "user", "content": "What is 27 * 682?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function",
                                                               "function": function}]},
        {"role": "tool", "tool_call_id": "call_0", "name": "calculate", "content": "18414"},
        {"role": "assistant", "content": "27 * 682 = 18414."}]}


def write_rows(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return use_chat_template(load_tokenizer(resolve_model("tiny:qwen2")), str(TEMPLATE))


def test_a_tool_call_row_is_the_templates_rendering_and_trains_the_calls_and_the_answer_only(tokenizer, tmp_path):
    data = write_rows(tmp_path / "tools.jsonl", row(), row(arguments='{"expression": "27 * 682"}'))
    examples = load_examples(data)
    samples = tokenize_examples(examples, tokenizer, loss_on="assistant_only", max_seq_len=2048).samples.to_pylist()

    expected = tokenizer.apply_chat_template(row()["messages"], tools=[TOOL], tokenize=True, return_dict=True)
    assert samples[0]["input_ids"] == list(expected["input_ids"])
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "27 * 682"}}\n</tool_call><|im_end|>'
    assert trained_text(tokenizer, samples[0]["input_ids"], samples[0]["loss_mask"]) == [
        call, "27 * 682 = 18414.<|im_end|>"]
    text = tokenizer.decode(samples[0]["input_ids"])
    assert '"description": "Evaluate an arithmetic expression exactly."' in text  # the schema is shown, untrained
    assert "<tool_response>\n18414\n</tool_response>" in text  # the result is shown, untrained
    # Arguments as the JSON text the OpenAI API returns: the same call, the same tokens.
    assert samples[1]["input_ids"] == samples[0]["input_ids"] and samples[1]["loss_mask"] == samples[0]["loss_mask"]
    assert samples[0]["ce_weights"] == [float(keep) for keep in samples[0]["loss_mask"]]


def test_a_template_without_generation_tags_locates_the_same_turns_by_prefixes(tokenizer, tmp_path):
    untagged = use_chat_template(load_tokenizer(resolve_model("tiny:qwen2")), str(TEMPLATE))
    untagged.chat_template = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", untagged.chat_template)
    examples = load_examples(write_rows(tmp_path / "tools.jsonl", row()))
    tagged, diffed = (tokenize_examples(examples, tok, loss_on="assistant_only", max_seq_len=2048).samples.to_pylist()[0]
                      for tok in (tokenizer, untagged))
    assert diffed["input_ids"] == tagged["input_ids"]
    assert trained_text(untagged, diffed["input_ids"], diffed["loss_mask"]) == trained_text(
        tokenizer, tagged["input_ids"], tagged["loss_mask"])


def test_rows_keep_what_the_template_takes_and_plain_rows_stay_plain(tmp_path):
    examples = load_examples(write_rows(tmp_path / "d.jsonl", row(), {"prompt": "Q", "completion": "A"}))
    tools, messages = examples["tools"].to_pylist(), examples["messages"].to_pylist()
    assert template_tools(tools[0]) == [TOOL] and tools[1] is None
    assert template_messages(messages[0])[2:4] == [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": "calculate", "arguments": {"expression": "27 * 682"}}}]},
        {"role": "tool", "content": "18414", "tool_call_id": "call_0", "name": "calculate"}]
    assert template_messages(messages[1]) == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]


@pytest.mark.parametrize("bad, expected", [
    (row(name=None), "messages[2].tool_calls[0].function: a call needs a 'name' (the tool's), got None"),
    (row(arguments='{"expression": '), "messages[2].tool_calls[0].function.arguments: not JSON"),
    (row(arguments=["27 * 682"]), "messages[2].tool_calls[0].function.arguments: must be an object"),
    ({**row(), "tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0]: must be"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "tool_call_id": "c"}]},
     "messages[1]: must be an object with exactly 'role' and 'content' (and optionally 'tool_calls')"),
])
def test_a_bad_tool_row_fails_naming_its_file_and_line(tmp_path, bad, expected):
    path = write_rows(tmp_path / "bad.jsonl", {"prompt": "Q", "completion": "A"}, bad)
    with pytest.raises(DataError) as failed:
        load_examples(path)
    assert str(failed.value).startswith(f"{path}:2: ") and expected in str(failed.value), failed.value


def sft_config_with_tools(tmp_path) -> Path:
    """configs/sft-tiny.toml on a tool-call dataset, without a chat template that renders tools."""
    data = write_rows(tmp_path / "tools.jsonl", row(), row())
    text = (ROOT / "configs/sft-tiny.toml").read_text().replace('"data/sft-tiny.jsonl"', f'"{data}"')
    assert str(data) in text
    config = tmp_path / "sft.toml"
    config.write_text(text)
    return config


def test_tool_data_with_a_template_that_ignores_tools_is_refused_in_one_line_naming_the_setting(
        tmp_path, monkeypatch, capsys):
    from rollout_cli.main import main

    monkeypatch.chdir(ROOT)
    config = sft_config_with_tools(tmp_path)
    code = main(["train", "sft", "--config", str(config), "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert ("algorithm.sft.dataset: the examples have tools or tool calls, and the base model's chat template does "
            "not render tools or tool calls (") in err
    assert "give one that does in algorithm.sft.chat_template (e.g. configs/templates/chatml-tools.jinja)" in err

    code = main(["train", "sft", "--config", str(config), "--dry-run",
                 "--set", f"algorithm.sft.chat_template={TEMPLATE}"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["assistant_turns"] == 4


def test_the_template_is_in_the_identity_by_its_content_and_absent_when_unset(tmp_path):
    base = load_config(SftConfig, ROOT / "configs/sft-tiny.toml")
    assert "chat_template" not in training_settings(base)  # existing runs keep their checkpoint ids
    assert "chat_template" not in sft_tokenizer_reads(base)
    copy = tmp_path / "template.jinja"
    copy.write_text(TEMPLATE.read_text())
    with_template = load_config(SftConfig, ROOT / "configs/sft-tiny.toml", [f"algorithm.sft.chat_template={copy}"])
    same_elsewhere = load_config(SftConfig, ROOT / "configs/sft-tiny.toml",
                                 [f"algorithm.sft.chat_template={TEMPLATE}"])
    assert training_hash(with_template) == training_hash(same_elsewhere) != training_hash(base)  # content, not path
    reads = sft_tokenizer_reads(with_template)
    copy.write_text(TEMPLATE.read_text().replace("You may call functions.", "You may call tools."))
    assert training_hash(with_template) not in {training_hash(same_elsewhere), training_hash(base)}
    assert sft_tokenizer_reads(with_template) != reads


def test_the_sft_tokenizer_frames_with_the_setting_s_template():
    plain = sft_tokenizer(resolve_model("tiny:qwen2"))
    framed = sft_tokenizer(resolve_model("tiny:qwen2"), str(TEMPLATE))
    assert framed.chat_template == TEMPLATE.read_text() != plain.chat_template  # the cached plain one untouched


def test_smollm2s_warm_start_data_is_the_rl_runs_framing_on_other_products(tmp_path, monkeypatch):
    """data/sft-smollm2-tools.jsonl is what data/make_tool_sft.py writes (deterministic), in the system prompt and
    with the tool schema of configs/rl-smollm2-tools.toml, on products none of the RL prompts (held-out included)
    asks."""
    import importlib.util
    import tomllib

    spec = importlib.util.spec_from_file_location("make_tool_sft", ROOT / "data/make_tool_sft.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    monkeypatch.setattr(make, "OUT", tmp_path / "out.jsonl")
    make.main()
    shipped = ROOT / "data/sft-smollm2-tools.jsonl"
    assert (tmp_path / "out.jsonl").read_bytes() == shipped.read_bytes()

    env = tomllib.loads((ROOT / "configs/rl-smollm2-tools.toml").read_text())["algorithm"]["rl"]["envs"][0]
    rows = [json.loads(line) for line in shipped.read_text().splitlines()]
    rl_prompts = {json.loads(line)["prompt"] for name in ("train", "heldout")
                  for line in (ROOT / f"data/rl-tools-products-{name}.jsonl").read_text().splitlines()}
    assert all(row["messages"][0]["content"] == env["system_prompt"] for row in rows)
    assert all(row["tools"] == rows[0]["tools"] for row in rows)
    assert rows[0]["tools"][0]["function"]["name"] == "calculate"
    assert not {row["messages"][1]["content"] for row in rows} & rl_prompts
    calls = sum(any(m.get("tool_calls") for m in row["messages"]) for row in rows)
    assert 0.6 < calls / len(rows) < 0.9  # imperfect on purpose: some demos guess
    load_examples(shipped)  # every row valid
