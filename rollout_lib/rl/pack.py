"""The pack stage: a step's training samples -> micro-batches (packed, each group's prompt stored once; or padded
groups), after the optional zero-advantage filter (rl/filters.py)."""

from __future__ import annotations

import pyarrow as pa

from rollout_lib.config.rl import RlConfig
from rollout_lib.packing import batch_unpacked, pack_samples
from rollout_lib.rl.filters import drop_zero_advantage_samples


def pack(config: RlConfig, samples: pa.Table) -> tuple[pa.Table, dict]:
    settings = config.settings
    metrics = {}
    if settings.zero_advantage_filter:
        samples, dropped = drop_zero_advantage_samples(samples)
        metrics["filtered/zero_advantage"] = dropped
    if settings.packing:
        micro_batches = pack_samples(samples, config.packed_tokens, share_prefixes=settings.share_prompt_prefix)
    else:
        micro_batches = batch_unpacked(samples, settings.sequences_per_micro_batch, max_seq_len=settings.max_seq_len)
    # Prompt tokens the forward does not run again because a sample of the same group carries them.
    shared = sum(sum(lengths) for lengths in micro_batches["shared_prefix_lengths"].to_pylist())
    return micro_batches, {"packed_micro_batches": micro_batches.num_rows, "shared_prefix_tokens": shared, **metrics}
