"""Checkpoints in the content-addressed store: weights and optimizer state as safetensors, a JSON manifest.

A checkpoint id is the blake3 of its manifest, so two runs that reach the same weights, optimizer state, step,
parent and settings produce the same id, byte for byte. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from rollout_lib.adapters import adapter_weights, base_of, is_adapted, load_adapter_weights
from rollout_lib.store import ObjectStore, StoreError, is_content_id

CHECKPOINT_KIND = "rollout.checkpoint/v1"
# The manifest key of an adapter checkpoint (adapters.py): {"config": adapter_config.json's dict, "base_model": the
# base's reference, "base_model_content": its content identity}; its weights are the adapter's alone.
ADAPTER_KEY = "adapter"


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict without tied duplicates (safetensors refuses shared storage); the first name is kept, which
    is the one transformers' own save_pretrained keeps (e.g. embed_tokens over a tied lm_head). An adapted (peft)
    model: its adapter's weights alone, as PEFT saves them (the frozen base is not the checkpoint's to keep)."""
    if is_adapted(model):
        return adapter_weights(model)
    state = model.state_dict()
    return {name: state[name].detach().cpu().contiguous() for name in unshared_names(state)}


def unshared_names(state: dict[str, torch.Tensor]) -> list[str]:
    """A state dict's names but those sharing storage with an earlier one (a sharded model's parameters are
    DTensors: their local shards tell the ties)."""
    seen: set[int] = set()
    names = []
    for name, tensor in state.items():
        local = getattr(tensor, "_local_tensor", tensor)
        key = local.untyped_storage().data_ptr() if local.numel() else id(tensor)
        if key in seen:
            continue
        seen.add(key)
        names.append(name)
    return names


