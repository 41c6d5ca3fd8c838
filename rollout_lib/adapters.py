"""LoRA adapters (peft): the settings, a model wrapped with one, and the adapter's weights in PEFT's own format.

    [algorithm.sft.adapter]            # also algorithm.rm.adapter, algorithm.rl.adapter
    type = "lora"
    r = 16
    alpha = 32
    dropout = 0.0
    target_modules = "all-linear"      # or module names: ["q_proj", "v_proj"]

With an adapter only the LoRA matrices train (and, for a reward model, its score head, in full: peft's
`modules_to_save` for a sequence classifier); the base model's weights are frozen and never written again. A
checkpoint then holds the adapter's weights alone, named as PEFT's `adapter_model.safetensors` names them
(`get_peft_model_state_dict`: no adapter name in the keys), so the weights object of an adapter checkpoint IS a
PEFT adapter file, and `adapter_config()` its adapter_config.json. The manifest records the base model and its
content identity (checkpoint.ADAPTER_KEY): an adapter is meaningless without the exact weights it was trained on.

A ground-floor module: it knows peft and nothing of the store. checkpoint.py saves and restores through it;
model/loading.py merges an adapter checkpoint into its base when a checkpoint is used as a model (a base_model, a
teacher, a reward model); `rollout export` writes the PEFT directory or the merged weights.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from pydantic import Field, field_validator

from rollout_lib.settings_base import StrictModel


class AdapterError(ValueError):
    """An adapter that cannot be applied (target modules that match nothing); the message names the setting."""


class LoraSettings(StrictModel):
    """A LoRA adapter (peft's LoraConfig): W + (alpha / r) * B @ A on each target module, B initialised to zero (the
    adapted model starts as its base), A from the run's seed."""

    type: Literal["lora"] = "lora"
    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # "all-linear": every linear layer but the output head (peft's and TRL's spelling); or module names, matched
    # as peft matches them (a name matches a module whose own name or dotted suffix it is).
    target_modules: list[str] | Literal["all-linear"] = "all-linear"

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value):
        if isinstance(value, list) and (not value or any(not name for name in value)):
            raise ValueError('name at least one module (e.g. ["q_proj", "v_proj"]), or "all-linear"')
        return value


