"""RL algorithms: golden advantages for grpo and max_rl, missing rewards, the registry, stamping onto the wire,
and samples of different envs and algorithms packed into one micro-batch and trained."""

from __future__ import annotations

import asyncio
import math
from typing import ClassVar, Literal

import pyarrow as pa
import pytest
import torch

from rollout_lib import wire
from rollout_lib.algo import ALGORITHMS, Algorithm, AlgoSettings, Group, build_algorithm
from rollout_lib.algo.grpo import Grpo, GrpoSettings
from rollout_lib.algo.max_rl import MaxRl, MaxRlSettings
from rollout_lib.algo.stamping import (
    advantage_metrics,
    assign_advantages,
    score_for_shipping,
    stamp_training_samples,
)
from rollout_lib.packing import check_micro_batches, pack_samples


def scalars(per_token: list[list[float]]) -> list[float]:
    """Each sample's (uniform) advantage; asserts it is uniform over the completion."""
    out = []
    for values in per_token:
        assert len(set(values)) <= 1
        out.append(values[0] if values else None)
    return out


# --- the math ---------------------------------------------------------------------------------------------------


def test_grpo_is_reward_minus_group_mean_broadcast_over_completion_tokens():
    advantages = Grpo(GrpoSettings()).assign(Group([1.0, 0.0, 0.5, 0.5], [3, 1, 2, 4]))
    assert [len(a) for a in advantages] == [3, 1, 2, 4]
    assert scalars(advantages) == [0.5, -0.5, 0.0, 0.0]


def test_grpo_std_normalisation_uses_the_unbiased_std_and_its_epsilon():
    rewards = [1.0, 0.0, 0.0, 0.0]
    std = math.sqrt(((0.75 ** 2) + 3 * (0.25 ** 2)) / 3)  # n - 1 = 3
    got = scalars(Grpo(GrpoSettings(std_normalize=True, std_eps=0.01)).assign(Group(rewards, [1] * 4)))
    assert got == pytest.approx([0.75 / (std + 0.01), -0.25 / (std + 0.01), -0.25 / (std + 0.01), -0.25 / (std + 0.01)])
    # A unanimous group: zero advantages, the epsilon keeps them finite.
    assert scalars(Grpo(GrpoSettings(std_normalize=True)).assign(Group([1.0, 1.0], [2, 2]))) == [0.0, 0.0]


def test_missing_rewards_are_out_of_the_baseline_and_get_zero_advantage():
    group = Group([1.0, None, 0.0, 0.5], [2, 2, 2, 2])
    # mean over the scored three is 0.5, not 0.375 (which a silent 0 for the missing one would give).
    assert scalars(Grpo(GrpoSettings()).assign(group)) == [0.5, 0.0, -0.5, 0.0]
    assert scalars(MaxRl(MaxRlSettings()).assign(group)) == [1.0, 0.0, -1.0, 0.0]
    everything_missing = Group([None, None], [3, 1])
    assert Grpo(GrpoSettings()).assign(everything_missing) == [[0.0] * 3, [0.0]]
    assert MaxRl(MaxRlSettings()).assign(everything_missing) == [[0.0] * 3, [0.0]]


def test_max_rl_scales_by_the_group_mean_and_is_zero_when_the_mean_is_not_positive():
    assert scalars(MaxRl(MaxRlSettings()).assign(Group([1.0, 0.0, 0.0, 0.0], [1] * 4))) == pytest.approx(
        [3.0, -1.0, -1.0, -1.0])  # mean 0.25: (1 - 0.25) / 0.25 = 3
    assert scalars(MaxRl(MaxRlSettings()).assign(Group([2.0, 4.0], [1, 1]))) == pytest.approx([-1 / 3, 1 / 3])
    assert scalars(MaxRl(MaxRlSettings()).assign(Group([0.0, 0.0], [1, 1]))) == [0.0, 0.0]
    assert scalars(MaxRl(MaxRlSettings()).assign(Group([1.0, -3.0], [1, 1]))) == [0.0, 0.0]  # mean -1


def test_a_group_with_an_empty_completion_still_assigns():
    assert Grpo(GrpoSettings()).assign(Group([1.0, 0.0], [0, 2])) == [[], [-0.5, -0.5]]


# --- the registry ---------------------------------------------------------------------------------------------


def test_registry_builds_algorithms_by_type_name():
    assert {"grpo", "max_rl"} <= set(ALGORITHMS)
    assert isinstance(build_algorithm(GrpoSettings()), Grpo)
    assert isinstance(build_algorithm(MaxRlSettings()), MaxRl)
    assert GrpoSettings.group_relative and MaxRlSettings.group_relative
    with pytest.raises(TypeError, match="takes GrpoSettings"):
        Grpo(MaxRlSettings())