def gathered_weights(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """model_weights of a sharded `model`, from its full state dict gathered by trainer/sharding.py."""
    if is_adapted(model):
        return adapter_weights(model, full)
    return {name: full[name].contiguous() for name in unshared_names(model.state_dict())}


def load_model_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    if is_adapted(model):
        try:
            load_adapter_weights(model, weights)
        except ValueError as exc:
            raise StoreError(f"checkpoint {exc}") from None
        return
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {name for name in missing if _is_tied(model, name, weights)}
    if unexpected or set(missing) - tied:
        raise StoreError(f"checkpoint weights do not fit the model: missing {sorted(set(missing) - tied)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")


def _is_tied(model: torch.nn.Module, name: str, weights: dict[str, torch.Tensor]) -> bool:
    param = model.state_dict().get(name)
    ptr = param.untyped_storage().data_ptr() if param is not None else None
    return any(model.state_dict()[other].untyped_storage().data_ptr() == ptr for other in weights if other != name)


def save_model_files(store: ObjectStore, model, tokenizer) -> dict[str, Any]:
    """Store what is needed to rebuild the model without its base: HF config JSON and tokenizer files (an adapted
    model's: its base's, which the adapter's weights apply to)."""
    model = base_of(model)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # GGUF-loaded models are plain fp32 weights once loaded
    config.pop("_name_or_path", None)  # a machine-specific path would break byte-identical checkpoints
    files = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            if path.is_file():
                files[path.name] = store.put_bytes(path.read_bytes())
    return {
        "architecture": type(model).__name__,
        "config": store.put_json(config),
        "tokenizer_files": files,
    }


def save_checkpoint(store: ObjectStore, *, model, optimizer, model_files: dict, step: int, parent: str | None,
                    identity: str, extra: dict[str, Any], stored: tuple[str, str] | None = None) -> str:
    """`stored`: (weights id, optimizer id) already in the store, written by a sharded trainer tensor by tensor
    (trainer/sharding.py: the same objects model_weights and optimizer_state_tensors would give), instead of
    `model` and `optimizer`'s own."""
    if stored is None:
        weights_id = store.put_tensors(model_weights(model), {"format": "pt"})
        opt_tensors, opt_meta = optimizer_state_tensors(optimizer)
        optimizer_id = store.put_tensors(opt_tensors, opt_meta)
    else:
        weights_id, optimizer_id = stored
    manifest = {
        "kind": CHECKPOINT_KIND,
        "step": step,
        "parent": parent,
        "weights": weights_id,
        "optimizer": optimizer_id,
        "model": model_files,
        "training_identity": identity,
        **extra,
    }
    return store.put_json(manifest)


def read_manifest(store: ObjectStore, checkpoint_id: str) -> dict[str, Any]:
    manifest = store.get_json(checkpoint_id)
    if not isinstance(manifest, dict) or manifest.get("kind") != CHECKPOINT_KIND:
        raise StoreError(f"object {checkpoint_id} in {store.root} is not a rollout checkpoint")
    return manifest


def restore_checkpoint(store: ObjectStore, manifest: dict, model, optimizer=None) -> None:
    load_model_weights(model, store.get_tensors(manifest["weights"]))
    if optimizer is not None:
        load_optimizer_state(optimizer, store.get_tensors(manifest["optimizer"]),
                             store.get_tensors_metadata(manifest["optimizer"]))


# Written by the exports themselves (export_hf_directory, export_adapter_directory): a tokenizer file of the same
# name would replace them.
_EXPORT_OWN_FILES = frozenset({"config.json", "model.safetensors", "adapter_config.json", "adapter_model.safetensors"})


def check_plain_file_name(name: object, checkpoint_id: str) -> str:
    """A manifest's file name, accepted only as a plain name inside the export directory: a manifest is data
    (anyone who can write to the store can write one), and `../x` or `/etc/x` would write outside `--out`."""
    plain = (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
             and "\0" not in name and name not in _EXPORT_OWN_FILES)
    if not plain:
        raise StoreError(f"checkpoint {checkpoint_id}: tokenizer file name {name!r} is not a plain file name "
                         f"(no path separators, '..', absolute paths, or {sorted(_EXPORT_OWN_FILES)})")
    return name


def is_adapter_checkpoint(manifest: dict) -> bool:
    return ADAPTER_KEY in manifest


def export_adapter_directory(store: ObjectStore, checkpoint_id: str, directory: str | Path) -> Path:
    """Write an adapter checkpoint as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors, the
    tokenizer files): what `PeftModel.from_pretrained(base, directory)` and vLLM's LoRA loading read. Its
    `base_model_name_or_path` is the reference the run trained on (`pkg:...`, a hub id, a checkpoint id)."""
    manifest = read_manifest(store, checkpoint_id)
    if not is_adapter_checkpoint(manifest):
        raise StoreError(f"checkpoint {checkpoint_id} holds full weights, not an adapter: export it as a model "
                         "directory")
    directory = _export_target(store, manifest, checkpoint_id, directory)
    (directory / "adapter_config.json").write_text(json.dumps(manifest[ADAPTER_KEY]["config"], indent=2,
                                                              sort_keys=True))
    # The weights object is already a safetensors file with PEFT's names: its bytes are the adapter file.
    (directory / "adapter_model.safetensors").write_bytes(store.get_bytes(manifest["weights"]))
    return directory


def _export_target(store: ObjectStore, manifest: dict, checkpoint_id: str, directory: str | Path) -> Path:
    """`directory`, created, with the checkpoint's tokenizer files in it (their names checked first: none may leave
    the directory or replace a file the export writes itself)."""
    names = manifest["model"]["tokenizer_files"]
    for name in names:  # all checked before anything is written
        check_plain_file_name(name, checkpoint_id)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, object_id in names.items():
        (directory / name).write_bytes(store.get_bytes(object_id))
    return directory


def export_hf_directory(store: ObjectStore, checkpoint_id: str, directory: str | Path) -> Path:
    """Write a checkpoint of full weights as a plain Hugging Face directory that `from_pretrained` loads; a causal
    LM's with a generation_config.json, so that `generate()` ends where the trained model ends a turn. (An adapter
    checkpoint: export_adapter_directory, or model/loading.export_merged_directory for its merged weights.)"""
    manifest = read_manifest(store, checkpoint_id)
    if is_adapter_checkpoint(manifest):
        raise StoreError(f"checkpoint {checkpoint_id} is a LoRA adapter: export it as a PEFT adapter directory, or "
                         "with its base merged in (`rollout export --merged`)")
    return write_model_directory(store, manifest, checkpoint_id, directory, store.get_tensors(manifest["weights"]))


def write_model_directory(store: ObjectStore, manifest: dict, checkpoint_id: str, directory: str | Path,
                          weights: dict[str, torch.Tensor]) -> Path:
    """export_hf_directory's files with `weights` as model.safetensors (the checkpoint's own, or an adapter
    checkpoint's merged into its base: model/loading.export_merged_directory)."""
    from safetensors.torch import save_file

    files = manifest["model"]
    directory = _export_target(store, manifest, checkpoint_id, directory)
    config = store.get_json(files["config"])
    config["architectures"] = [files["architecture"]]
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(weights, str(directory / "model.safetensors"), {"format": "pt"})
    # Written after the tokenizer files, so it is this one whatever a manifest names.
    if manifest.get("kind_of_model") != "reward_model":  # a sequence classifier does not generate
        from transformers import AutoTokenizer

        token_ids = generation_token_ids(AutoTokenizer.from_pretrained(str(directory)), config)
        (directory / "generation_config.json").write_text(json.dumps(token_ids, indent=2, sort_keys=True))
    return directory


def generation_token_ids(tokenizer, model_config: dict[str, Any]) -> dict[str, int | list[int]]:
    """The special tokens `generate()` needs and nothing else (no sampling defaults: vLLM reads this file for them,
    and served sampling stays what each request asks): eos (the tokenizer's, the model config's, and the token the
    chat template ends an assistant turn with, such as `<|im_end|>`), pad (the first eos when there is none, as
    `generate()` would pick) and bos."""
    eos: list[int] = []
    for candidate in (tokenizer.eos_token_id, model_config.get("eos_token_id"), _end_of_turn_id(tokenizer)):
        for token in candidate if isinstance(candidate, (list, tuple)) else [candidate]:
            if token is not None and int(token) not in eos:
                eos.append(int(token))
    pad = next((token for token in (tokenizer.pad_token_id, model_config.get("pad_token_id"), *eos[:1])
                if token is not None), None)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else model_config.get("bos_token_id")
    token_ids = {"eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": pad, "bos_token_id": bos}
    return {key: value for key, value in token_ids.items() if value not in (None, [])}


_TURN_PROBE = "rollout-end-of-turn-probe"


def _end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant message (`<|im_end|>` in ChatML), or
    None: no template, a template that will not render a user-assistant exchange, or plain text after the turn."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    from jinja2 import TemplateError

    exchange = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _TURN_PROBE}]
    try:
        text = tokenizer.apply_chat_template(exchange, tokenize=False)
    except (TemplateError, ValueError):  # its own raise_exception (e.g. it wants a system turn first): no answer
        return None
    if not isinstance(text, str) or _TURN_PROBE not in text:
        return None
    after = text[text.rindex(_TURN_PROBE) + len(_TURN_PROBE):].lstrip()
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids:
        return None
    added = tokenizer.added_tokens_decoder.get(ids[0])
    special = ids[0] in tokenizer.all_special_ids or (added is not None and added.special)
    return int(ids[0]) if special else None


