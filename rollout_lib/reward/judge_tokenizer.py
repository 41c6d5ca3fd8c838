"""The judge's tokenizer, handed to a verl-style function as `reward_model_tokenizer` (seed 004), loaded offline from
the judge's own reference: `{ model = "<ref>" }` is rollout's to serve, so its files are here; a server given by URL
names its tokenizer with `tokenizer = "<ref>"`, else its served name is tried as a hub id in the local cache (vLLM
serves a hub model under its id by default). Loaded once per run, and only for a function that takes it."""

from __future__ import annotations

from rollout_lib.errors import ConfigError
from rollout_lib.model.loading import ModelLoadError, load_tokenizer, locate_model
from rollout_lib.serving.settings import ExternalModel
from rollout_lib.settings_base import ModelRef
from rollout_lib.store import StoreError


def judge_tokenizer(judge, served_models, where: str):
    """The tokenizer of `judge` (a FrozenModel at the setting `where`); ConfigError naming the setting when it does
    not load offline."""
    if isinstance(judge, ExternalModel):
        reference = judge.tokenizer or ModelRef(uri=judge.name)
        setting = f"{where}.tokenizer" if judge.tokenizer else f"{where}.name"
    else:
        reference, setting = judge.model, f"{where}.model"
        if reference.store is None and served_models is not None and served_models.store_url:
            reference = reference.model_copy(update={"store": served_models.store_url})  # a checkpoint of the run
    try:
        return load_tokenizer(locate_model(reference))
    except (ModelLoadError, StoreError, OSError, ValueError) as exc:
        hint = (f"; set {where}.tokenizer to the judge's tokenizer (a local directory or a cached hub id)"
                if isinstance(judge, ExternalModel) and judge.tokenizer is None else "")
        raise ConfigError([(setting, " ".join(f"cannot load the judge's tokenizer (reward_model_tokenizer) offline: "
                                              f"{exc}{hint}".split()))]) from None
