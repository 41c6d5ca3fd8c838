"""Deterministic CPU training: what a byte-identical resume depends on."""

from __future__ import annotations

import functools
import threading

import blake3
import numpy as np
import pyarrow as pa
import torch

from rollout_lib import wire


# torch's default RNG is one per process. A stage that seeds it and draws from it (a training step's dropout, the
# embedded sampler) holds this lock for the whole seed-and-draw, so a stage running in another thread (off-policy
# sampling beside training) can never reseed it or draw from it in between.
GLOBAL_RNG = threading.RLock()


def seed_torch(seed: int) -> None:
    """torch.manual_seed's effect on the CPU generator, without its per-call cost where no GPU is in use:
    torch.manual_seed also queues a lazy seed for CUDA, XPU and MTIA, each capturing a Python stack trace (~0.5-1 ms
    a call, as much as a whole tiny-model step). CUDA generators are seeded too when CUDA is available."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def use_deterministic_torch(threads: int) -> None:
    """Deterministic kernels, and a pinned thread count (`run.torch_threads`): CPU reductions split across
    threads round differently, so the same count is part of what makes checkpoints byte-identical."""
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.set_num_threads(threads)


def derived_seed(*parts: object) -> int:
    """A 63-bit RNG seed derived from its parts (run seed, stage name, step, ...), joined with ':'."""
    return int.from_bytes(blake3.blake3(":".join(map(str, parts)).encode()).digest()[:8], "little") & ((1 << 63) - 1)


def seed_for_step(seed: int, step: int) -> int:
    """A per-step RNG seed derived from (run seed, step): replaying step k needs no stored RNG state."""
    return derived_seed(seed, step)


def step_rows(num_rows: int, minibatch_size: int, seed: int, step: int) -> list[int]:
    """Row indices of step `step`'s minibatch: a fresh seeded permutation of the rows per epoch, consumed in order.

    A function of (rows, minibatch size, seed, step) alone: any step's rows are known without replaying, and
    they do not depend on the run's length, so extending a run keeps every earlier step's data."""
    start = (step - 1) * minibatch_size
    rows: list[int] = []
    epoch = start // num_rows
    offset = start % num_rows
    while len(rows) < minibatch_size:
        order = _epoch_order(num_rows, seed, epoch)
        rows.extend(order[offset:offset + minibatch_size - len(rows)])
        epoch, offset = epoch + 1, 0
    return rows


@functools.lru_cache(maxsize=4)
def _epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    return np.random.default_rng([seed, epoch]).permutation(num_rows).tolist()


def plan_batches(num_rows: int, minibatch_size: int, max_steps: int, seed: int) -> pa.Table:
    """Every step's rows (`step_rows`) as a wire.BATCH_PLAN table."""
    return pa.Table.from_pydict(
        {"step": list(range(1, max_steps + 1)),
         "row_indices": [step_rows(num_rows, minibatch_size, seed, step) for step in range(1, max_steps + 1)]},
        schema=wire.BATCH_PLAN,
    )