def checkpoint_named(store: ObjectStore | None, reference: str) -> str | None:
    """The checkpoint id `reference` names: itself when it is one, else the id the ref of that name in `store`
    points at (`runs/<name>/latest`); None when it names none (a hub id "org/name", a path, `tiny:qwen2`, a ref not
    written yet). The one answer to "which checkpoint is this": model references and the CLI ask here."""
    if is_content_id(reference):
        return reference
    if store is None or "/" not in reference:
        return None
    try:
        return store.get_ref(reference)
    except StoreError as exc:
        if str(exc).startswith("invalid ref name"):
            return None  # not a ref's spelling: an absolute or relative path, `~/...`, a URL
        raise


def resolve_checkpoint(store: ObjectStore, reference: str) -> str:
    """The checkpoint id of a reference that must name one (a checkpoint id, or a ref such as `runs/<name>/latest`)."""
    checkpoint_id = checkpoint_named(store, reference)
    if checkpoint_id is None:
        raise StoreError(f"{reference!r} is neither a checkpoint id nor a ref in {store.root}")
    return checkpoint_id


# --- optimizer state as named tensors (safetensors: never pickle) -----------------------------------------------


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Flatten optimizer state to named tensors plus JSON metadata, for safetensors (never pickle)."""
    entries, metadata = optimizer_state_entries(optimizer.state_dict())
    return {name: value.detach().cpu().contiguous() for name, value in entries.items()}, metadata


def optimizer_state_entries(state: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An optimizer state dict (torch's index form) as the checkpoint names it: `state.<index>.<key>` -> the tensor
    as the optimizer holds it (a sharded optimizer's: a DTensor), plus the param groups as JSON metadata."""
    tensors = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value
            elif value is not None:
                tensors[f"state.{index}.{key}"] = torch.tensor(value)
    groups = [{k: v for k, v in group.items()} for group in state["param_groups"]]
    return tensors, {"param_groups": json.dumps(groups, sort_keys=True)}


def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                         metadata: dict[str, str]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        index, key = optimizer_entry(name)
        state.setdefault(index, {})[key] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": param_groups(metadata)})


def optimizer_entry(name: str) -> tuple[int, str]:
    """(parameter index, state key) of an optimizer object's tensor name, `state.<index>.<key>`."""
    _, index, key = name.split(".", 2)
    return int(index), key


def param_groups(metadata: dict[str, str]) -> list[dict]:
    """An optimizer object's param groups, from its metadata (JSON: betas back to tuples)."""
    groups = json.loads(metadata["param_groups"])
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    return groups
