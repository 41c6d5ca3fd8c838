"""The judge's tokenizer, handed to a verl-style function as `reward_model_tokenizer` (seed 004), loaded offline from
the judge's own reference: `{ model = "<ref>" }` is rollout's to serve, so its files are here; a server given by URL
names its tokenizer with `tokenizer = "<ref>"`, else its served name is tried as a hub id in the local cache (vLLM
serves a hub model under its id by default). Loaded once per run, and only for a function that takes it; plan time
checks the same reference offline, for the functions it can read (`plan_problem`)."""

from __future__ import annotations

from rollout_lib.errors import ConfigError
from rollout_lib.model.loading import ModelLoadError, load_tokenizer, locate_model, offline_problem
from rollout_lib.reward.locate import check_reference, function_signature
from rollout_lib.reward.verl import is_verl_signature, verl_arguments_taken
from rollout_lib.serving.settings import ExternalModel
from rollout_lib.settings_base import ModelRef
from rollout_lib.store import StoreError


def tokenizer_reference(judge, where: str, store_url: str | None = None) -> tuple[str, ModelRef]:
    """(the setting it comes from, the model reference) of the tokenizer of `judge` (a FrozenModel at `where`)."""
    if isinstance(judge, ExternalModel):
        if judge.tokenizer is not None:
            return f"{where}.tokenizer", judge.tokenizer
        return f"{where}.name", ModelRef(uri=judge.name)
    reference = judge.model
    if reference.store is None and store_url:
        reference = reference.model_copy(update={"store": store_url})  # a checkpoint of the run's store
    return f"{where}.model", reference


def judge_tokenizer(judge, served_models, where: str):
    """The tokenizer of `judge`; ConfigError naming the setting when it does not load offline."""
    setting, reference = tokenizer_reference(judge, where, getattr(served_models, "store_url", None))
    try:
        return load_tokenizer(locate_model(reference))
    except (ModelLoadError, StoreError, OSError, ValueError) as exc:
        raise ConfigError([(setting, " ".join(f"cannot load the judge's tokenizer (reward_model_tokenizer) offline: "
                                              f"{exc}{_hint(setting, where)}".split()))]) from None


def plan_problem(reward, where: str) -> tuple[str, str] | None:
    """(setting, problem) when the tokenizer a reward function with a judge at `where` will be handed cannot load
    offline, found without loading anything (model/loading.py's offline_problem); None otherwise, and when the
    function takes no tokenizer, when its judge is served by rollout (its model is checked as such), or when its
    source cannot be read without running it (then the run checks)."""
    if getattr(reward, "judge", None) is None or not isinstance(reward.judge, ExternalModel) or ":" not in reward.function:
        return None
    try:
        definition = check_reference(reward.function, what="reward function")
    except ValueError:
        return None  # reported by the function's own check
    if definition is None:
        return None
    signature = function_signature(definition)
    if not is_verl_signature(signature) or "reward_model_tokenizer" not in verl_arguments_taken(signature, judged=True):
        return None
    setting, reference = tokenizer_reference(reward.judge, where)
    try:
        problem = offline_problem(reference)
    except ModelLoadError as exc:
        problem = str(exc)
    return (setting, f"the judge's tokenizer (reward_model_tokenizer): {problem}{_hint(setting, where)}") if problem \
        else None


def _hint(setting: str, where: str) -> str:
    if setting.endswith(".name"):  # the served name was only a guess
        return f"; set {where}.tokenizer to the judge's tokenizer (a local directory or a cached hub id)"
    return ""
