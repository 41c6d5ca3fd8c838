"""The settings shapes every part of the library shares (and the tagged union that picks one by its `type`), in a module that imports nothing of rollout_lib: the
config package builds its algorithm union from the algorithm registry, and algorithms' settings (a teacher is a
frozen model, rollout_lib/serving/settings.py) need these without importing the config package back."""

from __future__ import annotations

from typing import Annotated, Any, Union, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator


class StrictModel(BaseModel):
    """Unknown keys are errors, never silently ignored; settings are immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(StrictModel):
    """Where a model comes from: a hub id, a local directory, `pkg:<python package>` (a model shipped inside an
    installed package), `tiny:qwen2` (the project's own tiny test model, built on first use), or a checkpoint of
    rollout's store: its id (64 hex digits) or a ref such as `runs/<name>/latest`."""

    uri: str = Field(min_length=1)
    gguf_file: str | None = None
    revision: str | None = None
    # The store a checkpoint reference is looked up in; an entry point fills in its run's store. A locator, not
    # what the model is: never dumped, so never part of a training identity (the checkpoint id is, through
    # model_content_digest).
    store: str | None = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        # `base_model = "..."` (RM seed) and `[...base_model] uri = "..."` (SFT seed) are both the seed's shape.
        return {"uri": value} if isinstance(value, str) else value


# The GPUs of this node a server rollout starts takes (docs/scale.md, "GPUs placed"): split into its replicas' equal
# consecutive shares (hardware.replica_gpus), each replica seeing only its own (CUDA_VISIBLE_DEVICES). None: every GPU.
GpuList = list[Annotated[int, Field(ge=0)]] | None


def replica_gpus_problem(gpus: list[int] | None, replicas: int, remote: bool = False) -> str | None:
    """Why `gpus` cannot place `replicas` servers rollout starts (None: it can); `remote`: the servers are given by
    base_url, someone else's to place."""
    if gpus is None:
        return None
    if len(set(gpus)) < len(gpus):
        return f"gpus lists a GPU twice: {gpus}"
    if remote:
        return ("gpus places the replicas rollout starts here, and base_url names servers you run elsewhere: set "
                "their GPUs where they start (CUDA_VISIBLE_DEVICES), or leave base_url out")
    if len(gpus) % replicas:
        return f"gpus = {gpus} splits into replicas = {replicas} equal shares: list a multiple of {replicas} GPUs"
    return None


def tagged_union(types: tuple[type[BaseModel], ...], what: str, default: str | None = None) -> Any:
    """A union of settings classes chosen by their `type` (or `kind`); an unknown type names the ones that exist.
    A class whose `type` is a Literal of several values (`"parquet" | "arrow" | "hf_disk"`) is chosen by any of
    them; `default`: the type of a value that names none (`dataset = { path = "x.jsonl" }`).

    Tags are spelt `what(type)`: pydantic puts the tag into error locations, and the config's error locator leaves
    such parts out, so errors read `algorithm.rl.envs[0].algo.std_eps`, not `...algo.grpo.std_eps`."""
    names = {name: cls for cls in types for name in _type_names(cls)}
    tags = {cls: f"{what}({_type_names(cls)[0]})" for cls in types}

    def tag_of(value: Any) -> str | None:
        name = (value.get("type", value.get("kind", default)) if isinstance(value, dict)
                else getattr(value, "type", None))
        return tags[names[name]] if name in names else None

    members = tuple(Annotated[cls, Tag(tag)] for cls, tag in tags.items())
    return Annotated[Union[members], Discriminator(  # noqa: UP007
        tag_of, custom_error_type=f"unknown_{what}",
        custom_error_message=f"`type` must be one of: {', '.join(sorted(names))}")]


def _type_names(cls: type[BaseModel]) -> tuple:
    """The values a settings class's `type` takes: its Literal's, else its default."""
    field = cls.model_fields["type"]
    return get_args(field.annotation) or (field.default,)
