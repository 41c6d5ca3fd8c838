"""SFT samples -> every step's micro-batches (packed, or padded groups), planned before training.

Deterministic: the data order comes from the seed (`determinism.plan_batches`) and packing is
deterministic, so any step's micro-batches are known without replaying the steps before it.
"""

from __future__ import annotations

import pyarrow as pa

from rollout_lib import wire
from rollout_lib.config.sft import SftSettings
from rollout_lib.packing import batch_unpacked, pack_samples


def micro_batches_of(samples: pa.Table, settings: SftSettings) -> pa.Table:
    """One step's samples as wire.MICRO_BATCHES: packed into <= max_seq_len tokens, or padded groups."""
    if settings.packed:
        return pack_samples(samples, settings.packing.max_seq_len)
    return batch_unpacked(samples, settings.sequences_per_micro_batch, max_seq_len=settings.packing.max_seq_len)


def plan_micro_batches(samples: pa.Table, plan: pa.Table, settings: SftSettings) -> tuple[pa.Table, pa.Table]:
    """Every step's micro-batches, from a wire.BATCH_PLAN over sample rows (`determinism.plan_batches`).

    Returns (MICRO_BATCHES of all steps, one after another; BATCH_PLAN whose row_indices index that table).
    A sample drawn twice into one step (a step spanning two epochs) gets `#2` appended to its id there."""
    tables, plan_rows, offset = [], [], 0
    for step, rows in zip(plan["step"].to_pylist(), plan["row_indices"].to_pylist()):
        step_samples = samples.take(rows)
        ids = step_samples["sample_id"].to_pylist()
        if len(set(ids)) != len(ids):
            seen: dict[str, int] = {}
            for index, sample_id in enumerate(ids):
                seen[sample_id] = seen.get(sample_id, 0) + 1
                ids[index] = sample_id if seen[sample_id] == 1 else f"{sample_id}#{seen[sample_id]}"
            column = step_samples.schema.get_field_index("sample_id")
            step_samples = step_samples.set_column(column, "sample_id", pa.array(ids, pa.string()))
        table = micro_batches_of(step_samples, settings)
        tables.append(table)
        plan_rows.append({"step": step, "row_indices": list(range(offset, offset + table.num_rows))})
        offset += table.num_rows
    return (pa.concat_tables(tables).combine_chunks(), pa.Table.from_pylist(plan_rows, schema=wire.BATCH_PLAN))


def padding_stats(micro_batches: pa.Table, *, packed: bool) -> dict:
    """Tokens, positions a forward pass processes (padding included) and their ratio, without running a model."""
    lengths = micro_batches["sequence_lengths"].to_pylist()
    tokens = sum(sum(row) for row in lengths)
    positions = tokens if packed else sum(len(row) * max(row) for row in lengths)
    return {"micro_batches": len(lengths), "tokens": tokens, "positions": positions,
            "nonpad_fraction": tokens / positions if positions else 0.0}
