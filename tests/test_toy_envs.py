"""The toy multi-turn envs (calculator, guess_number) played by hand, and their shipped data files."""

from __future__ import annotations

import importlib.util
import re
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from rollout_lib.envs.base import INTERACTIONS, EnvReply
from rollout_lib.envs.calculator import (
    CalcError,
    Calculator,
    CalculatorSettings,
    calculator_answer,
    evaluate,
    final_answer_score,
    find_tool_call,
    tool_result,
)
from rollout_lib.envs.guess_number import (
    GuessNumber,
    GuessNumberSettings,
    first_guess,
    solved_score,
)

DATA = Path(__file__).resolve().parents[1] / "data"


def _turn(messages: list[dict], text: str) -> list[dict]:
    messages.append({"role": "assistant", "content": text})
    return messages


def _play(interaction, prompt: dict, turns: list[str]) -> tuple[dict, list[EnvReply]]:
    """Drives an episode as the driver does: respond after each model turn until done."""
    state = interaction.start(prompt)
    messages = [{"role": "user", "content": "q"}]
    replies = []
    for text in turns:
        reply = interaction.respond(state, _turn(messages, text))
        replies.append(reply)
        if reply.done:
            break
        messages.extend(reply.messages)
    return state, replies


# --- calculator: the parser ----------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, expected", [
    ("37 * 24", "888"),
    ("84 + 34", "118"),
    ("-(3 - 10) * 2", "14"),
    ("7 / 2", "3.5"),
    ("-7 / 2", "-3.5"),
    ("1 / 3", "0.333333"),
    ("2 / 3", "0.666667"),
    ("8 / 4", "2"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("((1 + 2) * (3 + 4))", "21"),
    ("+5", "5"),
    ("1_000 * 3", "3000"),
])
def test_calculator_evaluates_arithmetic(expression, expected):
    assert tool_result(expression) == expected


