"""The sampler interface: prompts in, rollouts out (wire.PROMPTS -> wire.ROLLOUTS, rewards still null).

A sampler is whatever produces completions: the embedded transformers `generate` on the live policy
(`hf.py`), or the live policy on a vLLM policy server (`vllm.py`). It registers its settings class by a `type`
name, like the algorithms, so a new backend is a new module in this package and nothing else changes: the
config's `sampler` union is built from the registry, and the pipeline only calls `Sampler.sample`. What a backend
needs besides the model and tokenizer comes in the stage's `SamplingContext` (the policy state id, the run's
served models).

What every sampler must guarantee:
- one ROLLOUTS row per (prompt row, group index), prompt-major: rows `g = 0..group_size-1` of prompt 0 first;
- `prompt_ids` are the tokens the completion was conditioned on (the chat template with the generation
  prompt), `completion_ids` the generated tokens up to and including the stop token, if one was produced;
- `sampling_logprobs[t]` is the log-probability the sampler drew `completion_ids[t]` with, under the same
  temperature / top_p processing it sampled from;
- the same (prompts, params, seed) on the same backend and hardware gives the same rows (CPU: bit-identical; an
  engine backend: the same tokens, logprobs within ~1e-5 unless requests go one at a time);
- `sampled_from` names the weights the rows came from (the context's policy state id).

A backend defines `generate` (continue token sequences by one model turn); `sample` renders the prompts and runs
single-turn completions, or whole episodes for an env with an interaction (rollout_lib/envs): the same backend
serves both.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from rollout_lib import wire
from rollout_lib.model.chat import encode_prompt, stop_token_ids  # noqa: F401  (every backend's helpers)


class SamplingParams(BaseModel):
    """Per-environment sampling settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_size: int = Field(8, ge=1)  # completions per prompt
    temperature: float = Field(1.0, ge=0)  # 0: greedy (held-out evaluation; a group of greedy samples is one sample)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(128, ge=1)  # new tokens per completion


