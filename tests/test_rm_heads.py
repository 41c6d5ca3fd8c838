"""The RM's heads (rollout_lib/rm/heads.py): pairwise_logistic reads both responses in one input, both orders, and
trains by logistic regression on them; bradley_terry, the default, is unchanged (inputs, manifest, ids)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from rollout_lib import wire
from rollout_lib.config import ConfigError, RmConfig
from rollout_lib.plan_checks import load_config, validate_config
from rollout_lib.config.loading import read_toml
from rollout_lib.data import load_pairs
from rollout_lib.determinism import plan_batches
from rollout_lib.identity.training import training_identity
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.model.reward import encode_prompt_response
from rollout_lib.rm.checkpoints import load_reward_checkpoint
from rollout_lib.rm.heads import joint_response, pair_loss
from rollout_lib.rm.pairs import tokenize_pairs
from rollout_lib.rm.trainer import RewardModelTrainer
from rollout_lib.store import ObjectStore, StoreError
from rollout_lib.trainer.base import TrainingInputs

ROOT = Path(__file__).resolve().parent.parent
STEPS = 24


def make_run(head: str | None, lr: float = 3e-3) -> TrainingInputs:
    overrides = [f"run.store=memory://rm-heads-{uuid.uuid4().hex}", f"algorithm.rm.budget.max_steps={STEPS}",
                 "algorithm.rm.optimizer.kind=adamw", f"algorithm.rm.optimizer.lr={lr}"]
    config = load_config(RmConfig, ROOT / "configs/rm-tiny.toml", overrides + ([f"algorithm.rm.head={head}"]
                                                                            if head else []))
    store = ObjectStore(config.run.store)
    tokenizer = load_tokenizer(resolve_model(config.settings.base_model))
    tokenized = tokenize_pairs(load_pairs(ROOT / "data/rm-tiny.jsonl"), tokenizer, config.settings.max_seq_len,
                               config.settings.head)
    plan = plan_batches(tokenized.num_rows, config.settings.minibatch_size, STEPS, config.run.seed)
    return TrainingInputs(store, config, training_identity(config),
                          {"tokenized": store.put_table(tokenized), "plan": store.put_table(plan)})


def test_the_loss_is_logistic_on_both_orders():
    s_chosen_first, s_rejected_first = torch.tensor([2.0, 0.0]), torch.tensor([-1.0, 0.0])
    expected = [0.5 * (torch.nn.functional.softplus(torch.tensor(-2.0)) + torch.nn.functional.softplus(
        torch.tensor(-1.0))).item(), torch.log(torch.tensor(2.0)).item()]
    assert pair_loss("pairwise_logistic", s_chosen_first, s_rejected_first).item() == pytest.approx(
        sum(expected) / 2, abs=1e-6)
    # Not Bradley-Terry on the same two numbers: the logits are judged one by one, not by their gap.
    assert pair_loss("bradley_terry", torch.tensor([1.0]), torch.tensor([1.0])).item() == pytest.approx(0.6931, 1e-4)
    assert pair_loss("pairwise_logistic", torch.tensor([5.0]), torch.tensor([5.0])).item() > 2.0


def test_a_pairwise_pair_is_both_responses_in_both_orders():
    run = make_run("pairwise_logistic")
    tokenizer = load_tokenizer(resolve_model("tiny:qwen2"))
    row = run.store.get_table(run.data_ids["tokenized"], wire.TOKENIZED_PAIRS).to_pylist()[0]
    assert row["chosen_input_ids"] == encode_prompt_response(tokenizer, "What is 2+2?", joint_response("4", "5"), 64)
    assert row["rejected_input_ids"] == encode_prompt_response(tokenizer, "What is 2+2?", joint_response("5", "4"), 64)


def test_pairwise_logistic_trains_on_the_tiny_pairs():
    """Slower to start than bradley_terry (the two orders hold the same tokens: it must learn which is first).
    Measured (adamw 3e-3, seed 42): ~0.69 for 12 steps, then 0.48, 0.39, 0.30, 0.55, 0.23, 0.21 by step 24; at
    3e-2 it stays at ln 2."""
    trainer = RewardModelTrainer.from_checkpoint(run := make_run("pairwise_logistic"),
                                                 RewardModelTrainer.initial(run).checkpoint_id)
    losses = [trainer.train_step(step)["loss"] for step in range(1, STEPS + 1)]
    print("pairwise_logistic loss per step:", [round(loss, 3) for loss in losses])
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4, losses


def test_a_pairwise_checkpoint_is_refused_where_a_scalar_reward_is_read():
    """By `rollout score`'s loader and by an RL reward model's plan-time check (in one line)."""
    from rollout_lib.model.loading import ModelLoadError
    from rollout_lib.reward.reward_model import check_reward_model
    from rollout_lib.settings_base import ModelRef

    run = make_run("pairwise_logistic")
    checkpoint = RewardModelTrainer.initial(run).checkpoint_id
    with pytest.raises(StoreError, match="is a pairwise_logistic reward model: it compares two responses"):
        load_reward_checkpoint(run.store, checkpoint)
    with pytest.raises(ModelLoadError) as refused:
        check_reward_model(ModelRef(uri=checkpoint, store=run.store.root))
    assert f"checkpoint {checkpoint} is a pairwise_logistic reward model" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_default_head_keeps_its_inputs_manifest_and_identity():
    default, explicit = make_run(None), make_run("bradley_terry")
    assert default.config.settings.head == "bradley_terry" and default.identity == explicit.identity
    assert make_run("pairwise_logistic").identity != default.identity
    tokenizer = load_tokenizer(resolve_model("tiny:qwen2"))
    row = default.store.get_table(default.data_ids["tokenized"], wire.TOKENIZED_PAIRS).to_pylist()[0]
    assert row["chosen_input_ids"] == encode_prompt_response(tokenizer, "What is 2+2?", "4", 64)
    checkpoint = RewardModelTrainer.initial(default).checkpoint_id
    assert "reward_head" not in default.store.get_json(checkpoint)  # the manifest, hence the id, as before
    load_reward_checkpoint(default.store, checkpoint)  # a scalar reward model


def test_pairwise_logistic_refuses_reward_centring_at_plan_time():
    raw = read_toml(ROOT / "configs/rm-tiny.toml")
    raw["algorithm"]["rm"].update(head="pairwise_logistic", center_rewards_coefficient=0.01)
    with pytest.raises(ConfigError) as raised:
        validate_config(RmConfig, raw)
    assert "algorithm.rm.center_rewards_coefficient: centres bradley_terry's rewards" in str(raised.value)
