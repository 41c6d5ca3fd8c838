"""Length penalties of the group algorithms (algo/base.py): DAPO's overlong punishment and Kimi k1.5's
group-relative length reward, applied to rewards before group normalisation in grpo and max_rl; off by default,
and then absent from the settings' dump (training identities unchanged)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from rollout_lib.identity.training import training_settings
from rollout_lib.algo.base import (
    GroupRelativeLengthPenalty,
    OverlongPenalty,
    group_relative_length_rewards,
    overlong_penalty,
    with_length_penalty,
)
from rollout_lib.algo import Group
from rollout_lib.algo.grpo import Grpo, GrpoSettings
from rollout_lib.algo.max_rl import MaxRl, MaxRlSettings
from rollout_lib.algo.stamping import assign_advantages
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.identity.training import training_hash
from rollout_lib.plan_checks import validate_config
from rollout_lib.config.loading import read_toml

ROOT = Path(__file__).resolve().parent.parent
OVERLONG = {"type": "overlong", "max_len": 10, "buffer": 4}
KIMI = {"type": "group_relative"}


def scalars(per_token: list[list[float] | None]) -> list[float | None]:
    """Each sample's advantage (group algorithms broadcast one scalar over the completion)."""
    return [None if values is None else values[0] for values in per_token]


