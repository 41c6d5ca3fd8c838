"""Example custom advantage functions (`algo = { type = "custom", import_path = "example_advantages:<name>" }`),
kept out of the library like example_rewards.py: user code, importable in tests (pytest puts tests/ on sys.path)
and from the CLI with `PYTHONPATH=tests`.

An advantage function takes the group (rollout_lib.algo.Group: `rewards`, None where missing; `completion_lengths`)
and its kwargs, and returns one list of per-token advantages per sample (len = its completion), or None for a
sample that gets no rl credit.
"""

from __future__ import annotations

from rollout_lib.algo import Group


def discounted_group_advantage(group: Group, *, discount: float = 0.95) -> list[list[float] | None]:
    """A_t = (reward - group mean) · discount^t: grpo's credit, fading over the completion, so the first tokens'
    choices carry the most of it. Samples with a missing reward get none."""
    present = group.present
    baseline = sum(present) / len(present) if present else 0.0
    return [None if reward is None else [(reward - baseline) * discount ** t for t in range(length)]
            for reward, length in zip(group.rewards, group.completion_lengths)]


# --- wrong shapes, for the tests of the errors they give ---------------------------------------------------------


def wrong_length(group: Group) -> list[list[float]]:
    """One advantage per sample instead of one per completion token."""
    return [[0.0] for _ in group.rewards]


def one_row(group: Group) -> list[list[float]]:
    """One row for the whole group."""
    return [[0.0] * group.completion_lengths[0]]


def scalars(group: Group) -> list[float]:
    """A scalar per sample, not a list per token."""
    return [0.0 for _ in group.rewards]
