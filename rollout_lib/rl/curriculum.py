"""Difficulty-pool curricula: which prompts a step draws, fed back from how each example's groups scored.

Per env, every example is in one of three pools: "easy" (its last scored group had every reward >= easy_threshold),
"hard" (every reward <= hard_threshold) or normal (anything else, or never scored). A step draws its prompts
without replacement with weight easy_weight, hard_weight and 1.0, so a step spends less of its batch on groups
whose advantages are all zero (a group-relative algorithm learns nothing from a unanimous group).

The state is a plain JSON value, `{env: {example_id: "easy" | "hard"}}` (normal is implied by absence), so a run
can store it as a content-addressed record: `state_json` is its one byte string. The functions here are pure: the
advantages stage of step m produces `update_state(state after step m-1, scored rollouts of step m)`, and the sample
stage of step m draws with the state after step m-1-k (k = max_off_policy_steps).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from rollout_lib.config.rl import DifficultyPoolsSettings
from rollout_lib.store import canonical_json

POOLS = ("easy", "hard")  # what the state records; "normal" is every example it does not name


def initial_state() -> dict:
    """Before any step: every example of every env is normal."""
    return {}


def state_json(state: Mapping[str, Mapping[str, str]]) -> bytes:
    """The state's one byte string (sorted keys, no whitespace): what a content id of the state hashes."""
    return canonical_json(state)


def pool_of(rewards: Sequence[float | None], settings: DifficultyPoolsSettings) -> str | None:
    """The pool a group's rewards put its example in ("easy", "hard" or "normal"); None when any reward is missing
    (or not finite): a partly scored group says nothing, so the example keeps its pool."""
    if not rewards or any(reward is None or not math.isfinite(reward) for reward in rewards):
        return None
    if all(reward >= settings.easy_threshold for reward in rewards):
        return "easy"
    if all(reward <= settings.hard_threshold for reward in rewards):
        return "hard"
    return "normal"


def update_state(state: Mapping[str, Mapping[str, str]], scored_rollouts: pa.Table,
                 settings_by_env: Mapping[str, DifficultyPoolsSettings], *,
                 num_examples: Mapping[str, int] | None = None) -> tuple[dict, dict]:
    """The state after a step's scored ROLLOUTS (columns env, example_id, reward), and metrics.

    Every (env, example_id) group of an env in `settings_by_env` moves to the pool its rewards say (pool_of); a
    group with a missing reward leaves its example where it was. Envs without a curriculum are not tracked; the
    state of envs absent from `settings_by_env` is kept as it is. `state` is not modified.

    Metrics, per env with a curriculum: `curriculum/<env>/easy`, `/hard` (pool sizes after the step), `/moved`
    (examples whose pool this step changed) and, with `num_examples` (env -> its prompt count), `/normal`."""
    missing = {"env", "example_id", "reward"} - set(scored_rollouts.column_names)
    if missing:
        raise ValueError(f"update_state reads ROLLOUTS columns env, example_id, reward; missing {sorted(missing)}")
    groups: dict[tuple[str, str], list[float | None]] = {}
    for env, example_id, reward in zip(scored_rollouts.column("env").to_pylist(),
                                       scored_rollouts.column("example_id").to_pylist(),
                                       scored_rollouts.column("reward").to_pylist()):
        if env in settings_by_env:
            groups.setdefault((env, example_id), []).append(reward)
    pools = {env: dict(examples) for env, examples in state.items()}
    moved = dict.fromkeys(settings_by_env, 0)
    for (env, example_id), rewards in groups.items():
        pool = pool_of(rewards, settings_by_env[env])
        if pool is None:
            continue
        examples = pools.setdefault(env, {})
        before = examples.get(example_id, "normal")
        if pool == "normal":
            examples.pop(example_id, None)
        else:
            examples[example_id] = pool
        moved[env] += pool != before
    new_state = {env: dict(sorted(examples.items())) for env, examples in sorted(pools.items()) if examples}
    metrics = {}
    for env in sorted(settings_by_env):
        examples = new_state.get(env, {})
        counts = {pool: sum(value == pool for value in examples.values()) for pool in POOLS}
        metrics[f"curriculum/{env}/easy"] = counts["easy"]
        metrics[f"curriculum/{env}/hard"] = counts["hard"]
        metrics[f"curriculum/{env}/moved"] = moved[env]
        if num_examples is not None and env in num_examples:
            metrics[f"curriculum/{env}/normal"] = num_examples[env] - counts["easy"] - counts["hard"]
    return new_state, metrics


def draw_weights(example_ids: Sequence[str], difficulty: Mapping[str, str],
                 settings: DifficultyPoolsSettings) -> np.ndarray:
    """The draw weight of each example: easy_weight, hard_weight, or 1.0 for a normal one."""
    weight_of = {"easy": settings.easy_weight, "hard": settings.hard_weight}
    unknown = sorted({pool for pool in difficulty.values()} - set(weight_of))
    if unknown:
        raise ValueError(f"curriculum state names pools {unknown}; a state records only {list(POOLS)}")
    return np.array([weight_of.get(difficulty.get(example_id, "normal"), 1.0) for example_id in example_ids],
                     dtype=np.float64)


def weighted_draw(rng: np.random.Generator, weights: np.ndarray, count: int) -> np.ndarray:
    """`count` distinct row indices, drawn with probability proportional to `weights` (successive sampling without
    replacement). Equal weights (all zero included) draw exactly as `rng.choice(n, count, replace=False)`, the
    uniform draw. When fewer rows than `count` have a weight > 0 (every example but a few easy, at easy_weight 0),
    every row with weight > 0 is drawn and the rest come uniformly from the zero-weight rows."""
    num_rows = len(weights)
    if count > num_rows:
        raise ValueError(f"cannot draw {count} distinct prompts from {num_rows}")
    if np.all(weights == weights[0]):  # no pool to prefer (all normal, or all easy)
        return rng.choice(num_rows, size=count, replace=False)
    drawable = np.flatnonzero(weights > 0)
    if len(drawable) >= count:
        return rng.choice(num_rows, size=count, replace=False, p=weights / weights.sum())
    rest = np.flatnonzero(weights <= 0)
    filler = rng.choice(rest, size=count - len(drawable), replace=False)
    return rng.permutation(np.concatenate([drawable, filler]))


def next_difficulty_pools(config, state: Mapping[str, Mapping[str, str]], scored_rollouts: pa.Table,
                          prompt_tables: Mapping[str, pa.Table]) -> tuple[dict, dict]:
    """The pools of an RL run (`config`, an RlConfig) after a step's scored rollouts: `update_state` over the envs
    that set `curriculum`, with their prompt counts."""
    settings = {env.name: env.curriculum for env in config.settings.envs if env.curriculum is not None}
    return update_state(state, scored_rollouts, settings,
                        num_examples={name: prompt_tables[name].num_rows for name in settings})