def test_overlong_penalty_is_zero_then_linear_then_minus_coef():
    # max_len 10, buffer 4: free up to 6 tokens, -0.25 per token after, -1 at 10 and beyond.
    assert [overlong_penalty(n, 10, 4) for n in (0, 6, 7, 8, 10, 11, 50)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    assert overlong_penalty(8, 10, 4, coef=0.5) == -0.25
    assert overlong_penalty(3, 3, 3) == -1.0  # buffer = max_len: the whole range is soft


def test_group_relative_length_reward_is_kimis_lambda():
    # lengths 10..30: lambda = 0.5, -0.5, 0.0, 0.5; correct samples get lambda, wrong ones min(0, lambda).
    assert group_relative_length_rewards([1.0, 1.0, 0.0, 0.0], [10, 30, 20, 10]) == [0.5, -0.5, 0.0, 0.0]
    assert group_relative_length_rewards([1.0, 0.0], [10, 30], coef=0.2) == [0.1, -0.1]
    # correctness is reward >= correct_threshold
    assert group_relative_length_rewards([0.6, 0.4], [10, 30], correct_threshold=0.5) == [0.5, -0.5]
    # one length in the group: no length signal
    assert group_relative_length_rewards([1.0, 0.0, 1.0], [7, 7, 7]) == [0.0, 0.0, 0.0]


def test_missing_rewards_get_no_penalty_and_do_not_set_the_group_range():
    # The 100-token sample's reward is missing: the range is 10..20, not 10..100.
    assert group_relative_length_rewards([1.0, None, 1.0], [10, 100, 20]) == [0.5, None, -0.5]
    assert group_relative_length_rewards([None, None], [1, 2]) == [None, None]
    shaped = with_length_penalty(Group([1.0, None], [12, 12]), OverlongPenalty(**OVERLONG))
    assert shaped.rewards == [0.0, None] and shaped.completion_lengths == [12, 12]


def test_off_by_default_and_absent_from_the_dump():
    for settings_class in (GrpoSettings, MaxRlSettings):
        assert settings_class().length_penalty is None
        assert "length_penalty" not in settings_class().model_dump(mode="json")
        assert settings_class(length_penalty=KIMI).model_dump(mode="json")["length_penalty"] == {
            "type": "group_relative", "coef": 1.0, "correct_threshold": 1.0}
    group = Group([1.0, 0.0, 1.0], [3, 40, 9])
    assert with_length_penalty(group, None) is group
    assert scalars(Grpo(GrpoSettings()).assign(group)) == pytest.approx([1 / 3, -2 / 3, 1 / 3])


def test_grpo_normalises_the_penalised_rewards_hand_computed():
    # rewards 1, 1, 0, missing; lengths 5, 8, 12, 3; max_len 10, buffer 4 -> penalties 0, -0.5, -1, (none):
    # shaped rewards 1, 0.5, -1; mean 1/6; advantages 5/6, 1/3, -7/6, None.
    group = Group([1.0, 1.0, 0.0, None], [5, 8, 12, 3])
    advantages = Grpo(GrpoSettings(length_penalty=OVERLONG)).assign(group)
    assert scalars(advantages) == pytest.approx([5 / 6, 1 / 3, -7 / 6, None])
    assert [None if a is None else len(a) for a in advantages] == [5, 8, 12, None]
    # with std normalisation the std is that of the shaped rewards: sample std of (1, 0.5, -1) = sqrt(13/12)
    normalized = Grpo(GrpoSettings(length_penalty=OVERLONG, std_normalize=True, std_eps=1e-4)).assign(group)
    scale = (13 / 12) ** 0.5 + 1e-4
    assert scalars(normalized) == pytest.approx([5 / 6 / scale, 1 / 3 / scale, -7 / 6 / scale, None])


def test_max_rl_normalises_the_penalised_rewards_hand_computed():
    # Kimi: rewards 1, 1, 0, 0 at lengths 10, 30, 20, 10 -> length rewards 0.5, -0.5, 0, 0; shaped 1.5, 0.5, 0, 0;
    # mean 0.5; max_rl: (r - 0.5) / 0.5 = 2, 0, -1, -1 (grpo: r - 0.5 = 1, 0, -0.5, -0.5).
    group = Group([1.0, 1.0, 0.0, 0.0], [10, 30, 20, 10])
    assert scalars(MaxRl(MaxRlSettings(length_penalty=KIMI)).assign(group)) == pytest.approx([2.0, 0.0, -1.0, -1.0])
    assert scalars(Grpo(GrpoSettings(length_penalty=KIMI)).assign(group)) == pytest.approx([1.0, 0.0, -0.5, -0.5])
    # A penalty that takes the group's mean to <= 0 zeroes max_rl's group, as any such group.
    long_and_wrong = Group([1.0, 0.0], [10, 10])
    settings = MaxRlSettings(length_penalty=OVERLONG)
    assert scalars(MaxRl(settings).assign(long_and_wrong)) == [0.0, 0.0]


def test_the_advantages_stage_penalises_by_completion_tokens():
    # The lengths a penalty reads are the rows' completion_ids, as the stage groups them.
    rollouts = pa.table({"env": ["e"] * 3, "example_id": ["e/0"] * 3,
                         "reward": pa.array([1.0, 1.0, 0.0], pa.float64()),
                         "completion_ids": [[1] * 5, [1] * 8, [1] * 12]})
    advantages = assign_advantages(rollouts, {"e": Grpo(GrpoSettings(length_penalty=OVERLONG), where="x")})
    assert scalars(advantages) == pytest.approx([5 / 6, 1 / 3, -7 / 6])


def raw_config(**env_overrides) -> dict:
    raw = read_toml(ROOT / "configs/rl-tiny.toml")
    raw["algorithm"]["rl"]["envs"][0].update(env_overrides)
    return raw


def error_of(raw) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(RlConfig, raw)
    return str(info.value)


def test_config_and_training_identity():
    plain = validate_config(RlConfig, raw_config())
    assert "length_penalty" not in training_settings(plain)["envs"][0]["algo"]  # absent, not null
    penalised = validate_config(RlConfig, raw_config(algo={"type": "max_rl", "length_penalty": OVERLONG}))
    assert penalised.settings.envs[0].algo.length_penalty == OverlongPenalty(max_len=10, buffer=4, coef=1.0)
    assert training_hash(penalised) != training_hash(validate_config(RlConfig, raw_config(algo={"type": "max_rl"})))
    kimi = validate_config(RlConfig, raw_config(algo={"type": "grpo", "length_penalty": {**KIMI, "coef": 0.5}}))
    assert kimi.settings.envs[0].algo.length_penalty == GroupRelativeLengthPenalty(coef=0.5)

    def penalty(**knobs) -> dict:
        return raw_config(algo={"type": "grpo", "length_penalty": knobs})

    assert "algorithm.rl.envs[0].algo.length_penalty: `type` must be one of: group_relative, overlong" in error_of(
        penalty(type="dapo"))
    assert "algorithm.rl.envs[0].algo.length_penalty.buffer: required key is missing" in error_of(
        penalty(type="overlong", max_len=10))
    assert "algorithm.rl.envs[0].algo.length_penalty: buffer (12) must be <= max_len (10)" in error_of(
        penalty(type="overlong", max_len=10, buffer=12))
    assert "algorithm.rl.envs[0].algo.length_penalty.coef: must be > 0.0 (got 0)" in error_of(
        penalty(type="group_relative", coef=0))
    assert "algorithm.rl.envs[0].algo.length_penalty: unknown key" in error_of(
        raw_config(algo={"type": "reward", "length_penalty": KIMI}))  # the group algorithms only
