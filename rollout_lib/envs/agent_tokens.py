"""An agent episode's tokens: what each OpenAI request is conditioned on, and the training sequences they make.

Requests are matched at the message level, never by re-tokenizing sampled text (BPE does not round-trip). A
request extends the episode's current sequence when its messages are the previous request's, then the assistant
message answered to it, then new messages, rendered as the template's text after the sampled stop token
(render.py) with weight 0; anything else starts a new training sequence, counted as a split. Tokens the policy did
not sample are never recorded as sampled. In full: docs/environments.md, "Token fidelity".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rollout_lib.envs.episodes import Episode
from rollout_lib.envs.render import TemplateMismatchError, render_env_reply
from rollout_lib.model.chat import encode_prompt


@dataclass
class _Answered:
    """The last request of the current sequence: its messages and tools, and the assistant message answered."""

    messages: list[dict]
    tools: list[dict] | None
    assistant: dict  # as rendered: content without its calls, calls with dict arguments
    stop_token: int | None  # the sampled turn's last token when it is a stop token, else None (cut)


@dataclass
class AgentTokens:
    """One episode's training sequences (envs.episodes.Episode each: prompt ids, then sampled and rendered
    segments) and how many times a request did not extend the current one."""

    row: dict  # the PROMPTS row (info parsed)
    sequences: list[Episode] = field(default_factory=list)
    splits: int = 0
    _answered: _Answered | None = None
    _pending: tuple | None = None  # (messages, tools, (ids, rendered) appended or None, prompt or None)

    def prompt_for(self, tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The token ids a request is sampled from. Nothing is kept until `record` adds what was sampled (a request
        refused after this, at the context limit, leaves the episode as it was)."""
        messages = [normalise_message(message) for message in messages]
        appended = self._extension(tokenizer, messages, tools)
        if appended is None:
            prompt = encode_prompt(tokenizer, messages, tools)
            self._pending = (messages, tools, None, prompt)
            return list(prompt)
        self._pending = (messages, tools, appended, None)
        return self.sequences[-1].sequence + appended[0]

    def record(self, ids: list[int], logprobs: list[float], text: str, assistant: dict, stops: set[int]) -> None:
        """The sampled turn of the request just prepared: its tokens as sampled, and the assistant message the
        agent was answered with (`assistant`: content and tool calls as rendered)."""
        messages, tools, appended, prompt = self._pending
        if appended is None:  # a new training sequence: the request's rendering is its prompt
            if self.sequences:
                self.splits += 1
            self.sequences.append(Episode(self.row, prompt, {}, messages))
        else:
            rendered_ids, rendered = appended
            for message in rendered:
                self.sequences[-1].add(rendered_ids[message.start:message.end], [None] * (message.end - message.start),
                                       message.role, message.content,
                                       (message.body_start - message.start, message.body_end - message.start),
                                       sampled=False)
        current = self.sequences[-1]
        current.add(list(ids), list(logprobs), "assistant", text, (0, len(ids)), sampled=True)
        current.model_turns += 1
        stop = ids[-1] if ids and ids[-1] in stops else None
        self._answered = _Answered(messages, tools, assistant, stop)
        self._pending = None

    def _extension(self, tokenizer, messages: list[dict], tools: list[dict] | None):
        answered = self._answered
        if answered is None or answered.stop_token is None or tools != answered.tools:
            return None
        known = len(answered.messages)
        if len(messages) <= known + 1 or messages[:known] != answered.messages:
            return None
        if not same_assistant(messages[known], answered.assistant):
            return None
        new = messages[known + 1:]
        if any(message.get("role") == "assistant" for message in new):
            return None  # an assistant turn the policy did not sample here: not appendable as prompt-side text
        try:
            return render_env_reply(tokenizer, [*answered.messages, answered.assistant], answered.stop_token, new,
                                    tools)
        except TemplateMismatchError:
            return None


def normalise_message(message: dict) -> dict:
    """An OpenAI chat message as chat templates take it: content None is "", tool-call arguments a dict (OpenAI
    sends them as a JSON string)."""
    out = {key: value for key, value in message.items() if value is not None or key == "content"}
    if out.get("content") is None:
        out["content"] = ""
    if out.get("tool_calls"):
        out["tool_calls"] = [_normalise_call(call) for call in out["tool_calls"]]
    else:
        out.pop("tool_calls", None)
    return out


def _normalise_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # rendered as written; such a message never matches a call we answered, so it splits
    return {"id": call.get("id"), "type": call.get("type", "function"), "function": function}


def same_assistant(message: dict, answered: dict) -> bool:
    """Whether the agent sent back the assistant message it was answered with (ids of calls aside: a client
    may keep them, as OpenAI's does)."""
    if message.get("role") != "assistant" or (message.get("content") or "") != (answered.get("content") or ""):
        return False
    calls = [call.get("function") for call in message.get("tool_calls") or []]
    return calls == [call["function"] for call in answered.get("tool_calls") or []]


def assistant_message(content: str, calls: list[tuple[str, dict[str, Any]]], call_id_prefix: str) -> dict:
    """The assistant message a request is answered with, as the chat template renders it (arguments a dict)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"{call_id_prefix}_{index}", "type": "function",
                                  "function": {"name": name, "arguments": arguments}}
                                 for index, (name, arguments) in enumerate(calls)]
    return message
