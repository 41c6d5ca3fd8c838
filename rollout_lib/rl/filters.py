"""Filters between the advantages and pack stages (seed 002's zero-advantage filter).

`drop_zero_advantage_samples`: a sample whose only training signal is the rl component and whose every rl token
has advantage 0 (a group whose rewards were all equal, under a group-relative algorithm) moves the policy only
through the rl component's small KL term, yet counts in the rl denominator N_rl and costs a forward and backward.
Dropping it concentrates the step on samples that carry credit (a sample in no component at all, such as one whose
reward is missing, goes too: it trains nothing). A sample with ce or ref_kl tokens is kept whatever
its advantages (an opd group with equal rewards still carries its full teacher-KL signal), and one with rl tokens
but no advantages stream at all is left for packing to refuse (a producer bug, wire.REQUIRED_STREAMS).

When no sample of a step survives, the step keeps one of them with every weight zeroed: its micro-batch has no
token in any component, so the step trains nothing (no optimizer step) and still exists as a step.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def _carries_credit(row: dict) -> bool:
    for stream in ("ce_weights", "ref_kl_weights"):
        if row[stream] is not None and np.any(np.asarray(row[stream]) != 0):
            return True
    rl = np.asarray(row["loss_mask"], dtype=bool) if row["rl_weights"] is None else np.asarray(row["rl_weights"]) != 0
    if not rl.any():
        return False  # in no component at all (a missing reward ships this way): it trains nothing
    if row["advantages"] is None:
        return True  # rl tokens without advantages: not ours to judge, packing names the missing stream
    return bool(np.any(np.asarray(row["advantages"], dtype=np.float64)[rl] != 0))


def drop_zero_advantage_samples(samples: pa.Table) -> tuple[pa.Table, int]:
    """The samples that carry credit, and how many were dropped (module docstring)."""
    rows = samples.to_pylist()
    kept = [index for index, row in enumerate(rows) if _carries_credit(row)]
    dropped = len(rows) - len(kept)
    if kept or not rows:
        return samples.take(pa.array(kept, pa.int64())), dropped
    placeholder = {**rows[0], "rl_weights": [0.0] * len(rows[0]["input_ids"]), "ce_weights": None,
                   "ref_kl_weights": None}
    return pa.Table.from_pylist([placeholder], schema=samples.schema), dropped
