"""The agent driver: every (prompt, group index) of a step gets an agent run against the step's endpoint, all
concurrently, and each becomes one Episode (the ROLLOUTS row of its last training sequence).

The agents run on an event loop of their own thread, beside the endpoint (agent_server.py); sampling goes through
`generate` one request at a time on one worker thread (the policy sampler is not shared between threads). A
request's seed derives from (step seed, example, group index, request index), so a rerun of the step samples the
same tokens for the same requests. An episode's ROLLOUTS row is its last training sequence (agent_tokens.py); after
a split the ones before it ride along as `earlier_sequences` and train with the episode's advantage
(algo/stamping.py), counted in the record (`sequences`) and the step's metrics.

An interaction with `in_process = True` (a verifiers environment: envs/verifiers_env.py) runs on the same loop and
gets an InProcessEndpoint instead of a base URL: the very `complete` the HTTP endpoint answers with, called without
HTTP (no server is started), and a state dict it may fill for the env's rewards."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rollout_lib.determinism import derived_seed
from rollout_lib.envs.agent_server import MODEL_NAME, RequestError, chat_completion, serving
from rollout_lib.envs.agent_tokens import AgentTokens, assistant_message
from rollout_lib.envs.episodes import Episode, turn_text
from rollout_lib.envs.tools.parsers import PARSERS
from rollout_lib.reward.contract import as_score

log = logging.getLogger(__name__)


@dataclass
class AgentEpisode(Episode):
    """An agent's episode as recorded: its last training sequence, and the ones before it (a split)."""

    earlier: list[Episode] = field(default_factory=list)

    @property
    def sequences(self) -> int:
        return len(self.earlier) + 1

    def record(self) -> str:
        record = json.loads(super().record())
        record["sequences"] = self.sequences
        return json.dumps(record, sort_keys=True)

    def earlier_sequences(self) -> list[dict] | None:
        """The ROLLOUTS `earlier_sequences` of this episode (wire.EARLIER_SEQUENCE each), None when it is one."""
        if not self.earlier:
            return None
        return [{"prompt_ids": sequence.prompt_ids, "completion_ids": sequence.completion_ids,
                 "sampling_logprobs": sequence.logprobs, "completion_turns": sequence.turns}
                for sequence in self.earlier]


@dataclass
class _Run:
    index: int
    row: dict
    group_index: int
    tokens: AgentTokens
    requests: int = 0
    closed: bool = False  # the agent returned, failed or timed out: later requests are refused
    reward: float | None = None
    error: str | None = None
    state: dict = field(default_factory=dict)  # what an in-process agent leaves for the rewards (episode state)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # a request's prompt and sample are recorded together


class InProcessEndpoint:
    """An in-process agent's handle on its episode's endpoint: `chat_completion(body)` is a POST to
    `/episodes/<id>/v1/chat/completions` without HTTP (the same answers, refusals raised as RequestError), and
    `state` the episode's state, which the agent may fill (JSON values) for the env's rewards."""

    def __init__(self, complete, episode_id: str, state: dict):
        self._complete, self.episode_id, self.state = complete, episode_id, state

    async def chat_completion(self, body: dict) -> dict:
        return await self._complete(self.episode_id, body)


def run_agent_episodes(interaction, generate, tokenizer, prompt_rows: list[dict], prompt_ids: list[list[int]],
                       params, seed: int, stop_ids: list[int], context_limit: int | None = None,
                       on_end=None) -> list[AgentEpisode]:
    """`params.group_size` agent episodes per prompt row, prompt-major (envs.episodes.run_episodes' contract);
    `on_end` is told of each, in index order, once all have ended."""
    step = _AgentStep(interaction, generate, tokenizer, params, seed, set(stop_ids), context_limit)
    pairs = [(row, group) for row in prompt_rows for group in range(params.group_size)]
    runs = step.runs = [_Run(index, row, group, AgentTokens(row)) for index, (row, group) in enumerate(pairs)]
    _in_own_loop(step.run_all)
    if step.fatal is not None:
        raise step.fatal  # the sampler failed, not an agent: the step cannot go on
    episodes = [_episode(run, ids, interaction) for run, ids in
                zip(runs, (ids for ids in prompt_ids for _ in range(params.group_size)))]
    for index, episode in enumerate(episodes):
        if on_end is not None:
            on_end(index, episode)
    return episodes