def test_adding_an_algorithm_is_defining_a_class(monkeypatch):
    monkeypatch.setattr("rollout_lib.algo.base.ALGORITHMS", dict(ALGORITHMS))
    from rollout_lib.algo import base

    class ConstantSettings(AlgoSettings):
        type: Literal["constant_test"] = "constant_test"
        value: float = 1.0

    class Constant(Algorithm):
        """advantage = value, whatever the reward."""

        type_name = "constant_test"
        settings_class = ConstantSettings
        needs_reward: ClassVar[bool] = False

        def assign(self, group: Group) -> list[list[float]]:
            return group.broadcast([self.settings.value] * len(group.rewards))

    assert base.ALGORITHMS["constant_test"] is Constant
    assert base.build_algorithm(ConstantSettings(value=2.0)).assign(Group([None], [2])) == [[2.0, 2.0]]

    with pytest.raises(TypeError, match="must declare"):
        class Unnamed(Algorithm):  # noqa: F841 - defining it is the test
            type_name = "unnamed_test"
            settings_class = ConstantSettings


# --- stamping -------------------------------------------------------------------------------------------------


def rollouts(rows: list[dict]) -> pa.Table:
    defaults = {"answer": None, "info": None, "completion_text": "", "reward_error": None}
    records = []
    for index, row in enumerate(rows):
        record = {**defaults, **row}
        record.setdefault("sample_id", f"{record['example_id']}#{record.get('group_index', index)}")
        record.setdefault("group_index", index)
        record.setdefault("sampling_logprobs", [-0.5] * len(record["completion_ids"]))
        records.append(record)
    return pa.Table.from_pylist(records, schema=wire.ROLLOUTS)


def two_env_rollouts() -> pa.Table:
    return rollouts([
        {"example_id": "a/1", "env": "a", "prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "reward": 1.0,
         "sampling_logprobs": [-0.1, -0.2]},
        {"example_id": "a/1", "env": "a", "prompt_ids": [1, 2, 3], "completion_ids": [6], "reward": 0.0},
        {"example_id": "b/1", "env": "b", "prompt_ids": [7, 8], "completion_ids": [9, 10, 11], "reward": 2.0},
        {"example_id": "b/1", "env": "b", "prompt_ids": [7, 8], "completion_ids": [12], "reward": None,
         "reward_error": "TimeoutError: reward fn 'x' exceeded 1s"},
        {"example_id": "b/1", "env": "b", "prompt_ids": [7, 8], "completion_ids": [13, 14], "reward": 4.0},
    ])


ALGOS = {"a": Grpo(GrpoSettings()), "b": MaxRl(MaxRlSettings())}


def test_stamping_puts_advantages_and_weights_on_completion_tokens_only():
    table = two_env_rollouts()
    advantages = assign_advantages(table, ALGOS)
    assert advantages == [[0.5, 0.5], [-0.5], [pytest.approx(-1 / 3)] * 3, [0.0], [pytest.approx(1 / 3)] * 2]
    samples = stamp_training_samples(table, advantages, ALGOS, max_seq_len=64)
    assert samples.schema == wire.TRAINING_SAMPLES
    rows = samples.to_pylist()
    first = rows[0]
    assert first["input_ids"] == [1, 2, 3, 4, 5]
    assert first["loss_mask"] == [False, False, False, True, True]
    assert first["advantages"] == [0.0, 0.0, 0.0, 0.5, 0.5]
    assert first["rl_weights"] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert first["inference_logprobs"] == pytest.approx([0.0, 0.0, 0.0, -0.1, -0.2])
    assert first["ce_weights"] is None and first["ref_kl_weights"] is None and first["ref_logprobs"] is None
    # The sample whose reward is missing ships, but trains nothing.
    missing = rows[3]
    assert missing["loss_mask"] == [False, False, True]
    assert missing["rl_weights"] == [0.0, 0.0, 0.0] and missing["advantages"] == [0.0, 0.0, 0.0]
    for row in rows:  # every stream aligned with input_ids
        for name in ("loss_mask", "advantages", "rl_weights", "inference_logprobs"):
            assert len(row[name]) == len(row["input_ids"])

    metrics = advantage_metrics(samples)
    assert metrics["trainable_samples"] == 4 and metrics["samples"] == 5
    assert metrics["rl_tokens"] == 2 + 1 + 3 + 2
    assert metrics["tokens"] == 5 + 4 + 5 + 3 + 4


