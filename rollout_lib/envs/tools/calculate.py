"""The calculator as an OpenAI-format tool (configs/rl-calculator-tools.toml): `calculate(expression)` evaluates
arithmetic with envs/calculator.py's own parser (integers, + - * / // and parentheses; never eval), and
`calculate_answer` scores an episode's final answer. The text protocol (`calc: 37 * 24`, envs/calculator.py)
stays for chat templates that cannot render tools (SmolLM2's own)."""

from __future__ import annotations

from typing import Any

from rollout_lib.envs.calculator import final_answer_score, tool_result


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: integers with + - * / // and parentheses, e.g. "37 * 24"
    """
    return tool_result(expression)


def calculate_answer(inp: Any) -> float:
    """A reward function (RewardInput): 1.0 when the episode's last turn answers (calls no tool) and its last number
    is the example's answer, else 0.0."""
    if inp.answer is None:
        raise ValueError("calculate_answer needs an answer, but the example has none")
    if "<tool_call>" in inp.completion_text:
        return 0.0
    return final_answer_score(inp.completion_text, inp.answer)
