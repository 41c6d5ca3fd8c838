"""A frozen model in a config: a teacher, a sampling source, a judge or a reward model behind an OpenAI-compatible
server (rollout_lib/serving).

    { base_url = ["http://host:8000/v1", ...], name = "served-name" }   a server the user runs (one or more replicas)
    { model = "<model reference>" }                                      rollout serves it itself on first use

A model reference is anything `base_model` accepts (a local directory, `pkg:...`, `tiny:qwen2`, a hub id) or a
checkpoint of the run's store (its id, or a ref such as `runs/<name>/latest`). Both spellings end up as the same
client (a replica pool); only what identifies the model's *content* enters cache keys (`identity_settings`):
the served name for a user's server, the content of the model for rollout's own. Addresses, timeouts and replica counts
are resources: moving a server or adding a replica never re-runs a finished step.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, model_validator

from rollout_lib.settings_base import GpuList, ModelRef, StrictModel, replica_gpus_problem


class FrozenClientSettings(StrictModel):
    """How the pool talks to the replicas (never part of a cache key)."""

    timeout_s: float = Field(120.0, gt=0)  # per request; a hung replica costs this once, then the request fails over
    max_attempts: int = Field(3, ge=1)  # one request, tried on distinct replicas
    concurrency: int = Field(32, ge=1)  # requests in flight from one stage


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _http_urls(urls: list[str]) -> list[str]:
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {url!r} must start with http:// or https://")
    return urls


# Servers someone else runs, one URL or a list of replicas' (with or without /v1): `base_url` wherever a model is
# given by address (a frozen model, a reward model).
BaseUrls = Annotated[list[str], BeforeValidator(_one_or_many), Field(min_length=1), AfterValidator(_http_urls)]


class ExternalModel(FrozenClientSettings):
    """A model served by someone else: its replicas' base URLs and the name it is served under."""

    base_url: BaseUrls
    name: str = Field(min_length=1)
    # Its tokenizer (a model reference, loaded offline), for a judge's reward function that takes
    # `reward_model_tokenizer` (docs/rewards.md); default: `name` as a hub id in the local cache. Not an identity.
    tokenizer: ModelRef | None = None

    def identity_settings(self) -> dict:
        return {"served_name": self.name}


class ServedModel(FrozenClientSettings):
    """A model rollout serves itself (vLLM, started on first use and reused by later stages and runs)."""

    model: ModelRef
    replicas: int = Field(1, ge=1)
    max_model_len: int | None = Field(None, ge=16)  # default: the model's own, at most 2048
    # "pooling": a reward model (a sequence classifier) served with vLLM's pooling runner (`/classify`), for a reward
    # function's judge only (it scores through reward_router_address: docs/rewards.md); everything else generates.
    runner: Literal["generate", "pooling"] = "generate"
    gpus: GpuList = Field(None, min_length=1)  # where its replicas run, never what they compute: not an identity

    @model_validator(mode="after")
    def _gpus_shared_evenly(self) -> "ServedModel":
        problem = replica_gpus_problem(self.gpus, self.replicas)
        if problem:
            raise ValueError(problem)
        return self

    def identity_settings(self) -> dict:
        # The reference's spelling is not its identity: identity.training adds the content digest of what it
        # names (the same files under another path, or a checkpoint by id or by ref, are the same model).
        return {"served_by": "rollout", **({"runner": self.runner} if self.runner != "generate" else {})}


FROZEN_MODEL_TYPES = (ServedModel, ExternalModel)


def _frozen_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        if "model" in value and "base_url" not in value:
            return "frozen(served)"
        if "base_url" in value and "model" not in value:
            return "frozen(external)"
        return None
    return {ServedModel: "frozen(served)", ExternalModel: "frozen(external)"}.get(type(value))


_FROZEN_SHAPES = ('{ model = "<reference>" } (rollout serves it) or { base_url = [...], name = "..." } '
                  '(a server you run)')

FrozenModel = Annotated[
    Union[Annotated[ServedModel, Tag("frozen(served)")], Annotated[ExternalModel, Tag("frozen(external)")]],  # noqa: UP007
    Discriminator(_frozen_kind, custom_error_type="frozen_model",
                  custom_error_message=f"a frozen model is {_FROZEN_SHAPES}, not both"),
]


def named_or_frozen(*names: str):
    """A setting that is one of `names` (models the run already holds, such as "policy") or a frozen model, with
    one error message whichever shape was meant."""
    choices = ", ".join(f'"{name}"' for name in names)

    def kind(value: Any) -> str | None:
        return value if isinstance(value, str) and value in names else _frozen_kind(value)

    return Annotated[
        Union[tuple(Annotated[Literal[name], Tag(name)] for name in names)  # noqa: UP007
              + (Annotated[ServedModel, Tag("frozen(served)")], Annotated[ExternalModel, Tag("frozen(external)")])],
        Discriminator(kind, custom_error_type="model_source",
                      custom_error_message=f"must be {choices} or a frozen model: {_FROZEN_SHAPES}"),
    ]


# "policy" (the model being trained) or a frozen model: one error message, whichever shape was meant.
PolicyOrFrozen = named_or_frozen("policy")
