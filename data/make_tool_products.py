#!/usr/bin/env python3
"""Prompts of configs/rl-smollm2-tools.toml: products of a 2-digit and a 3-digit number ("What is 37 * 248?",
answer "9176"), which SmolLM2-135M cannot compute in its head but can hand to the `calculate` tool.

    python data/make_tool_products.py   # writes the two files below

- rl-tools-products-train.jsonl: TRAIN_ROWS prompts, random.Random(TRAIN_SEED).
- rl-tools-products-heldout.jsonl: HELDOUT_ROWS prompts of another seed, none of whose expressions is a training one.

Deterministic: one seeded `random.Random` per file, no iteration over sets.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_SEED, HELDOUT_SEED = 0, 1
TRAIN_ROWS, HELDOUT_ROWS = 256, 32


def product_rows(seed: int, count: int, exclude: frozenset[str] = frozenset()) -> list[dict]:
    rng, seen, rows = random.Random(seed), set(exclude), []
    while len(rows) < count:
        a, b = rng.randint(10, 99), rng.randint(100, 999)
        expr = f"{a} * {b}"
        if expr not in seen:
            seen.add(expr)
            rows.append({"prompt": f"What is {expr}?", "answer": str(a * b)})
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    train = product_rows(TRAIN_SEED, TRAIN_ROWS)
    exprs = frozenset(row["prompt"].removeprefix("What is ").removesuffix("?") for row in train)
    write(HERE / "rl-tools-products-train.jsonl", train)
    write(HERE / "rl-tools-products-heldout.jsonl", product_rows(HELDOUT_SEED, HELDOUT_ROWS, exprs))


if __name__ == "__main__":
    main()
