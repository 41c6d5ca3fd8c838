#!/usr/bin/env python3
"""Prompts of the multi-turn toy envs (calculator, guess_number) and the tiny model's SFT warm start for both.

    python data/make_env_data.py   # writes the three files below

- rl-calculator-prompts.jsonl: "What is 37 * 24? Use the calculator." with answer "888" (two 2-digit numbers,
  * or +): the tiny model cannot compute them, it has to call the tool (rollout_lib/envs/calculator.py).
- rl-guess-prompts.jsonl: "Guess my number between 1 and 8." in 8 wordings x 8 secrets (the answer).
- sft-tools-tiny.jsonl: demonstrations of both protocols rendered exactly as an episode produces them, imperfect
  on purpose so that RL has something to learn: every calculator demo calls the tool with the right expression,
  but only CALC_COPY_RATE of the final answers copy the tool's result (the others repeat an operand); only
  GUESS_FEEDBACK_RATE of the guessing demos use the feedback (bisect the interval still possible), the others guess
  at random in 1..8. Calculator demos use other questions than the RL prompts.

Deterministic: one seeded `random.Random` per file, no iteration over sets.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

CALC_TEMPLATES = (
    "What is {expr}? Use the calculator.",
    "Use the calculator: what is {expr}?",
    "Compute {expr} with the calculator.",
    "{expr} = ? Use the calculator.",
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
LOW, HIGH = 1, 8  # the guess_number env's default range
GUESS_MAX_TURNS = 4  # its default max_turns: an unsolved demo stops after this many guesses

RL_CALC_ROWS = 64
SFT_CALC_ROWS = 192
SFT_GUESS_ROWS = 192
CALC_COPY_RATE = 0.5
GUESS_FEEDBACK_RATE = 0.3


def _calc_questions(rng: random.Random, count: int, exclude: set[str]) -> list[tuple[str, int]]:
    """`count` distinct (expression, value) pairs of two 2-digit numbers, none in `exclude`."""
    questions = []
    while len(questions) < count:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = rng.choice("*+")
        expr = f"{a} {op} {b}"
        if expr not in exclude:
            exclude.add(expr)
            questions.append((expr, a * b if op == "*" else a + b))
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


def _calc_demo(rng: random.Random, expr: str, value: int) -> dict:
    if rng.random() < CALC_COPY_RATE:
        final = value
    else:
        final = int(rng.choice(expr.split()[::2]))  # an operand: the answer is in reach but not this one
    return {"messages": [
        {"role": "user", "content": rng.choice(CALC_TEMPLATES).format(expr=expr)},
        {"role": "assistant", "content": f"calc: {expr}"},
        {"role": "tool", "content": str(value)},
        {"role": "assistant", "content": f"The answer is {final}."},
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


def sft_tools_rows() -> list[dict]:
    rng = random.Random(202)
    rl_exprs = {expr for expr, _ in _rl_calc_questions()}
    calc = [_calc_demo(rng, expr, value) for expr, value in _calc_questions(rng, SFT_CALC_ROWS, rl_exprs)]
    guess = [_guess_demo(rng, rng.randint(LOW, HIGH)) for _ in range(SFT_GUESS_ROWS)]
    rows = calc + guess
    rng.shuffle(rows)
    return rows


def jsonl_text(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


FILES = {
    "rl-calculator-prompts.jsonl": rl_calculator_rows,
    "rl-guess-prompts.jsonl": rl_guess_rows,
    "sft-tools-tiny.jsonl": sft_tools_rows,
}


def main() -> None:
    for name, make_rows in FILES.items():
        (HERE / name).write_text(jsonl_text(make_rows()))


if __name__ == "__main__":
    main()
