"""configs/templates/chatml-tools-compact.jinja: the tool-call template short enough for the tiny model. It passes the
tool-template check (tools, call and result rendered, prefix-preserving), shows a tool in one line instead of its JSON
schema, writes calls the maintained Hermes parser reads, and frames a conversation without tools exactly as the tiny
model's own template does (the guess_number runs share the warm start trained with it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_lib.envs.tools import ToolSettings
from rollout_lib.envs.tools.parsers.hermes import parse_hermes
from rollout_lib.envs.tools.toolbox import build_toolbox
from rollout_lib.model.chat import tool_template_problem, use_chat_template
from rollout_lib.model.loading import load_tokenizer, resolve_model

ROOT = Path(__file__).resolve().parent.parent
COMPACT = ROOT / "configs/templates/chatml-tools-compact.jinja"
FULL = ROOT / "configs/templates/chatml-tools.jinja"
CALCULATE = "rollout_lib.envs.tools.calculate:calculate"
EPISODE = [{"role": "user", "content": "What is 37 * 24?"},
           {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1_0", "type": "function", "function": {
               "name": "calculate", "arguments": {"expression": "37 * 24"}}}]},
           {"role": "tool", "tool_call_id": "call_1_0", "name": "calculate", "content": "888"},
           {"role": "assistant", "content": "The product is 888."}]


def tokenizer(template: Path | None = None):
    return use_chat_template(load_tokenizer(resolve_model("tiny:qwen2")), str(template) if template else None)


@pytest.fixture(scope="module")
def compact():
    return tokenizer(COMPACT)


@pytest.fixture(scope="module")
def schemas():
    return build_toolbox([ToolSettings.model_validate(CALCULATE)]).schemas


def test_it_passes_the_tool_template_check(compact):
    assert tool_template_problem(compact) is None


def test_a_tool_is_one_line_and_a_calculator_episode_a_fraction_of_the_full_templates(compact, schemas):
    text = compact.apply_chat_template(EPISODE, tools=schemas, tokenize=False)
    assert text.startswith("<|im_start|>system\nTool: calculate(expression): Evaluate an arithmetic expression "
                           "exactly.<|im_end|>\n<|im_start|>user\nWhat is 37 * 24?<|im_end|>\n")
    assert ('<|im_start|>assistant\n<tool_call>{"name": "calculate", "arguments": {"expression": "37 * 24"}}'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n888\n</tool_response><|im_end|>\n') in text
    full = tokenizer(FULL).apply_chat_template(EPISODE, tools=schemas, tokenize=False)
    count = lambda rendered: len(compact(rendered, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert count(text) < 250 and count(full) > 2 * count(text), (count(text), count(full))


def test_its_calls_are_what_the_hermes_parser_reads(compact, schemas):
    text = compact.apply_chat_template(EPISODE[:2], tools=schemas, tokenize=False)
    turn = text.split("<|im_start|>assistant\n")[-1].removesuffix("<|im_end|>\n")
    parsed = parse_hermes(turn)
    assert parsed.content == "" and [(call.name, call.arguments) for call in parsed.calls] == [
        ("calculate", {"expression": "37 * 24"})]


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_without_tools_it_frames_a_conversation_as_the_tiny_models_own_template(compact, generation_prompt):
    own = tokenizer()
    for conversation in ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Guess."},
                          {"role": "assistant", "content": "4"}, {"role": "user", "content": "higher"}],
                         [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": "6"}]):
        assert compact.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt) == \
            own.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
