"""RL algorithms: golden advantages for grpo, max_rl, reward and custom, missing rewards, the registry and what a
class must declare, resources, stamping onto the wire (derived from the hooks), and samples of different envs and
algorithms packed into one micro-batch and trained."""

from __future__ import annotations

import asyncio
import math
from typing import Literal

import pyarrow as pa
import pytest
import torch

from rollout_lib import wire
from rollout_lib.algo import (
    ALGORITHMS,
    Algorithm,
    AlgorithmResources,
    AlgoSettings,
    Group,
    MissingResourceError,
    build_algorithm,
)
from rollout_lib.algo.base import scores_at_ship_time
from rollout_lib.algo.custom import Custom, CustomSettings
from rollout_lib.algo.grpo import Grpo, GrpoSettings
from rollout_lib.algo.max_rl import MaxRl, MaxRlSettings
from rollout_lib.algo.reward import RewardAsAdvantage, RewardAdvantageSettings
from rollout_lib.algo.stamping import (
    advantage_metrics,
    assign_advantages,
    score_for_shipping,
    stamp_training_samples,
)
from rollout_lib.packing import check_micro_batches, pack_samples


def scalars(per_token: list[list[float] | None]) -> list[float | None]:
    """Each sample's (uniform) advantage, None for no rl credit; asserts it is uniform over the completion."""
    out = []
    for values in per_token:
        assert values is None or len(set(values)) == 1
        out.append(None if values is None else values[0])
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


def test_missing_rewards_are_out_of_the_baseline_and_get_no_rl_credit():
    group = Group([1.0, None, 0.0, 0.5], [2, 2, 2, 2])
    # mean over the scored three is 0.5, not 0.375 (which a silent 0 for the missing one would give).
    assert scalars(Grpo(GrpoSettings()).assign(group)) == [0.5, None, -0.5, 0.0]
    assert scalars(MaxRl(MaxRlSettings()).assign(group)) == [1.0, None, -1.0, 0.0]
    assert scalars(RewardAsAdvantage(RewardAdvantageSettings()).assign(group)) == [1.0, None, 0.0, 0.5]
    everything_missing = Group([None, None], [3, 1])
    for algorithm in (Grpo(GrpoSettings()), MaxRl(MaxRlSettings()), RewardAsAdvantage(RewardAdvantageSettings())):
        assert algorithm.assign(everything_missing) == [None, None]
    # A group whose mean is not positive: max_rl gives zero credit to the scored, still none to the missing.
    assert MaxRl(MaxRlSettings()).assign(Group([0.0, None], [2, 1])) == [[0.0, 0.0], None]


def test_reward_is_the_advantage_without_a_baseline():
    advantages = RewardAsAdvantage(RewardAdvantageSettings()).assign(Group([1.0, 0.25, -2.0], [2, 1, 3]))
    assert advantages == [[1.0, 1.0], [0.25], [-2.0, -2.0, -2.0]]
    assert not RewardAdvantageSettings.group_relative  # one sample per prompt trains too
    assert RewardAsAdvantage(RewardAdvantageSettings()).assign(Group([0.7], [2])) == [[0.7, 0.7]]


def test_max_rl_scales_by_the_group_mean_and_is_zero_when_the_mean_is_not_positive():
    assert scalars(MaxRl(MaxRlSettings()).assign(Group([1.0, 0.0, 0.0, 0.0], [1] * 4))) == pytest.approx(
        [3.0, -1.0, -1.0, -1.0])  # mean 0.25: (1 - 0.25) / 0.25 = 3
    assert scalars(MaxRl(MaxRlSettings()).assign(Group([2.0, 4.0], [1, 1]))) == pytest.approx([-1 / 3, 1 / 3])
    assert scalars(MaxRl(MaxRlSettings()).assign(Group([0.0, 0.0], [1, 1]))) == [0.0, 0.0]
    assert scalars(MaxRl(MaxRlSettings()).assign(Group([1.0, -3.0], [1, 1]))) == [0.0, 0.0]  # mean -1


def test_a_group_with_an_empty_completion_still_assigns():
    assert Grpo(GrpoSettings()).assign(Group([1.0, 0.0], [0, 2])) == [[], [-0.5, -0.5]]


# --- custom ---------------------------------------------------------------------------------------------------


