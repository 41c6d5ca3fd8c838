"""The RM trainer without Prefect: deterministic replay from snapshots, segments, NaN detection, reusable
checkpoints."""

import uuid
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rollout_lib import wire
from rollout_lib.config import RmConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.data import load_pairs
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.rm.pairs import tokenize_pairs
from rollout_lib.rm.trainer import RewardModelTrainer
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import NonFiniteLossError, TrainingInputs
from rollout_lib.checkpoint import export_hf_directory, read_manifest
from rollout_lib.determinism import plan_batches
from rollout_lib.identity.training import training_identity
from rollout_lib.trainer.segment import Segment, TrainStepError, SnapshotSchedule, train_segment

ROOT = Path(__file__).resolve().parent.parent


def make_run(tiny_model_dir, overrides=()) -> TrainingInputs:
    config = load_config(RmConfig, ROOT / "configs/rm-tiny.toml", [
        f"run.store=memory://rm-{uuid.uuid4().hex}", f"algorithm.rm.base_model={tiny_model_dir}",
        "algorithm.rm.budget.max_steps=6", "algorithm.rm.optimizer.kind=adamw", "algorithm.rm.optimizer.lr=1e-2",
        *overrides])
    store = ObjectStore(config.run.store)
    tokenizer = load_tokenizer(resolve_model(config.settings.base_model))
    tokenized = tokenize_pairs(load_pairs(ROOT / "data/rm-tiny.jsonl"), tokenizer, config.settings.max_seq_len)
    plan = plan_batches(tokenized.num_rows, config.settings.minibatch_size, 6, config.run.seed)
    return TrainingInputs(store, config, training_identity(config),
                          {"tokenized": store.put_table(tokenized), "plan": store.put_table(plan)})


def test_plan_is_seeded_and_covers_every_row_each_epoch():
    plan = plan_batches(5, 2, 5, seed=7).column("row_indices").to_pylist()
    assert plan == plan_batches(5, 2, 5, seed=7).column("row_indices").to_pylist()
    flat = [i for batch in plan for i in batch]
    assert sorted(flat[:5]) == [0, 1, 2, 3, 4] and sorted(flat[5:10]) == [0, 1, 2, 3, 4]
    assert plan != plan_batches(5, 2, 5, seed=8).column("row_indices").to_pylist()


def test_resume_from_snapshot_replays_to_identical_weights(tiny_model_dir):
    run = make_run(tiny_model_dir)
    start = RewardModelTrainer.initial(run).checkpoint_id
    uninterrupted = RewardModelTrainer.from_checkpoint(run, start)
    for step in range(1, 7):
        metrics = uninterrupted.train_step(step)
    final_a = uninterrupted.snapshot(metrics)

    # Interrupted: snapshot at 3, lose the process state, resume from the store alone.
    first = RewardModelTrainer.from_checkpoint(run, start)
    for step in range(1, 4):
        metrics = first.train_step(step)
    middle = first.snapshot(metrics)
    del first
    resumed = RewardModelTrainer.from_checkpoint(run, middle)
    assert resumed.step == 3
    for step in range(4, 7):
        metrics = resumed.train_step(step)
    # Parents differ (A has no snapshot at 3), so compare weights and optimizer state objects, not manifests.
    manifest_a, manifest_b = read_manifest(run.store, final_a), read_manifest(run.store, resumed.snapshot(metrics))
    assert manifest_a["weights"] == manifest_b["weights"]
    assert manifest_a["optimizer"] == manifest_b["optimizer"]
    assert manifest_b["parent"] == middle


def test_segments_end_at_every_snapshot_and_at_the_last_step():
    assert SnapshotSchedule(3, 7).segments() == [Segment(1, 3), Segment(4, 6), Segment(7, 7)]
    assert SnapshotSchedule(3, 6).segments() == [Segment(1, 3), Segment(4, 6)]
    assert SnapshotSchedule(10, 2).segments() == [Segment(1, 2)]
    assert [list(s.steps) for s in SnapshotSchedule(1, 4).segments()] == [[1], [2], [3], [4]]