AdapterSettings = LoraSettings  # the one adapter type so far; a union when another arrives


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (trains, saves and loads as an adapter)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (the model itself when not adapted)."""
    return model.get_base_model() if is_adapted(model) else model


def target_problem(model: torch.nn.Module, settings: LoraSettings) -> str | None:
    """Why `settings.target_modules` does not fit `model` (a real model or a skeleton on the meta device), or None.
    Stricter than peft, which only refuses a list when no name matches: a misspelt name among right ones would be
    silently left out of training."""
    if settings.target_modules == "all-linear":
        return None
    names = [name for name, _ in model.named_modules()]
    unmatched = [target for target in settings.target_modules
                 if not any(name == target or name.endswith("." + target) for name in names)]
    if not unmatched:
        return None
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear)})
    return (f"{', '.join(map(repr, unmatched))} match{'es' if len(unmatched) == 1 else ''} no module of "
            f"{type(model).__name__}; its linear layers are {', '.join(linear)} (or use \"all-linear\")")


def with_adapter(model: torch.nn.Module, settings: LoraSettings, *, task: Literal["causal_lm", "reward_model"],
                 where: str) -> torch.nn.Module:
    """`model` wrapped with a fresh adapter (its A matrices drawn from torch's RNG: seed it first); only the adapter
    (and a reward model's head) requires grad. `where`: the settings' locator, for the errors."""
    from peft import LoraConfig, get_peft_model

    problem = target_problem(model, settings)
    if problem is not None:
        raise AdapterError(f"{where}.target_modules: {problem}")
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=settings.target_modules,
                        task_type="SEQ_CLS" if task == "reward_model" else "CAUSAL_LM")
    with warnings.catch_warnings():  # peft asks transformers 5 by a name it deprecates (is_gradient_checkpointing)
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*is_gradient_checkpointing.*")
        return get_peft_model(model, config)


def adapter_weights(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter's weights as PEFT saves them (adapter_model.safetensors' names and tensors), on the CPU: the
    model's own, or taken from `state` (its full state dict, gathered from a sharded model)."""
    from peft import get_peft_model_state_dict

    return {name: tensor.detach().cpu().contiguous()
            for name, tensor in get_peft_model_state_dict(model, state_dict=state).items()}


def load_adapter_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Put saved adapter weights (adapter_weights' names) into a peft model; every one must fit and none be missing."""
    from peft import set_peft_model_state_dict

    expected = adapter_weights(model).keys()
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"adapter weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    result = set_peft_model_state_dict(model, weights)
    if result.unexpected_keys:
        raise ValueError(f"adapter weights do not fit the model: unexpected {sorted(result.unexpected_keys)[:5]}")


# The adapter_config.json entries rollout writes: what defines a LoRA adapter, not every field peft's release
# knows (a newer peft adds fields, and a checkpoint's id must not change with the library). peft and vLLM fill the
# rest with their defaults, which are what training used.
ADAPTER_CONFIG_KEYS = ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "bias",
                       "modules_to_save", "use_rslora", "use_dora", "fan_in_fan_out")


def adapter_config(model: torch.nn.Module, base_model: str) -> dict:
    """adapter_config.json of the model's adapter (what peft and vLLM read), naming `base_model`; target modules
    written as the module names they resolve to (`q_proj`, ...), not one path per layer."""
    config = model.peft_config["default"].to_dict()
    written = {key: config[key] for key in ADAPTER_CONFIG_KEYS if key in config}
    written["target_modules"] = sorted({name.rsplit(".", 1)[-1] for name in config["target_modules"]})
    if written.get("modules_to_save") is not None:
        written["modules_to_save"] = sorted(written["modules_to_save"])
    for key, value in written.items():  # enums as their JSON value
        if hasattr(value, "value"):
            written[key] = value.value
    return {**written, "base_model_name_or_path": base_model, "inference_mode": True}


# adapter_config.json's entries that describe the file rather than configure the adapter (the base it names is the
# model given: peft would warn that it was "renamed").
_NOT_SETTINGS = ("peft_type", "auto_mapping", "base_model_name_or_path", "revision")


def apply_saved_adapter(model: torch.nn.Module, config: dict, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`model` (a base) with a saved adapter (adapter_config's dict, adapter_weights) attached."""
    from peft import LoraConfig, get_peft_model

    known = set(LoraConfig.__dataclass_fields__)
    with warnings.catch_warnings():  # as in with_adapter
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*is_gradient_checkpointing.*")
        adapter = get_peft_model(model, LoraConfig(**{key: value for key, value in config.items()
                                                      if key in known and key not in _NOT_SETTINGS}))
    load_adapter_weights(adapter, weights)
    return adapter


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict the base model would have with the adapter merged in, under the base's own names
    (`model.layers.0.self_attn.q_proj.weight`), without touching `model`: W + scale * B @ A computed into new
    tensors for each adapted layer (peft's get_delta_weight), every other tensor as it is. A plain model: its
    state dict."""
    if not is_adapted(model):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base = base_of(model)
    deltas = {name: module.get_delta_weight("default") for name, module in base.named_modules()
              if isinstance(module, LoraLayer) and "default" in module.lora_A}
    state = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        layer = plain.rsplit(".", 1)[0]
        if name.endswith(".base_layer.weight") and layer in deltas:
            tensor = tensor + deltas[layer].to(tensor.dtype)
        state[plain] = tensor
    return state


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """The base model with the adapter folded into its weights (W + (alpha / r) * B @ A), peft's wrapper gone."""
    return model.merge_and_unload() if is_adapted(model) else model
