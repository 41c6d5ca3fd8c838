"""OpenAI-format tool calls: `interaction = { type = "tools", max_turns = 4 }` on an env with `tools`.

After each model turn the turn's text is parsed for tool calls (`parser`, a template family's format:
envs/tools/parsers). A turn without one is the final answer and ends the episode (verifiers' ToolEnv:
`no_tools_called`). Otherwise every call runs (envs/tools/executor.py, `timeout_s` each) and the env answers one
tool message per call, in order: {"role": "tool", "tool_call_id", "name", "content"}. Call ids are
`call_<turn>_<index>`, so a rerun replays them. The model's turn is handed back re-read with its structured
`tool_calls`, so the chat template renders the conversation as a tool-calling one.

What goes wrong is the model's to read, as a tool message `error: ...`, never the episode's failure: a malformed
call (not JSON, no name), an unknown tool, arguments the function does not take, a tool that raises or runs past
its limit, calls past `max_calls_per_turn`. Tools must be deterministic in their arguments for a rerun to replay.

State (stored with the rollout, handed to reward functions): `tool_calls` and `tool_errors`, counted over the
episode."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rollout_lib.envs.base import EnvReply, Interaction, InteractionSettings
from rollout_lib.envs.tools.executor import CallResult, run_call
from rollout_lib.envs.tools.parsers import PARSERS, ParsedCall, ParserName


class ToolCallsSettings(InteractionSettings):
    type: Literal["tools"] = "tools"
    max_turns: int = Field(4, ge=1)
    parser: ParserName = "hermes"  # how calls are written: a key of envs/tools/parsers' registry
    timeout_s: float = Field(10.0, gt=0)  # per call
    max_calls_per_turn: int = Field(4, ge=1)  # calls past it are answered with an error, not run


class ToolCalls(Interaction):
    type_name = "tools"
    settings_class = ToolCallsSettings

    def __init__(self, settings: ToolCallsSettings, tools=None):
        super().__init__(settings, tools)
        if tools is None or not tools.tools:
            raise ValueError('interaction type "tools" needs the env\'s `tools`')
        self.parse = PARSERS[settings.parser]

    def start(self, prompt: dict[str, Any]) -> dict[str, Any]:
        return {"tool_calls": 0, "tool_errors": 0}

    def respond(self, state: dict[str, Any], messages: list[dict]) -> EnvReply:
        parsed = self.parse(messages[-1]["content"])
        if not parsed.calls:
            return EnvReply(done=True)
        turn = sum(message["role"] == "assistant" for message in messages)
        replies, structured, errors = [], [], 0
        for index, call in enumerate(parsed.calls):
            call_id = f"call_{turn}_{index}"
            if call.problem is None:
                structured.append({"id": call_id, "type": "function",
                                   "function": {"name": call.name, "arguments": call.arguments}})
            result = self._run(call, index)
            errors += result.failed
            named = {"name": call.name} if call.name is not None else {}
            replies.append({"role": "tool", "tool_call_id": call_id, **named, "content": result.content})
        state["tool_calls"] += len(parsed.calls)
        state["tool_errors"] += errors
        assistant = {"role": "assistant", "content": parsed.content, "tool_calls": structured}
        return EnvReply(messages=replies, assistant=assistant, tool_errors=errors)

    def _run(self, call: ParsedCall, index: int) -> CallResult:
        if call.problem is not None:
            return CallResult(f"error: {call.problem}", True)
        if index >= self.settings.max_calls_per_turn:
            return CallResult(f"error: more than {self.settings.max_calls_per_turn} tool calls in one turn; this one "
                              "was not run", True)
        tool = self.tools.tools.get(call.name)
        if tool is None:
            return CallResult(f"error: unknown tool {call.name!r}; tools: {self.tools.names}", True)
        return run_call(tool, call.arguments, self.settings.timeout_s)