def test_a_segment_rerun_from_its_start_checkpoint_reaches_the_same_checkpoint(tiny_model_dir):
    run = make_run(tiny_model_dir)
    start = RewardModelTrainer.initial(run).checkpoint_id
    first, _ = train_segment(RewardModelTrainer.from_checkpoint(run, start), Segment(1, 3))
    trainer = RewardModelTrainer.from_checkpoint(run, first)
    expected, metrics = train_segment(trainer, Segment(4, 6))
    assert [m["step"] for m in metrics] == [4, 5, 6] and trainer.step == 6
    # A process killed inside the second segment has only `first` in the store: the rerun starts from it.
    assert train_segment(RewardModelTrainer.from_checkpoint(run, first), Segment(4, 6))[0] == expected
    assert read_manifest(run.store, expected)["parent"] == first


def test_a_segment_refuses_a_trainer_at_another_step(tiny_model_dir):
    run = make_run(tiny_model_dir)
    trainer = RewardModelTrainer.initial(run)
    with pytest.raises(RuntimeError, match="the trainer is at step 0; segment 2-3 starts after step 1"):
        train_segment(trainer, Segment(2, 3))


def test_a_failing_step_inside_a_segment_is_named(tiny_model_dir):
    run = make_run(tiny_model_dir, ["algorithm.rm.optimizer.lr=1e30", "algorithm.rm.optimizer.kind=sgd"])
    trainer = RewardModelTrainer.from_checkpoint(run, RewardModelTrainer.initial(run).checkpoint_id)
    with pytest.raises(TrainStepError, match=r"^train step 2: NonFiniteLossError: loss is nan") as caught:
        train_segment(trainer, Segment(1, 3))
    assert isinstance(caught.value.__cause__, NonFiniteLossError)


def test_non_finite_loss_fails_the_step_and_leaves_weights_untouched(tiny_model_dir):
    run = make_run(tiny_model_dir)
    trainer = RewardModelTrainer.from_checkpoint(run, RewardModelTrainer.initial(run).checkpoint_id)
    with torch.no_grad():
        trainer.model.score.weight.fill_(float("nan"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if "score" not in k}
    with pytest.raises(NonFiniteLossError, match="^loss is nan"):
        trainer.train_step(1)
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_steps_run_strictly_in_order(tiny_model_dir):
    run = make_run(tiny_model_dir)
    trainer = RewardModelTrainer.from_checkpoint(run, RewardModelTrainer.initial(run).checkpoint_id)
    with pytest.raises(RuntimeError, match="reward_model trainer is at step 0; cannot run step 2"):
        trainer.train_step(2)
    assert trainer.train_step(1)["step"] == 1 and trainer.step == 1
    with pytest.raises(RuntimeError, match="is at step 1; cannot run step 1"):
        trainer.train_step(1)  # a step never runs twice on the same state


def test_checkpoint_exports_as_a_loadable_hf_directory(tiny_model_dir, tmp_path):
    run = make_run(tiny_model_dir)
    trainer = RewardModelTrainer.from_checkpoint(run, RewardModelTrainer.initial(run).checkpoint_id)
    metrics = trainer.train_step(1)
    checkpoint = trainer.snapshot(metrics)
    manifest = read_manifest(run.store, checkpoint)
    assert manifest["step"] == 1 and manifest["metrics"]["loss"] == metrics["loss"]
    assert "pairs_per_s" not in manifest["metrics"]  # timings would make ids differ run to run
    directory = export_hf_directory(run.store, checkpoint, tmp_path / "export")
    assert not list(directory.glob("*.bin")) and not list(directory.glob("*.pkl"))
    reloaded = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    trainer.model.eval()
    ids = torch.tensor([run.store.get_table(run.data_ids["tokenized"], wire.TOKENIZED_PAIRS)
                        .column("chosen_input_ids")[0].as_py()])
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits, atol=1e-6)


def test_a_checkpoint_id_is_stable_while_idle_and_changes_after_a_step(tiny_model_dir):
    """Seed 000's rule: snapshotting a trainer that has not stepped gives the id it already has."""
    run = make_run(tiny_model_dir)
    trainer = RewardModelTrainer.initial(run)
    first = trainer.checkpoint_id
    assert trainer.snapshot({}) == first and trainer.snapshot({"loss": 1.0}) == first
    reopened = RewardModelTrainer.from_checkpoint(run, first)
    assert reopened.snapshot({}) == first
    reopened.train_step(1)
    after = reopened.snapshot({})
    assert after != first and reopened.snapshot({}) == after
