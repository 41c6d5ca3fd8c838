"""A finished reward-model checkpoint used again: rebuilt from the store alone (id or ref), scoring responses."""

from __future__ import annotations

import tempfile

import pyarrow as pa

from rollout_lib.rm.evaluate import score_responses
from rollout_lib.store import ObjectStore, StoreError
from rollout_lib.checkpoint import read_manifest, resolve_checkpoint


def load_reward_checkpoint(store: ObjectStore, reference: str):
    """(model, tokenizer) rebuilt from the store (a LoRA checkpoint: merged into its base, which must be at hand;
    full weights need nothing else)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rollout_lib.model.loading import FROM_PRETRAINED, export_model_directory

    checkpoint_id = resolve_checkpoint(store, reference)
    manifest = read_manifest(store, checkpoint_id)
    if manifest.get("kind_of_model") != "reward_model":
        raise StoreError(f"checkpoint {checkpoint_id} is a {manifest.get('kind_of_model')!r}, not a reward model")
    if manifest.get("reward_head", "bradley_terry") != "bradley_terry":
        raise StoreError(f"checkpoint {checkpoint_id} is a {manifest['reward_head']} reward model: it compares two "
                         "responses and has no reward for one")
    with tempfile.TemporaryDirectory() as tmp:
        export_model_directory(store, checkpoint_id, tmp, manifest)
        with FROM_PRETRAINED:
            tokenizer = AutoTokenizer.from_pretrained(tmp)
            model = AutoModelForSequenceClassification.from_pretrained(tmp)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def score_with_checkpoint(store: ObjectStore, reference: str, responses: pa.Table, max_seq_len: int) -> pa.Table:
    model, tokenizer = load_reward_checkpoint(store, reference)
    return score_responses(model, tokenizer, responses, max_seq_len)
