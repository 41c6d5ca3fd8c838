"""The episode driver: model turns and environment replies, for every (prompt, group index) of a step.

Turn by turn, every episode still running gets its next model turn from one `generate` call (prompt-major order,
seeded per turn), then its interaction answers or ends it. An episode ends when the interaction says done, when
the model's turn ends without a stop token (it was cut at `max_tokens`; the interaction does not see a cut turn),
after `max_turns` model turns (the interaction still sees the last one, so its state can score it, but its reply
is not written), or when its tokens reach the context limit. What the model sampled is kept token for token; the environment's messages are
rendered by the chat template (render.py) and recorded as segments with their role (wire.TURN), so stamping can
keep them out of the rl component and echo can train on them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rollout_lib.envs.base import EnvReply, Interaction
from rollout_lib.envs.render import TemplateMismatchError, render_env_reply
from rollout_lib.determinism import derived_seed
from rollout_lib.model.chat import encode_prompt

MAX_CONCURRENT_REPLIES = 32  # threads asking an interaction with concurrent_replies for a turn's replies


class EpisodeError(ValueError):
    """An episode could not go on: the interaction failed or broke its contract, or the chat template cannot extend
    the conversation token-exactly. The message names the interaction and the example."""


# (token ids, per-token logprobs) of each sequence continued by one model turn, in order.
Generate = Callable[[list[list[int]], Any, int], list[tuple[list[int], list[float]]]]


@dataclass
class Episode:
    prompt: dict[str, Any]  # the PROMPTS row, info parsed
    prompt_ids: list[int]
    state: dict[str, Any]
    messages: list[dict[str, str]]  # the conversation so far: the prompt's messages, then every turn
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)  # wire.TURN records
    model_turns: int = 0
    end: str | None = None  # why it ended: env | max_turns | truncated | context
    # With tools: calls the model made and how many failed (episode record; the step's tool metrics). None without.
    tool_calls: int | None = None
    tool_errors: int | None = None

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add(self, ids: list[int], logprobs: list[float | None], role: str, content: str, body: tuple[int, int],
            sampled: bool) -> None:
        start = len(self.completion_ids)
        self.completion_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.turns.append({"role": role, "sampled": sampled, "start": start, "length": len(ids),
                           "body_start": start + body[0], "body_length": body[1] - body[0], "content": content})

    def earlier_sequences(self) -> list[dict] | None:
        """ROLLOUTS `earlier_sequences`: none for an episode of this driver (one sequence, append-only); an agent's
        split episode has some (agent_episodes.AgentEpisode)."""
        return None

    def record(self) -> str:
        """The `episode` column: the interaction's final state, how many model turns, and why it ended."""
        record = {"state": self.state, "turns": self.model_turns, "end": self.end}
        if self.tool_calls is not None:  # absent without tools: records from before tools stay as they were
            record.update(tool_calls=self.tool_calls, tool_errors=self.tool_errors)
        try:
            return json.dumps(record, sort_keys=True)
        except TypeError as exc:
            raise TypeError(f"an interaction's state must be JSON-serialisable: {exc}") from exc


def run_episodes(generate: Generate, tokenizer, interaction: Interaction, prompt_rows: list[dict],
                 prompt_ids: list[list[int]], params, seed: int, stop_ids: list[int],
                 context_limit: int | None = None,
                 on_end: Callable[[int, Episode], None] | None = None) -> list[Episode]:
    """`params.group_size` episodes per prompt row, prompt-major. `generate(sequences, params, seed)` continues
    each sequence by one model turn. `on_end(index, episode)`: told of each episode at the end of the turn it
    ended in (a streamed step scores it while the others play on). Raises EpisodeError when an episode cannot go
    on."""
    episodes: list[Episode] = []
    told: set[int] = set()

    def tell(every: bool = False) -> None:  # the ended ones (every one, at the end), in index order
        for index, episode in enumerate(episodes):
            if index not in told and (every or episode.end is not None):
                told.add(index)
                _call(interaction, "end", episode.prompt, episode.state)
                if on_end is not None:
                    on_end(index, episode)

    try:
        for row, ids in zip(prompt_rows, prompt_ids):
            for _ in range(params.group_size):
                episodes.append(_begin(interaction, tokenizer, row, ids, seed))
        _play(generate, tokenizer, interaction, episodes, params, seed, set(stop_ids), context_limit, tell)
    finally:  # an episode that cannot go on fails the step: the others still release what they hold
        for index, episode in enumerate(episodes):
            if index not in told:
                try:
                    interaction.end(episode.state)
                except Exception:  # noqa: BLE001 - the step's own failure is the one to report
                    pass
    return episodes


def _begin(interaction: Interaction, tokenizer, row: dict, ids: list[int], seed: int) -> Episode:
    """An episode's initial state; an env that writes before the model's first turn extends the prompt, rendered
    by the chat template with the prompt's messages (none of it is sampled)."""
    if type(interaction).begin is Interaction.begin:
        state, opening = _call(interaction, "start", row, dict(row)), []
    else:
        begun = _call(interaction, "begin", row, dict(row), derived_seed("episode-begin", seed, row["example_id"]))
        state, opening = begun if isinstance(begun, tuple) and len(begun) == 2 else (begun, None)
    if not isinstance(state, dict):
        raise EpisodeError(f"{interaction.name}.start returned {type(state).__name__} for {_example(row)}, not a dict")
    if not isinstance(opening, list) or not all(isinstance(m, dict) and set(m) == {"role", "content"}
                                                and all(isinstance(v, str) for v in m.values()) for m in opening):
        raise EpisodeError(f"{interaction.name}.begin for {_example(row)} must return (state, [{{'role': str, "
                           f"'content': str}}, ...])")
    messages = [dict(m) for m in row["messages"]] + [dict(m) for m in opening]
    prompt_ids = encode_prompt(tokenizer, messages, interaction.tool_schemas) if opening else list(ids)
    episode = Episode(row, prompt_ids, state, messages)
    if interaction.tool_schemas is not None:
        episode.tool_calls = episode.tool_errors = 0
    return episode