def custom(function: str, **kwargs) -> Custom:
    return Custom(CustomSettings(import_path=f"example_advantages:{function}", kwargs=kwargs),
                  where="algorithm.rl.envs[1].algo")


def test_custom_calls_the_function_on_the_group_with_its_kwargs():
    group = Group([1.0, 0.0, None], [3, 2, 1])
    # (reward - mean of the scored) · discount^t, none for the missing one.
    assert custom("discounted_group_advantage", discount=0.5).assign(group) == [
        [0.5, 0.25, 0.125], [-0.5, -0.25], None]
    assert CustomSettings(import_path="example_advantages:wrong_length").user_modules() == ("example_advantages",)


@pytest.mark.parametrize(("function", "message"), [
    ("wrong_length", "algorithm.rl.envs[1].algo: advantage function 'example_advantages:wrong_length' returned 1 "
                     "advantages for sample 0, which has 3 completion tokens"),
    ("one_row", "algorithm.rl.envs[1].algo: advantage function 'example_advantages:one_row' returned 1 rows for "
                "a group of 2 samples; expected one list of per-token advantages (or None) per sample"),
    ("scalars", "algorithm.rl.envs[1].algo: advantage function 'example_advantages:scalars' returned a float for "
                "sample 0; expected a list of 3 floats (one per completion token) or None"),
])
def test_a_custom_function_of_the_wrong_shape_fails_in_one_line_naming_its_place(function, message):
    with pytest.raises(ValueError) as info:
        custom(function).assign(Group([1.0, 0.0], [3, 2]))
    assert str(info.value) == message


def test_custom_settings_find_the_function_without_importing_it():
    from rollout_lib.config import ConfigError, RlConfig
    from rollout_lib.plan_checks import validate_config
    from rollout_lib.config.loading import read_toml
    from test_rl_config import ROOT

    raw = read_toml(ROOT / "configs/rl-tiny.toml")
    raw["algorithm"]["rl"]["envs"][0]["algo"] = {"type": "custom", "import_path": "example_advantages:no_such"}
    with pytest.raises(ConfigError) as info:
        validate_config(RlConfig, raw)
    assert str(info.value) == ("algorithm.rl.envs[0].algo: advantage function 'example_advantages:no_such': "
                               f"'example_advantages' ({ROOT / 'tests/example_advantages.py'}) defines no "
                               "top-level 'no_such'")
    raw["algorithm"]["rl"]["envs"][0]["algo"] = {"type": "custom", "import_path": "example_advantages:scalars",
                                                 "kwargs": {"decay": 1}}
    with pytest.raises(ConfigError, match=r"^algorithm.rl.envs\[0\].algo: advantage function "
                                          r"'example_advantages:scalars': bad kwargs \['decay'\]"):
        validate_config(RlConfig, raw)


# --- the registry ---------------------------------------------------------------------------------------------


def test_registry_builds_algorithms_by_type_name():
    assert {"grpo", "max_rl", "reward", "custom"} <= set(ALGORITHMS)
    assert isinstance(build_algorithm(GrpoSettings()), Grpo)
    assert isinstance(build_algorithm(MaxRlSettings()), MaxRl)
    assert isinstance(build_algorithm(RewardAdvantageSettings()), RewardAsAdvantage)
    assert GrpoSettings.group_relative and MaxRlSettings.group_relative
    with pytest.raises(TypeError, match="takes GrpoSettings"):
        Grpo(MaxRlSettings())


@pytest.fixture
def scratch_registry(monkeypatch):
    """Classes defined by a test register here, not in the process-wide registry."""
    monkeypatch.setattr("rollout_lib.algo.base.ALGORITHMS", dict(ALGORITHMS))
    from rollout_lib.algo import base

    return base


class ConstantSettings(AlgoSettings):
    type: Literal["constant_test"] = "constant_test"
    value: float = 1.0


def test_adding_an_algorithm_is_defining_a_class(scratch_registry):
    class Constant(Algorithm):
        """advantage = value, whatever the reward (a missing one included)."""

        type_name = "constant_test"
        settings_class = ConstantSettings

        def assign(self, group: Group) -> list[list[float]]:
            return group.broadcast([self.settings.value] * len(group.rewards))

    assert scratch_registry.ALGORITHMS["constant_test"] is Constant
    assert scratch_registry.build_algorithm(ConstantSettings(value=2.0)).assign(Group([None], [2])) == [[2.0, 2.0]]

    with pytest.raises(TypeError, match="must declare"):
        class Unnamed(Algorithm):  # noqa: F841 - defining it is the test
            type_name = "unnamed_test"
            settings_class = ConstantSettings

            def assign(self, group):
                return None