class _AgentStep:
    def __init__(self, interaction, generate, tokenizer, params, seed, stops, context_limit):
        self.interaction, self.settings = interaction, interaction.settings
        self.generate, self.tokenizer, self.params, self.seed = generate, tokenizer, params, seed
        self.stops, self.context_limit = stops, context_limit
        self.runs: list[_Run] = []
        self.fatal: BaseException | None = None
        self.parse = PARSERS[self.settings.parser]

    async def run_all(self) -> None:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-sampler") as sampler:
            self.sampler = sampler
            if getattr(self.interaction, "in_process", False):
                await asyncio.gather(*(self.run_agent(run, InProcessEndpoint(self.complete, str(run.index), run.state))
                                       for run in self.runs))
                return
            async with serving(self.complete) as root:
                await asyncio.gather(*(self.run_agent(run, f"{root}/episodes/{run.index}/v1") for run in self.runs))

    async def run_agent(self, run: _Run, base_url) -> None:
        task = {key: run.row.get(key) for key in ("example_id", "messages", "answer", "info")}
        agent, kwargs = self.interaction.agent, getattr(self.settings, "kwargs", {})
        try:
            call = (agent(base_url, task, **kwargs) if inspect.iscoroutinefunction(agent)
                    else _in_daemon_thread(agent, base_url, task, **kwargs))
            result = await asyncio.wait_for(call, self.settings.timeout_s)
            run.reward = None if result is None else as_score(result)  # a reward function's contract
        except TimeoutError:
            run.error = f"timed out after {self.settings.timeout_s}s (interaction.timeout_s)"
        except Exception as exc:  # noqa: BLE001 - the user's agent may raise anything: its episode fails, counted
            run.error = f"{type(exc).__name__}: {exc}"
        finally:
            run.closed = True
        if run.error is not None:
            log.warning("agent %s failed on example %r (group %d) after %d requests: %s", self.interaction.name,
                        run.row.get("example_id"), run.group_index, run.requests, run.error)

    async def complete(self, episode_id: str, body: dict) -> dict:
        run = self._run_of(episode_id)
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError(400, "`messages` is a non-empty list of message objects")
        if tools is not None and not isinstance(tools, list):
            raise RequestError(400, "`tools` is a list of tool schemas")
        if body.get("n", 1) != 1 or body.get("stream"):
            raise RequestError(400, "this endpoint answers n = 1 and no streaming")
        async with run.lock:
            if run.requests >= self.settings.max_requests:
                raise RequestError(429, f"this episode has made its {self.settings.max_requests} requests "
                                        "(interaction.max_requests)")
            request_index = run.requests
            run.requests += 1
            try:
                prompt = run.tokens.prompt_for(self.tokenizer, messages, tools or None)
            except Exception as exc:  # a template's own error on the agent's messages is the agent's to read
                raise RequestError(400, f"the chat template cannot render these messages: {exc}") from exc
            max_tokens = self._max_tokens(body, len(prompt))
            params = self.params.model_copy(update={"max_tokens": max_tokens})
            request_seed = derived_seed("agent-request", self.seed, run.row["example_id"], run.group_index,
                                        request_index)
            try:
                (ids, logprobs), = await asyncio.get_running_loop().run_in_executor(
                    self.sampler, self.generate, [prompt], params, request_seed)
            except Exception as exc:
                self.fatal = self.fatal or exc
                raise RequestError(500, "the policy sampler failed") from exc
            return self._answer(run, request_index, body, prompt, list(ids), list(logprobs), tools)

    def _run_of(self, episode_id: str) -> _Run:
        if not episode_id.isdigit() or int(episode_id) >= len(self.runs):
            raise RequestError(404, f"no episode {episode_id!r} in this step")
        run = self.runs[int(episode_id)]
        if run.closed:
            raise RequestError(410, "this episode has ended (its agent returned, failed or timed out)")
        return run

    def _max_tokens(self, body: dict, prompt_length: int) -> int:
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.params.max_tokens
        if not isinstance(asked, int) or asked < 1:
            raise RequestError(400, f"max_tokens must be a positive integer, got {asked!r}")
        limit = min(asked, self.params.max_tokens)  # the env's sampling.max_tokens caps every request
        if self.context_limit is not None:
            if prompt_length >= self.context_limit:
                raise RequestError(400, f"the conversation is {prompt_length} tokens; the context limit is "
                                        f"{self.context_limit} (algorithm.rl.max_seq_len)")
            limit = min(limit, self.context_limit - prompt_length)
        return limit

    def _answer(self, run: _Run, request_index: int, body: dict, prompt: list[int], ids: list[int],
                logprobs: list[float], tools) -> dict:
        stopped = bool(ids) and ids[-1] in self.stops
        text = turn_text(self.tokenizer, ids, self.stops, keep_markup=bool(tools))
        calls, content = [], text
        if tools:
            parsed = self.parse(text)
            calls = [(call.name, call.arguments) for call in parsed.calls if call.problem is None]
            content = parsed.content if calls else text
        assistant = assistant_message(content, calls, f"call_{run.index}_{request_index}")
        run.tokens.record(ids, logprobs, text, assistant, self.stops)
        tool_calls = [{**call, "function": {"name": call["function"]["name"],
                                            "arguments": json.dumps(call["function"]["arguments"])}}
                      for call in assistant.get("tool_calls", [])]
        finish = "tool_calls" if tool_calls else "stop" if stopped else "length"
        token_logprobs = ([{"token": self.tokenizer.decode([token]), "logprob": logprob, "bytes": None,
                            "top_logprobs": []} for token, logprob in zip(ids, logprobs)]
                          if body.get("logprobs") else None)
        return chat_completion(str(run.index), request_index, body.get("model") or MODEL_NAME, content, tool_calls,
                               finish, prompt, ids, token_logprobs)


