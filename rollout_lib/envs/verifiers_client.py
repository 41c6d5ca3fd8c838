"""The `vf.Client` a verifiers environment's rollout calls the model through, and its final state as recorded.

RolloutClient is verifiers' own chat-completions client (prompt and tool conversion, response parsing, the token
fields it reads: `prompt_token_ids`, `choices[0].token_ids`, logprobs) with one method replaced: the request goes to
the episode's in-process endpoint (agent_episodes.InProcessEndpoint), never over a network. What the endpoint
answers was sampled by the step's sampler from the episode's own tokens (agent_tokens.py), so the `tokens` verifiers
records for each turn are rollout's. Importing this module imports verifiers (the `verifiers` extra).
"""

from __future__ import annotations

import json
import math
from typing import Any

from openai.types.chat import ChatCompletion
from pydantic import BaseModel

import verifiers as vf
from verifiers.legacy.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

from rollout_lib.envs.agent_server import RequestError

# State keys that are the rollout's machinery, not its data (the client, timings, token usage) or that the record
# keeps in a lighter form (trajectory), or that the rewards get from the prompt row (input, prompt, task).
_NOT_RECORDED = {"client", "model", "sampling_args", "timing", "usage", "usage_tracker", "tool_defs", "trajectory",
                 "input", "prompt", "task", "reward", "advantage", "metrics", "trajectory_id"}


class RolloutClient(OpenAIChatCompletionsClient):
    """verifiers' chat-completions client whose requests are answered by rollout's sampler, in process."""

    def __init__(self, endpoint):
        super().__init__(endpoint)  # not a ClientConfig: kept as `client`, no OpenAI client is set up
        self.endpoint = endpoint

    async def get_native_response(self, prompt, model: str, sampling_args, tools=None, **kwargs) -> ChatCompletion:
        # rollout's sampling settings decide temperature and top_p; a max_tokens the env asks for is capped by them.
        body: dict[str, Any] = {"model": model, "messages": prompt, "logprobs": True}
        asked = (sampling_args or {}).get("max_tokens") or (sampling_args or {}).get("max_completion_tokens")
        if asked is not None:
            body["max_tokens"] = asked
        if tools:
            body["tools"] = tools
        try:
            answer = await self.endpoint.chat_completion(body)
        except RequestError as exc:
            if exc.status == 400 and "context limit" in str(exc):
                raise vf.OverlongPromptError(str(exc)) from exc  # the env's `prompt_too_long` stop
            raise vf.ModelError(f"rollout's endpoint refused the request ({exc.status}): {exc}") from exc
        return ChatCompletion.model_validate(answer)

    async def close(self) -> None:
        return None


def state_record(state) -> dict:
    """The JSON the episode keeps of the environment's final state, for its rubric (envs/verifiers_rubric.py): the
    completion messages, the stop fields, the error (as text), each turn's messages (not its tokens: those are the
    rollout row's), and every other key whose value is JSON (what setup_state and env_response stored)."""
    record: dict[str, Any] = {}
    for key, value in dict.items(state):
        if key in _NOT_RECORDED:
            continue
        if key == "error":
            record[key] = None if value is None else f"{type(value).__name__}: {value}"
            continue
        jsonable = _jsonable(value)
        if jsonable is not _SKIP:
            record[key] = jsonable
    record["trajectory"] = [_step_record(step) for step in dict.get(state, "trajectory") or []]
    return record


def _step_record(step) -> dict:
    """One turn of the trajectory: its completion messages and flags (its prompt is the turns before it)."""
    extras = _jsonable(step.get("extras") or {})
    completion = _jsonable(step.get("completion") or [])
    return {"completion": [] if completion is _SKIP else completion, "is_truncated": bool(step.get("is_truncated")),
            "reward": None, "advantage": None, "extras": {} if extras is _SKIP else extras}


_SKIP = object()


def _jsonable(value: Any) -> Any:
    """`value` as JSON values (pydantic messages dumped), or _SKIP when it is not data."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, (list, tuple)):
        items = [_jsonable(item) for item in value]
        return _SKIP if any(item is _SKIP for item in items) else items
    if isinstance(value, dict):
        items = {str(key): _jsonable(item) for key, item in value.items()}
        return _SKIP if any(item is _SKIP for item in items.values()) else items
    if isinstance(value, float) and not math.isfinite(value):
        return _SKIP
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return _SKIP
    return value