def test_a_class_declares_what_its_hooks_say(scratch_registry):
    # rl trains on advantages: an rl algorithm must assign them, and only an rl algorithm may.
    with pytest.raises(TypeError, match="defines `assign` exactly when its tokens train under rl"):
        class NoAdvantages(Algorithm):  # noqa: F841
            type_name = "constant_test"
            settings_class = ConstantSettings
    with pytest.raises(TypeError, match="defines `assign` exactly when .*action_loss is 'ce'"):
        class CeWithAdvantages(Algorithm):  # noqa: F841
            type_name = "constant_test"
            settings_class = ConstantSettings
            action_loss = "ce"

            def assign(self, group):
                return None
    with pytest.raises(TypeError, match="requires names \\['teacher'\\]"):
        class UnknownResource(Algorithm):  # noqa: F841
            requires = frozenset({"teacher"})
    with pytest.raises(TypeError, match="action_loss must be one of"):
        class UnknownComponent(Algorithm):  # noqa: F841
            action_loss = "kl"


def test_building_without_a_required_resource_fails_naming_the_env(scratch_registry):
    class Distill(Algorithm):
        """ref_kl on completion tokens against a frozen model: no advantages, a ship-time score."""

        type_name = "constant_test"
        settings_class = ConstantSettings
        action_loss = "ref_kl"
        requires = frozenset({"served_models", "tokenizer"})

        async def score(self, samples: pa.Table) -> pa.Table:
            return samples

    with pytest.raises(MissingResourceError) as info:
        scratch_registry.build_algorithm(ConstantSettings(), AlgorithmResources(tokenizer=object()),
                                         where="algorithm.rl.envs[2].algo")
    assert str(info.value) == ("algorithm.rl.envs[2].algo: a constant_test algorithm is built with the run's "
                               "served_models, and none was given")
    frozen, tokenizer = object(), object()
    built = scratch_registry.build_algorithm(ConstantSettings(), AlgorithmResources(tokenizer, frozen))
    assert built.resources.served_models is frozen and built.resources.tokenizer is tokenizer
    # What stamping reads is derived from the hooks: it scores at ship time, assigns nothing.
    assert scores_at_ship_time(built) and not scores_at_ship_time(Grpo(GrpoSettings()))
    assert built.assign(Group([1.0], [2])) is None


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
    assert advantages == [[0.5, 0.5], [-0.5], [pytest.approx(-1 / 3)] * 3, None, [pytest.approx(1 / 3)] * 2]
    samples = stamp_training_samples(table, advantages, ALGOS, max_seq_len=64)
    assert samples.schema == wire.TRAINING_SAMPLES
    rows = samples.to_pylist()
    first = rows[0]
    assert first["input_ids"] == [1, 2, 3, 4, 5]
    assert first["loss_mask"] == [False, False, False, True, True]
    assert first["advantages"] == [0.0, 0.0, 0.0, 0.5, 0.5]
    # Plain rl ships no weight stream: null rl_weights is weight 1 on every loss_mask token.
    assert first["rl_weights"] is None
    assert first["inference_logprobs"] == pytest.approx([0.0, 0.0, 0.0, -0.1, -0.2])
    assert first["ce_weights"] is None and first["ref_kl_weights"] is None and first["ref_logprobs"] is None
    # The sample whose reward is missing ships, but trains nothing: zero rl weights, no advantages.
    missing = rows[3]
    assert missing["loss_mask"] == [False, False, True]
    assert missing["rl_weights"] == [0.0, 0.0, 0.0] and missing["advantages"] is None
    for row in rows:  # every stream aligned with input_ids
        for name in ("loss_mask", "advantages", "rl_weights", "inference_logprobs"):
            assert row[name] is None or len(row[name]) == len(row["input_ids"])

    metrics = advantage_metrics(samples)
    assert metrics["trainable_samples"] == 4 and metrics["samples"] == 5
    assert metrics["rl_tokens"] == 2 + 1 + 3 + 2
    assert metrics["tokens"] == 5 + 4 + 5 + 3 + 4


