"""SFT conversations with OpenAI tool calls: a row's messages and tools, validated into the wire's form
(wire.CHAT_MESSAGE, the tools as JSON text), and back into the form chat templates take.

What a row may hold (TRL's SFT `messages` + `tools` columns, OpenAI's chat format):

    {"tools": [{"type": "function", "function": {"name": "calculate", "description": ..., "parameters": {...}}}],
     "messages": [{"role": "user", "content": "What is 27 * 682?"},
                  {"role": "assistant", "content": null, "tool_calls": [{"id": "call_0", "type": "function",
                      "function": {"name": "calculate", "arguments": {"expression": "27 * 682"}}}]},
                  {"role": "tool", "tool_call_id": "call_0", "name": "calculate", "content": "18414"},
                  {"role": "assistant", "content": "18414"}]}

A call's `arguments` may be an object or its JSON text (as the OpenAI API returns it); both are handed to the
template as an object, which is how transformers' templates take them (Qwen2.5's `tojson`s them: a string would be
rendered as a quoted string) and how the RL driver re-reads a sampled call (envs/tool_calls.py), so one call
renders one way whichever spelling the data used.
"""

from __future__ import annotations

import json

from rollout_lib.data.jsonl import MESSAGE_ROLES, DataError

_EXTRA_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id", "name"}}
NO_TOOLS = {"tool_calls": None, "tool_call_id": None, "name": None}


def require_chat(obj: dict, key: str, where: str) -> list[dict]:
    """A non-empty list of messages in the wire's form: {"role", "content"} objects (a known role, string content),
    an assistant's optionally with `tool_calls` (then `content` may be null or absent), a tool message's with
    `tool_call_id` and `name`. Errors name `where: key[i]...`."""
    messages = obj.get(key)
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{role, content}} objects")
    return [_message(message, f"{where}: {key}[{index}]") for index, message in enumerate(messages)]


def _message(message, at: str) -> dict:
    if not isinstance(message, dict) or "role" not in message:
        raise DataError(f"{at}: must be an object with exactly 'role' and 'content'")
    role = message["role"]
    if role not in MESSAGE_ROLES:
        raise DataError(f"{at}: role must be one of {list(MESSAGE_ROLES)}, got {role!r}")
    allowed = {"role", "content"} | _EXTRA_KEYS.get(role, set())
    calls = message.get("tool_calls")
    if set(message) - allowed or ("content" not in message and calls is None):
        extra = {"assistant": " (and optionally 'tool_calls')",
                 "tool": " (and optionally 'tool_call_id', 'name')"}.get(role, "")
        raise DataError(f"{at}: must be an object with exactly 'role' and 'content'{extra}")
    content = message.get("content")
    if not isinstance(content, str) and not (content is None and calls):
        raise DataError(f"{at}: content must be a string, got {type(content).__name__}")
    out = {"role": role, "content": content, **NO_TOOLS}
    if calls is not None:
        if not isinstance(calls, list):
            raise DataError(f"{at}.tool_calls: must be a list of calls, got {type(calls).__name__}")
        out["tool_calls"] = [_call(call, f"{at}.tool_calls[{index}]") for index, call in enumerate(calls)]
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            if not isinstance(message[name], str):
                raise DataError(f"{at}.{name}: must be a string, got {type(message[name]).__name__}")
            out[name] = message[name]
    return out


def _call(call, at: str) -> dict:
    """One OpenAI tool call, {"id"?, "type": "function", "function": {"name", "arguments"}}, in the wire's form."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise DataError(f"{at}: must be an object {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
    if call.get("type", "function") != "function":
        raise DataError(f"{at}.type: only \"function\" calls are supported, got {call['type']!r}")
    function = call["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise DataError(f"{at}.function: a call needs a 'name' (the tool's), got {name!r}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _parsed(arguments, f"{at}.function.arguments: not JSON")
    if not isinstance(arguments, dict):
        raise DataError(f"{at}.function.arguments: must be an object (or its JSON text), got "
                        f"{type(arguments).__name__}")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise DataError(f"{at}.id: must be a string, got {type(call_id).__name__}")
    return {"id": call_id, "name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


def require_tools(value, where: str) -> str | None:
    """A row's `tools` (a list of OpenAI function schemas, or its JSON text) as JSON text; None for none."""
    if value is None:
        return None
    if isinstance(value, str):
        value = _parsed(value, f"{where}: 'tools' is not JSON")
    if not isinstance(value, list):
        raise DataError(f"{where}: 'tools' must be a list of function schemas, got {type(value).__name__}")
    for index, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise DataError(f"{where}: tools[{index}]: must be {{\"type\": \"function\", \"function\": {{\"name\", "
                            "\"description\", \"parameters\"}}} with a name")
    return json.dumps(value, ensure_ascii=False) if value else None


def has_tool_calls(messages: list[dict]) -> bool:
    return any(message.get("tool_calls") for message in messages)


def template_messages(messages: list[dict]) -> list[dict]:
    """Wire messages as a chat template takes them: {role, content}, plus an assistant's `tool_calls`
    ({id, type: "function", function: {name, arguments: object}}) and a tool message's `tool_call_id`/`name`
    where the row has them."""
    out = []
    for message in messages:
        rendered = {"role": message["role"], "content": message["content"]}
        if message.get("tool_calls") is not None:
            rendered["tool_calls"] = [
                {**({"id": call["id"]} if call["id"] is not None else {}), "type": "function",
                 "function": {"name": call["name"], "arguments": json.loads(call["arguments"])}}
                for call in message["tool_calls"]]
        for name in ("tool_call_id", "name"):
            if message.get(name) is not None:
                rendered[name] = message[name]
        out.append(rendered)
    return out


def template_tools(tools: str | None) -> list[dict] | None:
    return None if tools is None else json.loads(tools)


def _parsed(text: str, problem: str):
    """JSON text's value; DataError `<problem>: <why> (column N)` when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{problem}: {exc.msg} (column {exc.colno})") from None
