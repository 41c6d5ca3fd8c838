"""Each env's prompts, and the ones a step draws from them."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollout_lib.config.rl import DifficultyPoolsSettings, EnvSettings
from rollout_lib.data import DataError, load_env_prompts
from rollout_lib.rl.curriculum import draw_weights, weighted_draw
from rollout_lib.determinism import derived_seed


def load_prompts(env: EnvSettings, where: str | None = None) -> pa.Table:
    """The env's PROMPTS, checked against what every step draws from it; `where`: its source's locator."""
    if env.source.type == "verifiers":  # the env's verifiers environment's dataset
        from rollout_lib.envs.verifiers_data import verifiers_prompts

        table = verifiers_prompts(env, where or f"env {env.name!r}: source")
    else:
        table = load_env_prompts(env, where)
    if env.prompts_per_step > table.num_rows:
        raise DataError(f"env {env.name!r}: prompts_per_step = {env.prompts_per_step} but its source has only "
                        f"{table.num_rows} prompts")
    return table


def check_distinct_examples(prompt_tables: dict[str, pa.Table]) -> None:
    """Example ids name groups and samples across envs, so two envs may not share one."""
    # Column-wise (each env's ids are distinct already, its loader checks): a million prompts stay in Arrow.
    earlier: list[tuple[str, pa.Array]] = []
    for env, table in prompt_tables.items():
        ids = table.column("example_id").combine_chunks()
        for other, other_ids in earlier:
            shared = ids.filter(pc.is_in(ids, value_set=other_ids))
            if len(shared):
                raise DataError(f"example id {shared[0].as_py()!r} is in envs {other!r} and {env!r}; "
                                "give the JSONL rows distinct ids")
        earlier.append((env, ids))


def select_prompts(prompts: pa.Table, count: int, *, seed: int, step: int, env_index: int,
                   difficulty: Mapping[str, str] | None = None,
                   curriculum: DifficultyPoolsSettings | None = None) -> pa.Table:
    """`count` distinct prompts drawn at random for this (seed, step, env): any step's prompts are known without
    replaying the steps before it (and the curriculum state they are drawn with).

    `difficulty`: the env's curriculum state (example_id -> "easy" | "hard", rl/curriculum.py), drawn with
    `curriculum`'s weights. None, or a state with every example in one pool: the uniform draw, the same prompts as
    without a curriculum."""
    rng = np.random.default_rng(derived_seed(seed, "prompts", step, env_index))
    if difficulty is None:
        return prompts.take(rng.choice(prompts.num_rows, size=count, replace=False).tolist())
    if curriculum is None:
        raise ValueError("select_prompts: a difficulty state is drawn with a curriculum's weights; none was given")
    weights = draw_weights(prompts.column("example_id").to_pylist(), difficulty, curriculum)
    return prompts.take(weighted_draw(rng, weights, count).tolist())