class RefKlOnly(Algorithm):
    """A distillation-shaped algorithm (unregistered): ref_kl on completion tokens, no advantages."""

    settings_class = AlgoSettings
    action_loss = "ref_kl"


def test_a_non_rl_algorithm_stamps_its_component_and_zeroes_rl_whatever_the_reward():
    table = two_env_rollouts()
    algos = {"a": RefKlOnly(AlgoSettings()), "b": MaxRl(MaxRlSettings())}
    advantages = assign_advantages(table, algos)
    assert advantages[:2] == [None, None]
    rows = stamp_training_samples(table, advantages, algos, max_seq_len=64).to_pylist()
    first = rows[0]
    assert first["ref_kl_weights"] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert first["rl_weights"] == [0.0] * 5 and first["advantages"] is None and first["ce_weights"] is None
    # Its reward does not matter: a distillation signal trains whether or not the sample was scored.
    assert advantage_metrics(stamp_training_samples(
        table, advantages, algos, max_seq_len=64))["trainable_samples"] == 2 + 2


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


def test_a_micro_batch_with_no_component_token_still_runs_forward_and_backward_as_a_zero_gradient_no_op(
        tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rollout_lib.trainer.causal import train_on_micro_batches

    def step(samples: pa.Table) -> tuple[dict, dict, list[torch.Tensor]]:
        # One sample per micro-batch (4 tokens each); a gradient hook sees every backward that reaches the weights.
        packed = pack_samples(samples, max_seq_len=4)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        seen: list[torch.Tensor] = []
        model.get_input_embeddings().weight.register_hook(lambda grad: seen.append(grad.detach().clone()))
        metrics = train_on_micro_batches(model, torch.optim.SGD(model.parameters(), lr=0.1), packed, packed=True,
                                         pad_token_id=0, max_grad_norm=1.0)
        return metrics, {name: p.detach().clone() for name, p in model.named_parameters()}, seen

    table = rollouts([{"example_id": example, "env": "a", "prompt_ids": [1, 2], "completion_ids": [3, 4],
                       "reward": reward, "sample_id": f"{example}#{index}"}
                      for example, index, reward in [("a/1", 0, 1.0), ("a/1", 1, 0.0), ("a/2", 0, None),
                                                     ("a/2", 1, None)]])
    samples = stamp_training_samples(table, assign_advantages(table, ALGOS), ALGOS, max_seq_len=64)
    trained, empty = samples.take([0, 1]), samples.take([2, 3])  # every reward of group a/2 failed

    # A step of empty micro-batches only: each runs forward and backward (zero gradients), nothing moves.
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    metrics, weights, seen = step(empty)
    assert metrics["tokens/rl"] == 0 and metrics["micro_batches"] == 2 and metrics["grad_norm"] == 0.0
    assert len(seen) == 2 and all(grad.abs().max().item() == 0.0 for grad in seen)
    assert all(torch.equal(initial[name], tensor) for name, tensor in weights.items())

    # Beside micro-batches that train, the empty ones add exactly nothing: the same weights as without them.
    with_empty, with_weights, seen = step(pa.concat_tables([trained, empty]))
    alone, alone_weights, _ = step(trained)
    assert with_empty["micro_batches"] == 4 and len(seen) == 4 and alone["micro_batches"] == 2
    assert with_empty["tokens/rl"] == alone["tokens/rl"] == 4 and with_empty["grad_norm"] > 0
    assert all(torch.equal(alone_weights[name], tensor) for name, tensor in with_weights.items())
    assert any(not torch.equal(initial[name], tensor) for name, tensor in with_weights.items())


def test_rl_cache_keys_cover_every_registered_algorithm_and_sampler_module():
    """The registries import their modules at run time; editing one must still invalidate cached RL stages."""
    from rollout_lib.identity.code import import_closure

    closure = {path.as_posix().split("rollout_lib/", 1)[-1] for path in import_closure("tasks.rl")}
    assert {"algo/grpo.py", "algo/max_rl.py", "algo/reward.py", "algo/custom.py", "algo/plugins.py",
            "algo/stamping.py", "sampling/hf.py"} <= closure