class SamplerSettings(BaseModel):
    """Settings of one sampler backend; subclasses set `type: Literal["<name>"] = "<name>"`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Whether it samples from the policy being trained (then it is handed the live in-memory model).
    samples_live_policy: ClassVar[bool] = True

    def identity_settings(self) -> dict:
        """What of these settings enters the training identity: by default all (the embedded sampler's batch size
        decides its seeds); a backend leaves out its resources (replicas, timeouts)."""
        return self.model_dump(mode="json")


@dataclass(frozen=True)
class SamplingContext:
    """What a sample stage knows besides the model: the policy state id the model is at (every rollouts row records
    it as `sampled_from`), and the run's served models (serving.served.ServedModels), through which a backend that
    samples on an engine owns its policy server, and the base model reference that server starts from."""

    policy_state: str | None = None
    served_models: Any = None  # serving.served.ServedModels
    base_model: Any = None  # config.common.ModelRef: what the policy server loads at start (then reloaded)


class Sampler(ABC):
    """A backend is built once per sample stage as `cls(settings, model, tokenizer, context)`: the live policy's
    model (which a remote backend pushes to its engine), the tokenizer that turns chat messages into the prompt
    ids it reports, and the stage's SamplingContext."""

    type_name: ClassVar[str]
    settings_class: ClassVar[type[SamplerSettings]]
    # Whether `generate` takes `on_done(index, completion)`, called as each sequence's completion is final (before
    # the call returns), so a streamed step scores it at once; a backend without it is told of every row at the end.
    streams_completions: ClassVar[bool] = False
    # Whether the logprobs `generate` reports are the same bits on a rerun (the embedded sampler on one machine); an
    # engine's vary in the last bits with batch composition (rl/partial.py then has the trainer compute them).
    bit_stable_logprobs: ClassVar[bool] = True

    def __init__(self, settings: SamplerSettings, model, tokenizer, context: SamplingContext | None = None):
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer
        self.context = context or SamplingContext()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "type_name" in cls.__dict__:
            declared = cls.settings_class.model_fields.get("type")
            if declared is None or declared.default != cls.type_name:
                raise TypeError(f"{cls.settings_class.__name__} must declare type = {cls.type_name!r}")
            SAMPLERS[cls.type_name] = cls

    def sync(self) -> None:
        """Bring the backend to the stage's policy state; the stage calls it before it samples (tasks/rl.py). An
        embedded backend samples from the model itself, which is at that state: nothing to do."""

    @abstractmethod
    def generate(self, sequences: list[list[int]], params: SamplingParams,
                 seed: int) -> list[tuple[list[int], list[float]]]:
        """Each sequence continued by one model turn: (token ids up to and including the stop token if one was
        produced, the logprob each was drawn with), in order. Seeded: the same call gives the same tokens. A backend
        with `streams_completions` also takes `on_done=None`, called with (index, completion) as each is final."""

    def sample(self, prompts: pa.Table, params: SamplingParams, seed: int, interaction=None,
               context_limit: int | None = None, on_rollout: OnRollout | None = None) -> pa.Table:
        """ROLLOUTS rows (reward and reward_error null) for every PROMPTS row, `params.group_size` each; with an
        interaction (envs.base.Interaction), each row is a whole episode of at most `context_limit` tokens.
        `on_rollout(index, row)`: told of each row as soon as it is final (RolloutRows), in any order."""
        tools = interaction.tool_schemas if interaction is not None else None  # an env's tools frame its prompts
        prompt_ids = [encode_prompt(self.tokenizer, messages, tools) for messages in prompt_messages(prompts)]
        sampled_from = self.context.policy_state
        if interaction is not None:
            return sample_episodes(self.generate, self.tokenizer, interaction, prompts, prompt_ids, params, seed,
                                   stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None)),
                                   context_limit, sampled_from, on_rollout=on_rollout)
        rows = RolloutRows(prompts, params.group_size, prompt_ids, sampled_from=sampled_from, on_rollout=on_rollout)

        def done(index: int, completion: tuple[list[int], list[float]]) -> None:
            ids, logprobs = completion
            rows.add(index, ids, logprobs, self.tokenizer.decode(ids, skip_special_tokens=True))

        # Prompt-major: the group of prompt 0, then of prompt 1, ...
        sequences = [ids for ids in prompt_ids for _ in range(params.group_size)]
        if self.streams_completions:
            self.generate(sequences, params, seed, on_done=done)
        else:
            for index, completion in enumerate(self.generate(sequences, params, seed)):
                done(index, completion)
        return rows.table()


SAMPLERS: dict[str, type[Sampler]] = {}


# --- helpers every backend shares ----------------------------------------------------------------------------


def sample_id(example_id: str, group_index: int) -> str:
    return f"{example_id}#{group_index}"


def sample_episodes(generate, tokenizer, interaction, prompts: pa.Table, prompt_ids: list[list[int]],
                    params: SamplingParams, seed: int, stop_ids: list[int], context_limit: int | None,
                    sampled_from: str | None = None, on_rollout: OnRollout | None = None) -> pa.Table:
    """ROLLOUTS of whole episodes (envs/episodes.py), with their turns and episode records; `on_rollout` is told of
    each episode's row when it ends (at the end of the turn it ended in)."""
    from rollout_lib.envs.episodes import run_episodes

    rows = prompts.to_pylist()
    for row in rows:
        row["info"] = json.loads(row["info"]) if row["info"] else {}
    table = RolloutRows(prompts, params.group_size, prompt_ids, sampled_from=sampled_from, on_rollout=on_rollout)

    def ended(index: int, episode) -> None:
        table.add(index, episode.completion_ids, episode.logprobs,
                  tokenizer.decode(episode.completion_ids, skip_special_tokens=True), (episode.turns, episode.record()),
                  prompt_ids=episode.prompt_ids, earlier_sequences=episode.earlier_sequences())

    if interaction.drives_itself:  # an agent (envs/agent.py): it makes its own requests
        interaction.run_episodes(generate, tokenizer, rows, prompt_ids, params, seed, stop_ids, context_limit,
                                 on_end=ended)
    else:
        run_episodes(generate, tokenizer, interaction, rows, prompt_ids, params, seed, stop_ids, context_limit,
                     on_end=ended)
    return table.table()


