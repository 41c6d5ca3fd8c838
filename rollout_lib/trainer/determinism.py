"""Deterministic CPU training: what a byte-identical resume depends on."""

from __future__ import annotations

import blake3
import numpy as np
import pyarrow as pa
import torch

from rollout_lib import wire


def use_deterministic_torch() -> None:
    torch.use_deterministic_algorithms(True, warn_only=False)


def derived_seed(*parts: object) -> int:
    """A 63-bit RNG seed derived from its parts (run seed, stage name, step, ...), joined with ':'."""
    return int.from_bytes(blake3.blake3(":".join(map(str, parts)).encode()).digest()[:8], "little") & ((1 << 63) - 1)


def seed_for_step(seed: int, step: int) -> int:
    """A per-step RNG seed derived from (run seed, step): replaying step k needs no stored RNG state."""
    return derived_seed(seed, step)


def plan_batches(num_rows: int, minibatch_size: int, max_steps: int, seed: int) -> pa.Table:
    """Row indices of every step's minibatch (wire.BATCH_PLAN): a fresh seeded permutation per epoch, consumed
    in order, so the data order is a function of the seed and any step's rows are known without replaying."""
    needed = minibatch_size * max_steps
    order: list[int] = []
    epoch = 0
    while len(order) < needed:
        order.extend(np.random.default_rng([seed, epoch]).permutation(num_rows).tolist())
        epoch += 1
    return pa.Table.from_pydict(
        {"step": list(range(1, max_steps + 1)),
         "row_indices": [order[i * minibatch_size:(i + 1) * minibatch_size] for i in range(max_steps)]},
        schema=wire.BATCH_PLAN,
    )