@pytest.mark.parametrize("expression, why", [
    ("", "empty expression"),
    ("37 *", "not an arithmetic expression"),
    ("37 × 24", "not an arithmetic expression"),
    ("1\x00", "not an arithmetic expression"),
    ("2 ** 10", "operator ** is not allowed"),
    ("7 % 2", "operator % is not allowed"),
    ("1.5 * 2", "only integers, not 1.5"),
    ("True + 1", "only integers, not True"),
    ("'a' * 3", "only integers, not 'a'"),
    ("1 / 0", "division by zero"),
    ("5 // (3 - 3)", "division by zero"),
    ("1 < 2", "compare is not allowed"),
    ("x + 1", "name is not allowed"),
    ("9" * 13, "number too large"),
    ("999999 * 999999 * 999999", "number too large"),
    ("1" + " + 1" * 40, "expression longer than 80 characters"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
    result = tool_result(expression)
    assert result.startswith("error: ") and why in result, result


def test_evaluate_is_exact_and_raises_calc_error():
    assert evaluate("7 / 2 * 2") == 7 and evaluate("1 / 3") == Fraction(1, 3)
    with pytest.raises(CalcError, match="division by zero"):
        evaluate("1 // 0")


@pytest.mark.parametrize("expression", [
    "__import__('os')",
    "__import__('pathlib').Path('pwned').touch()",
    "open('pwned', 'w')",
    "().__class__.__bases__[0].__subclasses__() or open('pwned', 'w')",
    "(lambda: open('pwned', 'w'))()",
    "[open('pwned', 'w')][0]",
    "1 + open('pwned', 'w').write('1')",
])
def test_calculator_never_evaluates_names_calls_or_attributes(expression, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # each would create ./pwned if any part of it were evaluated
    result = tool_result(expression)
    assert result.startswith("error: ") and "is not allowed" in result, result
    assert not (tmp_path / "pwned").exists()


def test_calculator_finds_the_first_call_line_only():
    assert find_tool_call("calc: 37 * 24") == "37 * 24"
    assert find_tool_call("Let me see.\n  calc:2+2  \ncalc: 9 * 9") == "2+2"
    assert find_tool_call("I would calc: 2 + 2 here") is None  # not at the start of a line
    assert find_tool_call("The answer is 888.") is None
    assert find_tool_call("calc:") == ""  # a call, with an empty expression (answered with an error)


def test_final_answer_score_compares_the_last_number():
    assert final_answer_score("The answer is 888.", "888") == 1.0
    assert final_answer_score("888 or 37", "888") == 0.0
    assert final_answer_score("It is 3.50", "3.5") == 1.0
    assert final_answer_score("no idea", "888") == 0.0
    assert final_answer_score("9" * 5000, "888") == 0.0


# --- calculator: episodes ------------------------------------------------------------------------------------


def test_calculator_is_registered_with_its_defaults():
    assert INTERACTIONS["calculator"] is Calculator
    assert CalculatorSettings().max_turns == 3
    with pytest.raises(ValidationError, match="max_turns"):
        CalculatorSettings(max_turns=0)


def test_calculator_episode_call_then_correct_answer():
    calculator = Calculator(CalculatorSettings())
    state, replies = _play(calculator, {"answer": "888", "info": {}}, ["calc: 37 * 24", "The answer is 888."])
    assert replies == [EnvReply(messages=[{"role": "tool", "content": "888"}]), EnvReply(done=True)]
    assert state == {"answer": "888", "calls": 1, "results": ["888"], "score": 1.0}


def test_calculator_episode_error_then_wrong_answer():
    calculator = Calculator(CalculatorSettings())
    state, replies = _play(calculator, {"answer": "888", "info": {}},
                           ["calc: 37 ** 24", "calc: 37 * 24", "The answer is 37."])
    assert replies[0].messages == [{"role": "tool", "content": "error: operator ** is not allowed"}]
    assert replies[2].done
    assert state["calls"] == 2 and state["results"] == ["error: operator ** is not allowed", "888"]
    assert state["score"] == 0.0


def test_calculator_score_is_zero_until_a_final_answer():
    calculator = Calculator(CalculatorSettings())
    state = calculator.start({"answer": " 888 ", "info": {}})
    assert state["score"] == 0.0
    calculator.respond(state, [{"role": "assistant", "content": "calc: 888"}])
    assert state["score"] == 0.0  # an episode cut here (max_turns, truncation) has not answered


def test_calculator_needs_a_numeric_answer():
    calculator = Calculator(CalculatorSettings())
    with pytest.raises(ValueError, match=r"calculator: calc/3 needs a numeric 'answer', got None"):
        calculator.start({"example_id": "calc/3", "answer": None, "info": {}})
    with pytest.raises(ValueError, match="numeric 'answer'"):
        calculator.start({"answer": "eight", "info": {}})


def test_calculator_answer_reward_scores_the_last_turn():
    def inp(text, answer="888"):
        return SimpleNamespace(completion_text=text, answer=answer)

    assert calculator_answer(inp("The answer is 888.")) == 1.0
    assert calculator_answer(inp("The answer is 37.")) == 0.0
    assert calculator_answer(inp("calc: 888")) == 0.0  # still calling the tool: no answer given
    with pytest.raises(ValueError, match="needs an answer"):
        calculator_answer(inp("888", answer=None))


# --- guess_number --------------------------------------------------------------------------------------------


def test_guess_number_settings():
    assert INTERACTIONS["guess_number"] is GuessNumber
    settings = GuessNumberSettings()
    assert (settings.max_turns, settings.low, settings.high) == (4, 1, 8)
    with pytest.raises(ValidationError, match=r"guess_number: low \(9\) is above high \(8\)"):
        GuessNumberSettings(low=9)


def test_first_guess():
    assert first_guess("5") == 5
    assert first_guess("I guess 3, or 7") == 3
    assert first_guess("maybe -2") == -2
    assert first_guess("no idea") is None
    assert first_guess("1" * 10) is None


def test_solved_score_formula():
    assert [solved_score(turn, 4) for turn in (1, 2, 3, 4, 5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_guess_number_episode_with_feedback():
    game = GuessNumber(GuessNumberSettings())
    state, replies = _play(game, {"answer": "6", "info": {}}, ["4", "I pick 7", "hmm", "6"])
    assert [reply.messages for reply in replies[:3]] == [
        [{"role": "user", "content": "higher"}],
        [{"role": "user", "content": "lower"}],
        [{"role": "user", "content": "Answer with a number from 1 to 8."}],
    ]
    assert replies[3].done
    assert state == {"secret": 6, "guesses": [4, 7, None, 6], "solved": True, "score": 0.25}


def test_guess_number_first_turn_and_unsolved():
    game = GuessNumber(GuessNumberSettings())
    state, replies = _play(game, {"answer": "3", "info": {}}, ["3"])
    assert replies == [EnvReply(done=True)] and state["score"] == 1.0 and state["solved"]
    state, replies = _play(game, {"answer": "3", "info": {}}, ["1", "2"])  # then cut: never solved
    assert not any(reply.done for reply in replies)
    assert state == {"secret": 3, "guesses": [1, 2], "solved": False, "score": 0.0}


@pytest.mark.parametrize("answer", [None, "", "nine", "0", "9", "4.5"])
def test_guess_number_secret_must_be_in_range(answer):
    with pytest.raises(ValueError, match=r"guess_number: g/1 needs an integer 'answer' in \[1, 8\]"):
        GuessNumber(GuessNumberSettings()).start({"example_id": "g/1", "answer": answer, "info": {}})


# --- shipped data --------------------------------------------------------------------------------------------


def _make_env_data():
    spec = importlib.util.spec_from_file_location("make_env_data", DATA / "make_env_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_env_data_files_are_what_the_script_writes():
    make = _make_env_data()
    for name, make_rows in make.FILES.items():
        assert (DATA / name).read_text() == make.jsonl_text(make_rows()), f"data/{name} is stale: rerun the script"


def test_env_prompts_fit_their_envs():
    make = _make_env_data()
    calculator, game = Calculator(CalculatorSettings()), GuessNumber(GuessNumberSettings())
    for row in make.rl_calculator_rows():
        expression = re.search(r"\d+ \* \d+", row["prompt"]).group()
        assert tool_result(expression) == row["answer"]
        calculator.start({**row, "info": {}})
    for row in make.rl_guess_rows():
        game.start({**row, "info": {}})


def _replays(interaction, answer: str, messages: list[dict]) -> bool:
    """Whether the env, with this answer, writes exactly the demo's env messages after its assistant turns and
    ends the episode where the demo ends (or the demo ran out of turns)."""
    state = interaction.start({"answer": answer, "info": {}})
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == len(messages) - 1:  # the demo's last turn: the env ends the episode, or turns ran out
            return interaction.respond(state, messages).done or index + 1 == 2 * interaction.settings.max_turns
        if interaction.respond(state, messages[: index + 1]).messages != [messages[index + 1]]:
            return False
    return False


def test_sft_demos_are_episodes_the_envs_produce():
    make = _make_env_data()
    rows = make.sft_tools_rows()
    rl_prompts = {row["prompt"] for row in make.rl_calculator_rows()}
    calc_rows = copies = 0
    for row in rows:
        messages = row["messages"]
        expression = find_tool_call(messages[1]["content"])
        if expression is not None:
            calc_rows += 1
            assert messages[0]["content"] not in rl_prompts
            answer = tool_result(expression)
            assert _replays(Calculator(CalculatorSettings()), answer, messages), row
            copies += final_answer_score(messages[-1]["content"], answer) == 1.0
        else:
            game = GuessNumber(GuessNumberSettings())
            assert any(_replays(game, str(secret), messages) for secret in range(1, 9)), row
    assert 0 < calc_rows < len(rows)
    assert 0.3 < copies / calc_rows < 0.7  # imperfect on purpose: RL has something to learn