def _play(generate: Generate, tokenizer, interaction: Interaction, episodes: list[Episode], params, seed: int,
          stops: set[int], context_limit: int | None, tell: Callable[..., None]) -> None:
    for turn in range(interaction.settings.max_turns):
        running = [episode for episode in episodes if episode.end is None]
        if context_limit is not None:
            for episode in running:
                if len(episode.sequence) >= context_limit:
                    episode.end = "context"
            running = [episode for episode in running if episode.end is None]
        tell()  # what ended last turn (or just now, at the context limit) scores while this turn samples
        if not running:
            break
        outputs = generate([episode.sequence for episode in running], params, derived_seed("episode-turn", seed, turn))
        answered = []
        for episode, (ids, logprobs) in zip(running, outputs):
            text = turn_text(tokenizer, ids, stops, keep_markup=interaction.tool_schemas is not None)
            episode.add(list(ids), list(logprobs), "assistant", text, (0, len(ids)), sampled=True)
            episode.model_turns += 1
            episode.messages.append({"role": "assistant", "content": text})
            if not (ids and ids[-1] in stops):
                episode.end = "truncated"
            else:
                answered.append((episode, ids[-1]))
        # The replies, then each written into its episode in index order: the same episodes either way.
        for (episode, stop_token), reply in zip(answered, _replies(interaction, [e for e, _ in answered])):
            _env_turn(episode, interaction, tokenizer, stop_token, reply)
    tell(every=True)


def _replies(interaction: Interaction, episodes: list[Episode]) -> list[EnvReply]:
    """The interaction's reply to each episode's last model turn: at once on threads when it says its replies may
    run concurrently (the first failure, in episode order, is raised), else one after the other."""
    def reply(episode: Episode) -> EnvReply:
        return _call(interaction, "respond", episode.prompt, episode.state, [dict(m) for m in episode.messages])

    if not interaction.concurrent_replies or len(episodes) < 2:
        return [reply(episode) for episode in episodes]
    with ThreadPoolExecutor(max_workers=min(len(episodes), MAX_CONCURRENT_REPLIES),
                            thread_name_prefix="env-reply") as pool:
        return list(pool.map(reply, episodes))


def turn_text(tokenizer, ids: list[int], stops: set[int], keep_markup: bool) -> str:
    """A model turn's text. With tools, special tokens other than the final stop are kept: a tokenizer may make
    its tool-call markup special (`<tool_call>`), and the parser must see it."""
    if not keep_markup:
        return tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer.decode(ids[:-1] if ids and ids[-1] in stops else ids, skip_special_tokens=False)


def _example(row: dict) -> str:
    line = f" (line {row['source_line']})" if row.get("source_line") is not None else ""
    return f"example {row.get('example_id')!r}{line}"


def _call(interaction: Interaction, method: str, row: dict, *args):
    """Call the interaction; whatever it raises is its failure on this example, named so."""
    try:
        return getattr(interaction, method)(*args)
    except EpisodeError:
        raise
    except Exception as exc:  # the user's environment may raise anything: the example is what to look at
        raise EpisodeError(f"{interaction.name}.{method} failed on {_example(row)}: {type(exc).__name__}: "
                           f"{exc}") from exc


def _env_turn(episode: Episode, interaction: Interaction, tokenizer, stop_token: int, reply) -> None:
    """The interaction sees every complete model turn, the last allowed one too (its state may score it); its
    reply is written only while the model has turns left."""
    if not isinstance(reply, EnvReply):
        raise EpisodeError(f"{interaction.name}.respond returned {type(reply).__name__} for "
                           f"{_example(episode.prompt)}, not an EnvReply")
    if episode.tool_calls is not None:
        episode.tool_calls += sum(message["role"] == "tool" for message in reply.messages)
        episode.tool_errors += reply.tool_errors
    if reply.done:
        episode.end = "env"
        return
    if episode.model_turns >= interaction.settings.max_turns:
        episode.end = "max_turns"
        return
    if reply.assistant is not None:  # the model's turn re-read with its tool calls: rendered so, its tokens kept
        episode.messages[-1] = {**reply.assistant, "tool_calls": [dict(call) for call in reply.assistant["tool_calls"]]}
    try:
        ids, rendered = render_env_reply(tokenizer, episode.messages, stop_token, reply.messages,
                                         interaction.tool_schemas)
    except TemplateMismatchError as exc:
        raise EpisodeError(f"{_example(episode.prompt)}: {exc}") from exc
    for message in rendered:
        episode.add(ids[message.start:message.end], [None] * (message.end - message.start), message.role,
                    message.content, (message.body_start - message.start, message.body_end - message.start),
                    sampled=False)
    episode.messages.extend(dict(m) for m in reply.messages)
