"""Use a trained reward-model checkpoint again: resolve it (id or ref), rebuild the model, score responses."""

from __future__ import annotations

import re
import tempfile

import pyarrow as pa

from rollout_lib.rm import score_responses
from rollout_lib.store import ObjectStore, StoreError
from rollout_lib.trainer.checkpoint import export_hf_directory, read_manifest

_HEX_ID = re.compile(r"^[0-9a-f]{64}$")


def resolve_checkpoint(store: ObjectStore, reference: str) -> str:
    """A checkpoint id, or a ref name such as `runs/<name>/latest`."""
    if _HEX_ID.match(reference):
        return reference
    checkpoint_id = store.get_ref(reference)
    if checkpoint_id is None:
        raise StoreError(f"{reference!r} is neither a checkpoint id nor a ref in {store.root}")
    return checkpoint_id


def load_reward_checkpoint(store: ObjectStore, reference: str):
    """(model, tokenizer) rebuilt from the store alone: the base model is not needed."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    checkpoint_id = resolve_checkpoint(store, reference)
    manifest = read_manifest(store, checkpoint_id)
    if manifest.get("kind_of_model") != "reward_model":
        raise StoreError(f"checkpoint {checkpoint_id} is a {manifest.get('kind_of_model')!r}, not a reward model")
    with tempfile.TemporaryDirectory() as tmp:
        export_hf_directory(store, checkpoint_id, tmp)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        model = AutoModelForSequenceClassification.from_pretrained(tmp)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def score_with_checkpoint(store: ObjectStore, reference: str, responses: pa.Table, max_seq_len: int) -> pa.Table:
    model, tokenizer = load_reward_checkpoint(store, reference)
    return score_responses(model, tokenizer, responses, max_seq_len)
