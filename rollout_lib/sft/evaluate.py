"""Held-out loss of a causal LM on SFT samples, and each sample's share of it."""

from __future__ import annotations

import math

import pyarrow as pa
import torch

from rollout_lib import wire
from rollout_lib.losses import masked_nll_sum
from rollout_lib.packing import collate_micro_batch, token_logprobs


@torch.no_grad()
def evaluate_nll(model, micro_batches: pa.Table, *, packed: bool, pad_token_id: int) -> dict[str, float]:
    """Held-out loss: mean NLL per trained token (ce weights), its perplexity, and the token count."""
    return evaluate_nll_with_rows(model, micro_batches, packed=packed, pad_token_id=pad_token_id)[0]


@torch.no_grad()
def evaluate_nll_with_rows(model, micro_batches: pa.Table, *, packed: bool,
                           pad_token_id: int) -> tuple[dict[str, float], pa.Table]:
    """`evaluate_nll`'s metrics and one wire.SFT_EVAL_ROWS row per sample: a micro-batch's flat per-token streams
    split at its sequence boundaries (`sequence_lengths`, the same order packed or padded). The metrics sum each
    micro-batch at once, as before; the rows' sums add up to them within float rounding."""
    model.eval()
    nll, tokens = 0.0, 0
    rows: dict[str, list] = {name: [] for name in wire.SFT_EVAL_ROWS.names}
    for row in micro_batches.to_pylist():
        batch = collate_micro_batch(row, packed=packed, pad_token_id=pad_token_id)
        logprobs = token_logprobs(model, batch)  # on the model's device
        weights = batch["ce_weights"].to(logprobs.device)
        nll += masked_nll_sum(logprobs, weights).item()
        tokens += int((batch["ce_weights"] != 0).sum())
        lengths = batch["sequence_lengths"].tolist()
        for sample_id, token_nll, token_weights in zip(row["sample_ids"], torch.split(-(weights * logprobs), lengths),
                                                       torch.split(weights, lengths)):
            sample_nll, sample_tokens = token_nll.double().sum().item(), int((token_weights != 0).sum())
            rows["sample_id"].append(sample_id)
            rows["nll_sum"].append(sample_nll)
            rows["tokens"].append(sample_tokens)
            rows["loss"].append(sample_nll / sample_tokens if sample_tokens else float("nan"))
    loss = nll / tokens if tokens else float("nan")
    metrics = {"loss": loss, "perplexity": math.exp(loss) if tokens else float("nan"), "tokens": tokens}
    return metrics, pa.Table.from_pydict(rows, schema=wire.SFT_EVAL_ROWS)
