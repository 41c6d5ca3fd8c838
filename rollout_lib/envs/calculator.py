"""A tool-use env: the model may call a calculator before it answers.

The tool call is a line of the model's turn that starts with `calc:` and holds one arithmetic expression:

    calc: 37 * 24

Integers, `+ - * / //`, unary minus and parentheses; nothing else (no floats, no `**`, no names). The env answers
with one "tool" message: the result ("888"; a non-integer quotient as a decimal rounded to 6 places, "3.5"), or
`error: <why>` when the expression cannot be evaluated. Only the first `calc:` line of a turn is answered. A turn
without a tool call is the final answer and ends the episode: state["score"] is 1.0 when its last number equals
the example's answer, else 0.0 (also while no final answer has been seen: an episode that ends at max_turns or is
cut mid-turn has not answered).

The model's text is parsed with `ast` and evaluated by walking a whitelist of node types with exact fractions;
it is never eval'd or exec'd. Expressions and every intermediate value are bounded, so no input is expensive.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction
from typing import Any, Literal

from pydantic import Field

from rollout_lib.envs.base import EnvReply, Interaction, InteractionSettings

MAX_EXPRESSION_CHARS = 80  # bounds parse cost and nesting depth (so the recursive walk cannot overflow)
MAX_MAGNITUDE = 10**12  # for literals and every intermediate value: no 10**10**10 through repeated products
DECIMALS = 6

_CALL_LINE = re.compile(r"^[ \t]*calc:(.*)$", re.MULTILINE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
}
_OPERATOR_SYMBOLS = {ast.Pow: "**", ast.Mod: "%", ast.MatMult: "@", ast.BitAnd: "&", ast.BitOr: "|",
                     ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>"}


class CalcError(ValueError):
    """An expression the calculator refuses; the message is what the model reads after `error: `."""


class CalculatorSettings(InteractionSettings):
    type: Literal["calculator"] = "calculator"
    max_turns: int = Field(3, ge=1)


def find_tool_call(text: str) -> str | None:
    """The expression of the turn's first `calc:` line, or None when the turn calls no tool (a final answer)."""
    match = _CALL_LINE.search(text)
    return None if match is None else match.group(1).strip()


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; CalcError for anything else."""
    if not expression:
        raise CalcError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError):  # ValueError: null bytes
        raise CalcError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        # type(...) is int, not isinstance: True/False are ints too.
        if type(node.value) is not int:
            raise CalcError(f"only integers, not {node.value!r}")
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        operator = _OPERATORS.get(type(node.op))
        if operator is None:
            symbol = _OPERATOR_SYMBOLS.get(type(node.op), type(node.op).__name__)
            raise CalcError(f"operator {symbol} is not allowed")
        left, right = _value(node.left), _value(node.right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv)):
            raise CalcError("division by zero")
        return _bounded(operator(left, right))
    # Names, calls, attributes, subscripts, comparisons...: never looked up, only named in the error.
    raise CalcError(f"{type(node).__name__.lower()} is not allowed; use numbers and + - * / // ( )")


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError(f"number too large (limit {MAX_MAGNITUDE:.0e})")
    return value


def format_number(value: Fraction) -> str:
    """An integer as itself ("888"); otherwise a decimal rounded to DECIMALS places, trailing zeros dropped."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(value * 10**DECIMALS)
    whole, fraction = divmod(abs(scaled), 10**DECIMALS)
    text = f"{whole}.{fraction:0{DECIMALS}d}".rstrip("0").rstrip(".")
    return f"-{text}" if scaled < 0 else text


def tool_result(expression: str) -> str:
    """The tool message's content for one call."""
    try:
        return format_number(evaluate(expression))
    except CalcError as exc:
        return f"error: {exc}"


def final_answer_score(text: str, answer: str) -> float:
    """1.0 when the last number in `text` equals `answer` (compared exactly), else 0.0 (also with no number)."""
    numbers = _NUMBER.findall(text)
    if not numbers or len(numbers[-1]) > 40:  # a 5000-digit "number" is wrong, and int() would refuse it
        return 0.0
    return float(Fraction(numbers[-1]) == Fraction(answer.strip()))


def calculator_answer(inp: Any) -> float:
    """A reward function (RewardInput): the final-answer score of the episode's last turn, 0.0 when that turn is a
    tool call. The same as `env_score` on the calculator's state, read from the text alone (so it also scores a
    transcript from elsewhere)."""
    if inp.answer is None:
        raise ValueError("calculator_answer needs an answer, but the example has none")
    if find_tool_call(inp.completion_text) is not None:
        return 0.0
    return final_answer_score(inp.completion_text, inp.answer)


class Calculator(Interaction):
    type_name = "calculator"
    settings_class = CalculatorSettings

    def start(self, prompt: dict[str, Any]) -> dict[str, Any]:
        answer = prompt.get("answer")
        try:
            Fraction((answer or "").strip())
        except ValueError:
            where = prompt.get("example_id", "an example")
            raise ValueError(f"calculator: {where} needs a numeric 'answer', got {answer!r}") from None
        return {"answer": answer.strip(), "calls": 0, "results": [], "score": 0.0}

    def respond(self, state: dict[str, Any], messages: list[dict[str, str]]) -> EnvReply:
        text = messages[-1]["content"]
        expression = find_tool_call(text)
        if expression is None:
            state["score"] = final_answer_score(text, state["answer"])
            return EnvReply(done=True)
        result = tool_result(expression)
        state["calls"] += 1
        state["results"].append(result)
        return EnvReply(messages=[{"role": "tool", "content": result}])
