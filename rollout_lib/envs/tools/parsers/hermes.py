"""Hermes tool calls (Qwen2.5/Qwen3, Hermes; configs/templates/chatml-tools.jinja): each call is a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>. The regex is TRL's Qwen response schema's and
verl's HermesToolParser's; the JSON is parsed, never evaluated."""

from __future__ import annotations

import json
import re

from rollout_lib.envs.tools.parsers import ParsedCall, ParsedTurn, register

_CALL = re.compile(r"<tool_call>\s*(.+?)\s*</tool_call>", re.DOTALL)


@register("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    calls, kept, cursor, last_end = [], [], 0, 0
    for match in _CALL.finditer(text):
        last_end = match.end()
        call = _call(match.group(1))
        calls.append(call)
        if call.problem is None:  # a malformed call stays in the content: it is what the model wrote
            kept.append(text[cursor:match.start()])
            cursor = match.end()
    kept.append(text[cursor:])
    content = "".join(kept).strip()
    if "<tool_call>" in text[last_end:]:
        calls.append(ParsedCall(problem="a <tool_call> without its closing </tool_call>"))
    return ParsedTurn(content, calls)


def _call(body: str) -> ParsedCall:
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        return ParsedCall(problem=f"the tool call is not JSON ({exc})")
    if not isinstance(value, dict):
        return ParsedCall(problem='a tool call is a JSON object {"name": ..., "arguments": {...}}')
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(problem='the tool call has no "name"')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ParsedCall(name=name, problem=f'the "arguments" of {name!r} are not a JSON object')
    return ParsedCall(name=name, arguments=arguments)
