"""Attention for packed rows that computes only the blocks it needs: per-sequence SDPA ("varlen" on CPU).

transformers' packed-sequence support (`masking_utils.find_packed_sequence_indices`) hands sdpa a block-diagonal
causal mask. That is correct, but SDPA still computes the whole T x T score matrix of a packed row, so a bin of
max_seq_len tokens pays (Σ lengths)² for attention where the sequences alone pay Σ lengths²: on SmolLM2 with
512-token bins that ate most of what removing the padding saved. `packed_sdpa` runs transformers' own SDPA once per
sequence of a packed row instead: the same numbers (each sequence attends causally to itself only), without the
masked-out blocks, as flash-attention's varlen kernels do on GPU.

A packed row is a batch of one whose position ids restart at 0 (what `packing.collate_micro_batch` builds), run
without a cache. Everything else (padded batches, generation with a cache, a single sequence) goes to
transformers' sdpa unchanged, with the mask transformers builds for sdpa.

Shared prefixes (packing.py): the forward is given `packed_sequences`, one (start, end, context start, context
length) per sequence; a sequence with a context attends to those tokens (the prefix it shares, stored in another
sequence of the row) and then causally to its own, as if the prefix were stored in front of it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "rollout_packed_sdpa"


def packed_sdpa_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """query/key/value [B, heads, T, head_dim] -> ([B, T, heads, head_dim], None), like transformers' sdpa."""
    layout = kwargs.pop("packed_sequences", None)
    if layout is not None:
        return _shared_prefix_attention(module, query, key, value, layout, **kwargs), None
    bounds = _sequence_bounds(kwargs.get("position_ids"), query, key)
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)  # each sequence is causal on its own: sdpa's default without a mask
    outputs = [
        sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
                               **kwargs)[0]
        for start, end in zip(bounds, bounds[1:])
    ]
    return torch.cat(outputs, dim=1), None


def packed_sequences(lengths: list[int], contexts: list[tuple[int, int]]) -> tuple[tuple[int, int, int, int], ...]:
    """The `packed_sequences` forward argument: (start, end, context start, context length) per sequence."""
    layout, start = [], 0
    for length, (context_start, context_length) in zip(lengths, contexts):
        layout.append((start, start + length, context_start, context_length))
        start += length
    return tuple(layout)


def _shared_prefix_attention(module, query, key, value, layout, **kwargs) -> torch.Tensor:
    kwargs.pop("is_causal", None)
    outputs = []
    for start, end, context_start, context_length in layout:
        q = query[:, :, start:end]
        if not context_length:
            outputs.append(sdpa_attention_forward(module, q, key[:, :, start:end], value[:, :, start:end], None,
                                                  **kwargs)[0])
            continue
        context = slice(context_start, context_start + context_length)
        k = torch.cat([key[:, :, context], key[:, :, start:end]], dim=2)
        v = torch.cat([value[:, :, context], value[:, :, start:end]], dim=2)
        # Every prefix token, then causal over the sequence's own: the lower-right aligned causal mask.
        length = end - start
        mask = torch.ones((length, context_length + length), dtype=torch.bool, device=query.device)
        mask = torch.tril(mask, diagonal=context_length)[None, None]
        outputs.append(sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0])
    return torch.cat(outputs, dim=1)


def _sequence_bounds(position_ids: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> list[int] | None:
    """[0, start of sequence 2, ..., T] for a packed row; None for anything else."""
    length = query.shape[2]
    if position_ids is None or query.shape[0] != 1 or key.shape[2] != length or position_ids.shape[-1] != length:
        return None
    starts = torch.nonzero(position_ids.reshape(-1) == 0).flatten().tolist()
    if len(starts) < 2 or starts[0] != 0:
        return None
    return [*starts, length]


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention_forward)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # padded batches still need their mask


def use_packed_attention(model) -> None:
    """Switch a loaded transformers model to `packed_sdpa` (not saved with the model: exports stay plain)."""
    model.set_attn_implementation(PACKED_SDPA)
