"""The sampler interface: prompts in, rollouts out (wire.PROMPTS -> wire.ROLLOUTS, rewards still null).

A sampler is whatever produces completions: the embedded transformers `generate` on the live policy
(`hf.py`), later a vLLM engine or an OpenAI-compatible endpoint. It registers its settings class by a `type`
name, like the algorithms, so a new backend is a new module in this package and nothing else changes: the
config's `sampler` union is built from the registry, and the pipeline only calls `Sampler.sample`.

What every sampler must guarantee:
- one ROLLOUTS row per (prompt row, group index), prompt-major: rows `g = 0..group_size-1` of prompt 0 first;
- `prompt_ids` are the tokens the completion was conditioned on (the chat template with the generation
  prompt), `completion_ids` the generated tokens up to and including the stop token, if one was produced;
- `sampling_logprobs[t]` is the log-probability the sampler drew `completion_ids[t]` with, under the same
  temperature / top_p processing it sampled from;
- the same (prompts, params, seed) on the same backend and hardware gives the same rows (CPU: bit-identical).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from rollout_lib import wire


class SamplingParams(BaseModel):
    """Per-environment sampling settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_size: int = Field(8, ge=1)  # completions per prompt
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(128, ge=1)  # new tokens per completion


class SamplerSettings(BaseModel):
    """Settings of one sampler backend; subclasses set `type: Literal["<name>"] = "<name>"`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Whether it samples from the policy being trained (then it is handed the live in-memory model).
    samples_live_policy: ClassVar[bool] = True


class Sampler(ABC):
    """A backend is built once per sample stage as `cls(settings, model, tokenizer)`: the live policy's model
    (which a remote backend ignores, or pushes to its engine) and the tokenizer that turns chat messages into
    the prompt ids it reports."""

    type_name: ClassVar[str]
    settings_class: ClassVar[type[SamplerSettings]]

    def __init__(self, settings: SamplerSettings, model, tokenizer):
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "type_name" in cls.__dict__:
            declared = cls.settings_class.model_fields.get("type")
            if declared is None or declared.default != cls.type_name:
                raise TypeError(f"{cls.settings_class.__name__} must declare type = {cls.type_name!r}")
            SAMPLERS[cls.type_name] = cls

    @abstractmethod
    def sample(self, prompts: pa.Table, params: SamplingParams, seed: int) -> pa.Table:
        """ROLLOUTS rows (reward and reward_error null) for every PROMPTS row, `params.group_size` each."""


SAMPLERS: dict[str, type[Sampler]] = {}


# --- helpers every backend shares ----------------------------------------------------------------------------


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template with the generation prompt, as token ids (the completion's conditioning context)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        if hasattr(ids, "keys"):  # some transformers versions return a BatchEncoding regardless
            ids = ids["input_ids"]
        return [int(token) for token in ids]
    # No template: the conversation's text, one message per line (base models).
    text = "\n".join(message["content"] for message in messages) + "\n"
    return [int(token) for token in tokenizer(text)["input_ids"]]


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Where a completion ends: the tokenizer's eos (end of turn for chat models) and the model's own eos ids."""
    ids: list[int] = []
    for candidate in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        for token in candidate if isinstance(candidate, (list, tuple)) else [candidate]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    if not ids:
        raise ValueError("the tokenizer and model declare no eos token: a completion could never end")
    return ids


def sample_id(example_id: str, group_index: int) -> str:
    return f"{example_id}#{group_index}"


def rollouts_table(prompts: pa.Table, group_size: int, prompt_ids: list[list[int]],
                   completions: list[tuple[list[int], list[float], str]]) -> pa.Table:
    """Assemble ROLLOUTS rows from per-prompt ids and prompt-major (ids, logprobs, text) completions."""
    rows = prompts.to_pylist()
    if len(completions) != len(rows) * group_size:
        raise ValueError(f"{len(completions)} completions for {len(rows)} prompts x group_size {group_size}")
    records: list[dict[str, Any]] = []
    for index, (ids, logprobs, text) in enumerate(completions):
        prompt_row, group_index = divmod(index, group_size)
        row = rows[prompt_row]
        if len(ids) != len(logprobs):
            raise ValueError(f"completion {index}: {len(ids)} tokens but {len(logprobs)} logprobs")
        records.append({
            "sample_id": sample_id(row["example_id"], group_index),
            "example_id": row["example_id"],
            "env": row["env"],
            "group_index": group_index,
            "prompt_ids": prompt_ids[prompt_row],
            "completion_ids": ids,
            "sampling_logprobs": logprobs,
            "completion_text": text,
            "answer": row["answer"],
            "info": row["info"],
            "reward": None,
            "reward_error": None,
        })
    return pa.Table.from_pylist(records, schema=wire.ROLLOUTS)


def prompt_messages(prompts: pa.Table) -> list[list[dict]]:
    return [[{"role": m["role"], "content": m["content"]} for m in messages]
            for messages in prompts.column("messages").to_pylist()]

