"""Model references that name a checkpoint of the store: its id (64 hex digits) or a ref such as
`runs/<name>/latest`. Everything else is an ordinary model reference (model/loading.py). A checkpoint id is a
model reference everywhere, so stages chain without an export step."""

from __future__ import annotations

import re
from pathlib import Path

from rollout_lib.model.loading import model_content_digest
from rollout_lib.store import ObjectStore

_CHECKPOINT_ID = re.compile(r"^[0-9a-f]{64}$")


def checkpoint_in_store(uri: str, store: ObjectStore | None) -> str | None:
    """The checkpoint id `uri` names in `store`, or None when it names no checkpoint (a local directory of that
    name wins over a ref of the same spelling)."""
    if _CHECKPOINT_ID.match(uri):
        return uri
    if store is None or Path(uri).expanduser().is_dir() or "/" not in uri:
        return None
    return store.get_ref(uri)


def content_identity(ref, store: ObjectStore | None) -> str:
    """What a served model's weights are, for cache keys: the checkpoint id, or the model's content digest."""
    checkpoint_id = checkpoint_in_store(ref.uri, store)
    return f"checkpoint:{checkpoint_id}" if checkpoint_id else model_content_digest(ref)