def _episode(run: _Run, task_prompt_ids: list[int], interaction) -> AgentEpisode:
    """The run's last training sequence as its episode; a run without requests has the task's prompt alone."""
    state: dict[str, Any] = {**run.state, "agent_reward": run.reward, "requests": run.requests}
    if run.error is not None:
        where = getattr(interaction.settings, "import_path", None) or interaction.name
        state["episode_error"] = f"agent {where}: {run.error}"
    sequences = run.tokens.sequences
    last = sequences[-1] if sequences else Episode(run.row, list(task_prompt_ids), {}, [])
    return AgentEpisode(run.row, last.prompt_ids, state, last.messages, last.completion_ids, last.logprobs,
                        last.turns, model_turns=run.requests, end="error" if run.error is not None else "agent",
                        earlier=sequences[:-1])


def _in_daemon_thread(function, *args, **kwargs) -> asyncio.Future:
    """A sync agent's call on a daemon thread of its own: a hung one is abandoned at its timeout, never joined."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value, error) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def target() -> None:
        try:
            value, error = function(*args, **kwargs), None
        except BaseException as exc:  # noqa: BLE001 - handed to the episode as its failure
            value, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:
            pass  # the step is over (the agent ran past its timeout): nobody waits for it

    threading.Thread(target=target, name="agent", daemon=True).start()
    return future


def _in_own_loop(coroutine_function) -> None:
    """Run the step's agents on a fresh event loop in a thread of their own (the caller may be inside a loop)."""
    outcome: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(coroutine_function())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=target, name="agent-step")
    thread.start()
    thread.join()
    if outcome:
        raise outcome[0]
