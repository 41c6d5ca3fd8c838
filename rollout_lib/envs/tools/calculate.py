"""The calculator as an OpenAI-format tool (configs/rl-calculator.toml): `calculate(expression)` evaluates
arithmetic with envs/calculator.py's own parser (integers, + - * / // and parentheses; never eval),
`calculate_answer` scores an episode's final answer, and `calculate_call_ran` is the shaped bonus for a call that ran
(configs/rl-smollm2-tools.toml; verifiers' ToolEnv rubrics reward well-formed calls the same way). The text protocol (`calc: 37 * 24`, envs/calculator.py)
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


def calculate_call_ran(inp: Any) -> float:
    """A reward function (RewardInput) of the `tools` interaction: 1.0 when the episode called a tool and every call
    ran and returned a number (none malformed, unknown, refused by the calculator: no `error: ...` result), else
    0.0. A small weight of it gives GRPO a signal while the final answers are still all wrong; at weight 0 it is
    the held-out tool-use rate."""
    results = [turn.get("content") or "" for turn in inp.turns if turn.get("role") == "tool"]
    if not results or inp.state.get("tool_errors", 0):
        return 0.0
    return float(not any(result.startswith("error:") for result in results))
