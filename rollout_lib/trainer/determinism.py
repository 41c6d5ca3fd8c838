"""Deterministic CPU training: what a byte-identical resume depends on."""

from __future__ import annotations

import blake3
import torch


def use_deterministic_torch() -> None:
    torch.use_deterministic_algorithms(True, warn_only=False)


def seed_for_step(seed: int, step: int) -> int:
    """A per-step RNG seed derived from (run seed, step): replaying step k needs no stored RNG state."""
    return int.from_bytes(blake3.blake3(f"{seed}:{step}".encode()).digest()[:8], "little") & ((1 << 63) - 1)
