"""The pack stage: a step's training samples -> micro-batches (packed, or padded groups)."""

from __future__ import annotations

import pyarrow as pa

from rollout_lib.config.rl import RlConfig
from rollout_lib.packing import batch_unpacked, pack_samples


def pack(config: RlConfig, samples: pa.Table) -> tuple[pa.Table, dict]:
    settings = config.settings
    if settings.packing:
        micro_batches = pack_samples(samples, config.packed_tokens)
    else:
        micro_batches = batch_unpacked(samples, settings.sequences_per_micro_batch, max_seq_len=settings.max_seq_len)
    return micro_batches, {"packed_micro_batches": micro_batches.num_rows}