# Told of one ROLLOUTS row (a dict, as wire.ROLLOUTS) by its prompt-major index, once the row is final.
OnRollout = Callable[[int, dict], None]


class RolloutRows:
    """A stage's ROLLOUTS rows, added as their completions finish, in any order: each handed to `on_rollout` when
    added, and the table, prompt-major, once all are in. The table is the same whatever the order rows came in,
    and each row handed over is the very dict the table is built from."""

    def __init__(self, prompts: pa.Table, group_size: int, prompt_ids: list[list[int]], *,
                 sampled_from: str | None = None, on_rollout: OnRollout | None = None):
        self.prompt_rows = prompts.to_pylist()
        self.group_size = group_size
        self.prompt_ids = prompt_ids
        self.sampled_from = sampled_from
        self.on_rollout = on_rollout
        self.records: list[dict[str, Any] | None] = [None] * (len(self.prompt_rows) * group_size)

    def add(self, index: int, ids: list[int], logprobs: list[float | None], text: str,
            episode: tuple[list[dict], str] | None = None, prompt_ids: list[int] | None = None,
            earlier_sequences: list[dict] | None = None) -> None:
        """Completion `index` (prompt-major): its tokens, their logprobs, its text, and for a multi-turn env its
        (turns, episode record); `prompt_ids`: what it was conditioned on when not the prompt row's rendering (an
        agent frames its own requests); `earlier_sequences`: an agent episode's sequences before this one."""
        if len(ids) != len(logprobs):
            raise ValueError(f"completion {index}: {len(ids)} tokens but {len(logprobs)} logprobs")
        prompt_row, group_index = divmod(index, self.group_size)
        row = self.prompt_rows[prompt_row]
        turns, record = episode if episode is not None else (None, None)
        self.records[index] = {
            "sample_id": sample_id(row["example_id"], group_index),
            "example_id": row["example_id"],
            "env": row["env"],
            "group_index": group_index,
            "prompt_ids": self.prompt_ids[prompt_row] if prompt_ids is None else prompt_ids,
            "completion_ids": ids,
            "sampling_logprobs": logprobs,
            "completion_text": text,
            "answer": row["answer"],
            "info": row["info"],
            "reward": None,
            "reward_error": None,
            "completion_turns": turns,
            "episode": record,
            "sampled_from": self.sampled_from,
            "earlier_sequences": earlier_sequences,
        }
        if self.on_rollout is not None:
            self.on_rollout(index, self.records[index])

    def table(self) -> pa.Table:
        missing = sum(record is None for record in self.records)
        if missing:
            raise ValueError(f"{len(self.records) - missing} completions for {len(self.prompt_rows)} prompts x "
                             f"group_size {self.group_size}")
        return pa.Table.from_pylist(self.records, schema=wire.ROLLOUTS)


def rollouts_table(prompts: pa.Table, group_size: int, prompt_ids: list[list[int]],
                   completions: list[tuple[list[int], list[float | None], str]],
                   episodes: list[tuple[list[dict], str]] | None = None, *,
                   sampled_from: str | None = None) -> pa.Table:
    """Assemble ROLLOUTS rows from per-prompt ids and prompt-major (ids, logprobs, text) completions, and for a
    multi-turn env each one's (turns, episode record); `sampled_from`: what sampled them (wire.ROLLOUTS)."""
    rows = RolloutRows(prompts, group_size, prompt_ids, sampled_from=sampled_from)
    if len(completions) != len(rows.records):
        raise ValueError(f"{len(completions)} completions for {prompts.num_rows} prompts x group_size {group_size}")
    for index, (ids, logprobs, text) in enumerate(completions):
        rows.add(index, ids, logprobs, text, episodes[index] if episodes is not None else None)
    return rows.table()


def prompt_messages(prompts: pa.Table) -> list[list[dict]]:
    return [[{"role": m["role"], "content": m["content"]} for m in messages]
            for messages in prompts.column("messages").to_pylist()]

