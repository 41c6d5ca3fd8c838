#!/usr/bin/env python3
"""Prompts of the multi-turn toy envs (calculator, guess_number) and the tiny model's SFT warm start for both.

    python data/make_env_data.py   # writes the four files below

- rl-calculator-prompts.jsonl: "Use the calculator. What is 56 * 77?" with answer "4312": products of two numbers
  in 32..99 (always 4 digits), which the tiny model cannot compute; it has to call the tool
  (rollout_lib/envs/calculator.py).
- rl-guess-prompts.jsonl: "Guess my number between 1 and 8." in 8 wordings x 8 secrets (the answer).
- sft-tools-tiny.jsonl: demonstrations of both protocols, rendered exactly as an episode produces them and
  imperfect on purpose so that RL has something to learn. Every calculator demo calls the tool with the right
  expression; then CALC_COPY_RATE of the final answers say "The product is <result>." (SLOPPY_COPY_RATE of those
  with one digit wrong) and the others "Maybe it is <another 4-digit number>.". GUESS_FEEDBACK_RATE of the
  guessing demos bisect the interval the feedback leaves; the others guess at random in 1..8. The calculator
  demos ask other questions than the RL prompts.
- sft-calculator-tools-tiny.jsonl: the same demonstrations with the calculator's as OpenAI tool calls
  (`tools`: the `calculate` schema, made from the function as the RL run makes it; the assistant's `tool_calls`
  with the RL driver's call id; the `tool` result), which configs/templates/chatml-tools-compact.jinja renders as
  configs/rl-calculator.toml's episodes: the warm start of that config (configs/sft-calculator-tools-tiny.toml).
  Same questions, answers, copy rates and order; the guessing demos stay in, as in the warm start measured
  (docs/environments.md).

Why the calculator data is this regular (measured with configs/sft-tools-tiny.toml, several seeds): the tiny model
copies the question into the call, and the result into the answer, only once one attention head copies from a
fixed distance back. So the question ends every prompt, every operand and result has the same length, and "The
product is " is as long as the framing before the call's expression: both copies are from 21 tokens back. With `+`
questions too, the operator was copied in some runs only; with an operand as the wrong answer, or a wrong answer
after the same words as a right one, the result was copied in some runs only. With tool calls a Hermes call's
framing is ~55 tokens, so the two copies are from different distances back; seed 42 still learns both, around SFT
step 300-350.

Deterministic: one seeded `random.Random` per file, no iteration over sets.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from rollout_lib.envs.tools import ToolSettings  # noqa: E402
from rollout_lib.envs.tools.toolbox import build_toolbox  # noqa: E402

CALCULATE = "rollout_lib.envs.tools.calculate:calculate"  # configs/rl-calculator.toml's tool

CALC_TEMPLATES = (
    "What is {expr}?",
    "Use the calculator. What is {expr}?",
    "With the calculator: what is {expr}?",
    "Calculator task. What is {expr}?",
)
GUESS_TEMPLATES = (
    "Guess my number between 1 and 8.",
    "I am thinking of a number from 1 to 8. Guess it.",
    "Guess the number (1 to 8).",
    "Guess my secret number, 1 to 8.",
    "Pick a number from 1 to 8. I say higher or lower.",
    "My number is between 1 and 8. Guess.",
    "Find my number (1 to 8) by guessing.",
    "Guess a number from 1 to 8.",
)
COPIED_ANSWER = "The product is {}."  # 9 tokens before the number (see above)
WRONG_ANSWER = "Maybe it is {}."  # other first words: the choice to copy is made once, not digit by digit
LOW, HIGH = 1, 8  # the guess_number env's default range
GUESS_MAX_TURNS = 4  # its default max_turns: an unsolved demo stops after this many guesses

OPERANDS = (32, 99)  # products 1024..9801: 4 digits
RL_CALC_ROWS = 64
SFT_CALC_ROWS = 1024
SFT_GUESS_ROWS = 128
CALC_COPY_RATE = 0.6
SLOPPY_COPY_RATE = 0.3
GUESS_FEEDBACK_RATE = 0.5


def _calc_questions(rng: random.Random, count: int, exclude: set[str]) -> list[tuple[str, int]]:
    """`count` distinct (expression, product) pairs, none in `exclude`."""
    questions = []
    while len(questions) < count:
        a, b = rng.randint(*OPERANDS), rng.randint(*OPERANDS)
        expr = f"{a} * {b}"
        if expr not in exclude:
            exclude.add(expr)
            questions.append((expr, a * b))
    return questions


def _rl_calc_questions() -> list[tuple[str, int]]:
    return _calc_questions(random.Random(101), RL_CALC_ROWS, set())


def rl_calculator_rows() -> list[dict]:
    rng = random.Random(102)
    return [{"prompt": rng.choice(CALC_TEMPLATES).format(expr=expr), "answer": str(value)}
            for expr, value in _rl_calc_questions()]


def rl_guess_rows() -> list[dict]:
    return [{"prompt": template, "answer": str(secret)}
            for template in GUESS_TEMPLATES for secret in range(LOW, HIGH + 1)]


def _wrong_answer(rng: random.Random, value: int) -> int:
    """Another number of the same size."""
    while True:
        wrong = rng.randint(10 ** (len(str(value)) - 1), 10 ** len(str(value)) - 1)
        if wrong != value:
            return wrong


def _sloppy_copy(rng: random.Random, value: int) -> int:
    """The result with one digit changed (the leading one stays non-zero)."""
    digits = list(str(value))
    index = rng.randrange(len(digits))
    digits[index] = rng.choice([d for d in "0123456789" if d != digits[index] and (index or d != "0")])
    return int("".join(digits))


def calculate_schema() -> dict:
    """The `calculate` tool's OpenAI schema, made as the RL run makes it (from the function's signature and
    docstring), so the demos show the model the tool line its RL prompts show."""
    return build_toolbox([ToolSettings.model_validate(CALCULATE)]).schemas[0]


def _calc_demo(rng: random.Random, expr: str, value: int) -> dict:
    """A text-protocol episode (`calc: 37 * 24`, the calculator interaction)."""
    if rng.random() < CALC_COPY_RATE:
        final = COPIED_ANSWER.format(_sloppy_copy(rng, value) if rng.random() < SLOPPY_COPY_RATE else value)
    else:
        final = WRONG_ANSWER.format(_wrong_answer(rng, value))
    return {"messages": [
        {"role": "user", "content": rng.choice(CALC_TEMPLATES).format(expr=expr)},
        {"role": "assistant", "content": f"calc: {expr}"},
        {"role": "tool", "content": str(value)},
        {"role": "assistant", "content": final},
    ]}


def _as_tool_calls(demo: dict, schema: dict) -> dict:
    """A text-protocol calculator demo as an OpenAI tool-call conversation (the tools interaction)."""
    question, call, result, final = demo["messages"]
    expr = call["content"].removeprefix("calc: ")
    return {"tools": [schema], "messages": [
        question,
        {"role": "assistant", "content": "", "tool_calls": [  # the RL driver's call id for turn 1's first call
            {"id": "call_1_0", "type": "function",
             "function": {"name": "calculate", "arguments": {"expression": expr}}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "name": "calculate", "content": result["content"]},
        final,
    ]}


def _guess_demo(rng: random.Random, secret: int) -> dict:
    messages = [{"role": "user", "content": rng.choice(GUESS_TEMPLATES)}]
    uses_feedback = rng.random() < GUESS_FEEDBACK_RATE
    low, high = LOW, HIGH
    for turn in range(1, GUESS_MAX_TURNS + 1):
        guess = (low + high) // 2 if uses_feedback else rng.randint(LOW, HIGH)
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret or turn == GUESS_MAX_TURNS:
            break  # solved (the env ends the episode) or out of turns (the env does not answer the last)
        if guess < secret:
            low = guess + 1
        else:
            high = guess - 1
        messages.append({"role": "user", "content": "higher" if guess < secret else "lower"})
    return {"messages": messages}


def _sft_rows(as_tool_calls: bool) -> list[dict]:
    # One generator per part: retuning the guessing demos leaves the calculator demos and the order as they are.
    calc_rng, guess_rng = random.Random(202), random.Random(203)
    rl_exprs = {expr for expr, _ in _rl_calc_questions()}
    calc = [_calc_demo(calc_rng, expr, value)
            for expr, value in _calc_questions(calc_rng, SFT_CALC_ROWS, rl_exprs)]
    if as_tool_calls:
        schema = calculate_schema()
        calc = [_as_tool_calls(demo, schema) for demo in calc]
    guess = [_guess_demo(guess_rng, guess_rng.randint(LOW, HIGH)) for _ in range(SFT_GUESS_ROWS)]
    rows = calc + guess
    random.Random(204).shuffle(rows)
    return rows


def sft_tools_rows() -> list[dict]:
    return _sft_rows(as_tool_calls=False)


def sft_calculator_tools_rows() -> list[dict]:
    return _sft_rows(as_tool_calls=True)


def jsonl_text(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


FILES = {
    "rl-calculator-prompts.jsonl": rl_calculator_rows,
    "rl-guess-prompts.jsonl": rl_guess_rows,
    "sft-tools-tiny.jsonl": sft_tools_rows,
    "sft-calculator-tools-tiny.jsonl": sft_calculator_tools_rows,
}


def main() -> None:
    for name, make_rows in FILES.items():
        (HERE / name).write_text(jsonl_text(make_rows()))


if __name__ == "__main__":
    main()