def test_stamping_truncates_on_the_right_and_rejects_prompts_that_do_not_fit():
    table = rollouts([{"example_id": "a/1", "env": "a", "prompt_ids": [1, 2], "completion_ids": [3, 4, 5, 6],
                       "reward": 1.0}, {"example_id": "a/1", "env": "a", "prompt_ids": [1, 2],
                                        "completion_ids": [7], "reward": 0.0}])
    samples = stamp_training_samples(table, assign_advantages(table, ALGOS), ALGOS, max_seq_len=4)
    row = samples.to_pylist()[0]
    assert row["input_ids"] == [1, 2, 3, 4] and row["advantages"] == [0.0, 0.0, 0.5, 0.5]
    with pytest.raises(ValueError, match="its prompt has 2 tokens, max_seq_len is 2"):
        stamp_training_samples(table, assign_advantages(table, ALGOS), ALGOS, max_seq_len=2)


def test_ship_time_score_hook_runs_per_env_and_keeps_row_order():
    class Tagging(Grpo):
        has_score = True

        async def score(self, samples: pa.Table) -> pa.Table:
            await asyncio.sleep(0)
            refs = [[-1.0] * len(ids) for ids in samples.column("input_ids").to_pylist()]
            index = samples.schema.get_field_index("ref_logprobs")
            return samples.set_column(index, wire.TRAINING_SAMPLES.field("ref_logprobs"),
                                      pa.array(refs, pa.list_(pa.float32())))

    algos = {"a": Tagging(GrpoSettings()), "b": MaxRl(MaxRlSettings())}
    table = two_env_rollouts().take([2, 0, 3, 1, 4])  # envs interleaved
    samples = stamp_training_samples(table, assign_advantages(table, algos), algos, max_seq_len=64)
    shipped = asyncio.run(score_for_shipping(samples, algos))
    assert shipped.column("sample_id").to_pylist() == samples.column("sample_id").to_pylist()
    refs = shipped.column("ref_logprobs").to_pylist()
    assert [r is not None for r in refs] == [False, True, False, True, False]


# --- mixed envs in one micro-batch, through the trainer -------------------------------------------------------


def test_samples_of_two_algorithms_pack_together_and_train(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rollout_lib.trainer.causal import train_on_micro_batches

    table = two_env_rollouts()
    samples = stamp_training_samples(table, assign_advantages(table, ALGOS), ALGOS, max_seq_len=64)
    packed = pack_samples(samples, max_seq_len=64)
    assert packed.num_rows == 1  # both envs, both algorithms, one micro-batch
    check_micro_batches(packed)
    row = packed.to_pylist()[0]
    # Exact positions across the sample boundaries (longest first: 5, 5, 4, 4, 3 tokens, original order kept).
    assert row["sequence_lengths"] == [5, 4, 5, 3, 4]
    assert row["rl_weights"] == [0, 0, 0, 1, 1] + [0, 0, 0, 1] + [0, 0, 1, 1, 1] + [0, 0, 0] + [0, 0, 1, 1]
    assert row["advantages"][:9] == [0, 0, 0, 0.5, 0.5, 0, 0, 0, -0.5]

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = train_on_micro_batches(model, optimizer, packed, packed=True, pad_token_id=0, max_grad_norm=1.0)
    assert metrics["tokens/rl"] == 8 and metrics["grad_norm"] > 0
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())


def test_a_micro_batch_where_every_reward_failed_is_a_zero_gradient_no_op(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rollout_lib.trainer.causal import train_on_micro_batches

    table = rollouts([{"example_id": "a/1", "env": "a", "prompt_ids": [1, 2], "completion_ids": [3, 4],
                       "reward": None, "reward_error": "x"} for _ in range(2)])
    table = table.set_column(0, wire.ROLLOUTS.field("sample_id"), pa.array(["s0", "s1"]))
    samples = stamp_training_samples(table, assign_advantages(table, ALGOS), ALGOS, max_seq_len=64)
    packed = pack_samples(samples, max_seq_len=64)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = train_on_micro_batches(model, torch.optim.SGD(model.parameters(), lr=0.1), packed, packed=True,
                                     pad_token_id=0, max_grad_norm=1.0)
    assert metrics["tokens/rl"] == 0 and metrics["grad_norm"] == 0.0
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


def test_rl_cache_keys_cover_every_registered_algorithm_and_sampler_module():
    """The registries import their modules at run time; editing one must still invalidate cached RL stages."""
    from rollout_lib.code_version import import_closure

    closure = {path.as_posix().split("rollout_lib/", 1)[-1] for path in import_closure("tasks.rl")}
    assert {"algo/grpo.py", "algo/max_rl.py", "algo/stamping.py", "sampling/hf.py"} <= closure
