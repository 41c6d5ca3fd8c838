"""Generative reward models: an LLM judge reads (prompt, response[, answer]) and writes a verdict with a score.

The judge is any frozen model (rollout serves it on vLLM, or a server of yours: serving/settings.py), called
through the run's replica pool with a chat request, greedy by default. Its text is parsed for the score; a
verdict that does not parse (or a score outside its range) is a missing reward whose error carries the judge's
text, never a 0.

The template is filled by plain substitution of `{prompt}`, `{response}` and `{answer}` in one pass: text from the
rollout is inserted, never interpreted (no format-string attribute lookups, no re-substitution).
"""

from __future__ import annotations

import functools
import re

from rollout_lib.reward.contract import RewardInput, function_name
from rollout_lib.reward.servers import RewardServer

PLACEHOLDERS = re.compile(r"\{(prompt|response|answer)\}")


class JudgeClient:
    """What a user reward function is handed as `judge`: chat completions of the judge model, through the pool
    (least-loaded replica, failover)."""

    def __init__(self, pool, max_tokens: int, temperature: float):
        self.pool = pool
        self.max_tokens = max_tokens
        self.temperature = temperature

    async def chat(self, messages: list[dict], *, max_tokens: int | None = None, temperature: float | None = None,
                   seed: int | None = None) -> str:
        return await self.pool.chat(messages, max_tokens=max_tokens or self.max_tokens,
                                    temperature=self.temperature if temperature is None else temperature, seed=seed)


def render(template: str, inp: RewardInput) -> str:
    """The judge's prompt: the template with the rollout's prompt (its messages' contents), response (the
    policy's last turn) and answer substituted."""
    values = {
        "prompt": "\n\n".join(message["content"] for message in inp.prompt if message["role"] != "system"),
        "response": inp.completion_text,
        "answer": inp.answer if inp.answer is not None else "",
    }
    return PLACEHOLDERS.sub(lambda match: values[match.group(1)], template)


def parse_score(text: str, pattern: str, low: float, high: float) -> float:
    """The last match of `pattern` (its first group, or the whole match) as a number in [low, high], scaled to
    [0, 1]; ValueError quoting the judge's text otherwise."""
    matches = list(re.finditer(pattern, text))
    shown = text if len(text) <= 300 else text[:300] + "..."
    if not matches:
        raise ValueError(f"judge verdict does not parse (no match of {pattern!r}): {shown!r}")
    match = matches[-1]
    found = match.group(1) if match.groups() else match.group(0)
    try:
        value = float(found)
    except (TypeError, ValueError):
        raise ValueError(f"judge verdict does not parse ({found!r} is not a number): {shown!r}") from None
    if not low <= value <= high:
        raise ValueError(f"judge score {value:g} is outside [{low:g}, {high:g}]: {shown!r}")
    return (value - low) / (high - low)


class LlmJudge:
    """The built-in judge reward: async, one chat request per rollout."""

    def __init__(self, client: JudgeClient, template: str, pattern: str, score_range: tuple[float, float],
                 system_prompt: str | None):
        self.client = client
        self.template = template
        self.pattern = pattern
        self.score_range = score_range
        self.system_prompt = system_prompt
        self.__name__ = "llm_judge"  # how the reward loop names it in metrics and errors

    async def __call__(self, inp: RewardInput) -> float:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": render(self.template, inp)})
        verdict = await self.client.chat(messages)
        return parse_score(verdict, self.pattern, *self.score_range)


class SyncJudgeClient:
    """What a user's *sync* reward function is handed as `judge`: the same `chat`, blocking, over HTTP to the judge's
    router (serving/router.py), since sync functions run in worker processes, away from the run's pool. The router
    keeps the pool's guarantees (least outstanding, per-attempt timeouts, failover); the reward loop's `timeout_s`
    kills the worker, as for any sync function, so the HTTP call needs no timeout of its own."""

    def __init__(self, router_address: str, max_tokens: int, temperature: float, where: str,
                 model: str | None = None):
        """`model`: the judge's served name, which the run's router (one address for every model) routes by."""
        self.server = RewardServer(router_address, where=where)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.model = model

    def chat(self, messages: list[dict], *, max_tokens: int | None = None, temperature: float | None = None,
             seed: int | None = None) -> str:
        import httpx

        body = {"messages": list(messages), "max_tokens": max_tokens or self.max_tokens,
                "temperature": self.temperature if temperature is None else temperature}
        if seed is not None:
            body["seed"] = seed
        if self.model is not None:
            body["model"] = self.model
        try:
            response = _http_client().post(f"http://{self.server.router_address}/v1/chat/completions", json=body)
        except httpx.TransportError as exc:
            raise self.server.explained(exc) or exc
        if response.status_code >= 400:
            raise RuntimeError(_router_error(response))
        return response.json()["choices"][0]["message"]["content"]


@functools.cache
def _http_client():
    """One keep-alive client per worker process: a fresh httpx client per call costs ~20 ms (measured), the call
    through the router ~0.5 ms. No timeout of its own (see SyncJudgeClient)."""
    import httpx  # here, not at module level: only workers of functions that ask a judge pay for it

    return httpx.Client(timeout=None)


def _router_error(response) -> str:
    """The router's one line (it names the judge's setting), or the status when the body is not the router's."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code} from the judge's router: {response.text[:200]!r}"


class WithJudge:
    """A user's async reward function called as `fn(inp, judge=<JudgeClient>, **kwargs)`."""

    def __init__(self, function, client: JudgeClient, kwargs: dict):
        self.function = function
        self.client = client
        self.kwargs = kwargs
        self.__name__ = function_name(function)  # through the partial that binds kwargs

    async def __call__(self, inp: RewardInput) -> float:
        return await self.function(inp, judge=self.client, **self.kwargs)


class SyncWithJudge(WithJudge):
    """A user's sync reward function called as `fn(inp, judge=<SyncJudgeClient>, **kwargs)` in a worker process
    (module-level, so it pickles by reference)."""

    def __call__(self, inp: RewardInput) -> float:
        return self.function(inp, judge=self.client, **self.kwargs)
