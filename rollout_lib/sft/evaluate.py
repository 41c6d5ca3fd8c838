"""Held-out loss of a causal LM on SFT samples."""

from __future__ import annotations

import math

import pyarrow as pa
import torch

from rollout_lib.losses import masked_nll_sum
from rollout_lib.packing import collate_micro_batch, token_logprobs


@torch.no_grad()
def evaluate_nll(model, micro_batches: pa.Table, *, packed: bool, pad_token_id: int) -> dict[str, float]:
    """Held-out loss: mean NLL per trained token (ce weights), its perplexity, and the token count."""
    model.eval()
    nll, tokens = 0.0, 0
    for row in micro_batches.to_pylist():
        batch = collate_micro_batch(row, packed=packed, pad_token_id=pad_token_id)
        logprobs = token_logprobs(model, batch)  # on the model's device
        nll += masked_nll_sum(logprobs, batch["ce_weights"].to(logprobs.device)).item()
        tokens += int((batch["ce_weights"] != 0).sum())
    loss = nll / tokens if tokens else float("nan")
    return {"loss": loss, "perplexity": math.exp(loss) if tokens else float("nan"), "tokens": tokens}
