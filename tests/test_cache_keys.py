"""Cache keys hold what decides a result and nothing else: what users do after a run (extend it, add an eval set,
change the snapshot interval or the store's credentials) reuses every finished step; what changes the weights (a
decaying schedule's horizon, the thread count, the base model's files, a library upgrade) does not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from clirun import final_result, run_rollout, task_run_states, train_in_process
from rollout_lib.config import RmConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.model.loading import model_content_digest
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import deterministic_metrics

ROOT = Path(__file__).resolve().parent.parent
TINY = ["train", "rm", "--config", "configs/rm-tiny.toml", "--set", "algorithm.rm.checkpoint_interval=2"]


def train(store: Path, *settings: str) -> tuple[dict, dict]:
    """The flow in this process (the CLI's start-up is not what these tests are about): its result and the
    states of its task runs."""
    result = train_in_process(*TINY, "--set", f"run.store={store}", *settings)
    return result, task_run_states(result["flow_run_id"])


def segment_states(states: dict) -> dict:
    return {name: state for name, state in states.items() if name.startswith("train-steps-")}


@pytest.mark.slow
def test_what_users_change_after_a_run_reuses_every_finished_step(prefect_server, tmp_path):
    store = tmp_path / "store"
    reference, _ = train(tmp_path / "reference", "--set", "algorithm.rm.budget.max_steps=6")
    train(store, "--set", "algorithm.rm.budget.max_steps=4")

    # Extend the finished run: steps 1-4 come back from cache, 5-6 train, and the run ends on the checkpoint an
    # uninterrupted 6-step run reaches.
    extended, states = train(store, "--set", "algorithm.rm.budget.max_steps=6")
    assert segment_states(states) == {"train-steps-1-2": "Cached", "train-steps-3-4": "Cached",
                                      "train-steps-5-6": "Completed"}
    assert extended["checkpoint"] == reference["checkpoint"]

    # Add a held-out set, change the eval batch size and the store's (credential-like) options: no training.
    eval_set = ["--set", f"algorithm.rm.eval_dataset.path={ROOT / 'data/rm-tiny.jsonl'}",
                "--set", "algorithm.rm.eval_batch_size=3", "--set", "run.storage_options.auto_mkdir=true"]
    evaluated, states = train(store, "--set", "algorithm.rm.budget.max_steps=6", *eval_set)
    assert set(segment_states(states).values()) == {"Cached"} and states["evaluate-step-6"] == "Completed"
    assert evaluated["checkpoint"] == reference["checkpoint"] and evaluated["eval_after"]["pairs"] == 4
    manifest_bytes = (store / "objects" / reference["checkpoint"][:2] / reference["checkpoint"]).read_bytes()
    assert b"auto_mkdir" not in manifest_bytes and b"storage_options" not in manifest_bytes

    # Another snapshot interval: a segment over steps an earlier run trained returns that run's checkpoint from
    # the chain index without training (its task runs, but trains nothing).
    done = run_rollout(*TINY, "--set", f"run.store={store}", "--set", "algorithm.rm.budget.max_steps=6",
                       "--set", "algorithm.rm.checkpoint_interval=3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert final_result(done)["checkpoint"] == reference["checkpoint"]
    assert "steps 4-6: checkpoint" in done.stdout + done.stderr and "already trained by an earlier run" in (
        done.stdout + done.stderr)


@pytest.mark.slow
def test_a_decaying_schedule_whose_horizon_moves_is_another_training_its_run_name_refuses(prefect_server,
                                                                                            tmp_path):
    """Through the CLI, which claims a run's name before anything runs. That the horizon enters the training hash
    (and decay_steps pins it) is test_the_training_hash_holds_what_decides_the_weights_and_nothing_else's; a finished
    run's steps coming back from cache when only max_steps moves is test_what_users_change_...'s."""
    store = tmp_path / "store"
    cosine = [*TINY, "--set", f"run.store={store}", "--set", "algorithm.rm.optimizer.schedule=cosine",
              "--set", "run.name=cosine"]
    done = run_rollout(*cosine, "--set", "algorithm.rm.budget.max_steps=4")
    assert done.returncode == 0, done.stderr[-3000:]
    # Every step's learning rate would change: a new training, which the run's name may not silently take over.
    refused = run_rollout(*cosine, "--set", "algorithm.rm.budget.max_steps=6")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "rollout: error: run name 'cosine' in ") and "already holds a run of other settings" in refused.stderr
    assert ObjectStore(str(store)).get_ref("runs/cosine/latest") == final_result(done)["checkpoint"]  # untouched


def rm_config(*overrides: str) -> RmConfig:
    return load_config(RmConfig, ROOT / "configs/rm-tiny.toml", list(overrides))


def test_the_training_hash_holds_what_decides_the_weights_and_nothing_else():
    base = training_hash(rm_config())
    same = [
        "algorithm.rm.budget.max_steps=9", "algorithm.rm.checkpoint_interval=7", "algorithm.rm.eval_batch_size=3",
        "run.name=other", "run.store=/tmp/elsewhere", "run.storage_options.key=secret",
        "algorithm.rm.dataset.path=data/pairs-heldout.jsonl",  # the data's content enters keys as its content id
    ]
    for override in same:
        assert training_hash(rm_config(override)) == base, override
    different = ["run.seed=7", "run.torch_threads=1", "algorithm.rm.optimizer.lr=0.5", "algorithm.rm.max_seq_len=32",
                 'algorithm.rm.optimizer.schedule=linear']
    for override in different:
        assert training_hash(rm_config(override)) != base, override
    # A decaying schedule's horizon is max_steps unless pinned by decay_steps.
    linear = 'algorithm.rm.optimizer.schedule=linear'
    assert training_hash(rm_config(linear, "algorithm.rm.budget.max_steps=9")) != training_hash(rm_config(linear))
    pinned = [linear, "algorithm.rm.optimizer.decay_steps=20"]
    assert training_hash(rm_config(*pinned, "algorithm.rm.budget.max_steps=9")) == training_hash(rm_config(*pinned))


def test_a_claim_records_what_the_identity_hashes_keyed_as_users_write_it():
    from rollout_lib.identity.claims import claimed_settings

    def differing(*overrides: str) -> set[str]:
        base, other = claimed_settings(rm_config()), claimed_settings(rm_config(*overrides))
        return {key for key in base.keys() | other.keys() if base.get(key) != other.get(key)}

    assert differing("run.name=other", "algorithm.rm.budget.max_steps=9") == set()  # a constant schedule
    assert differing("run.seed=7", "algorithm.rm.optimizer.lr=0.5") == {"run.seed", "algorithm.rm.optimizer.lr"}
    linear = "algorithm.rm.optimizer.schedule=linear"  # max_steps is the schedule's horizon: it counts
    assert differing(linear, "algorithm.rm.budget.max_steps=9") == {"algorithm.rm.optimizer.schedule",
                                                                     "algorithm.rm.budget.max_steps"}
    assert "algorithm.rm.base_model (files)" in claimed_settings(rm_config())


def test_the_base_model_is_its_content_not_its_reference(tiny_model_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    assert model_content_digest(str(copy)) == model_content_digest(str(tiny_model_dir))  # same files, same id
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rope_theta": 12345.0}))
    assert model_content_digest(str(copy)) != model_content_digest(str(tiny_model_dir))  # re-saved: a new model


def test_numeric_library_versions_enter_the_code_version(monkeypatch):
    from rollout_lib.identity import code as module

    before = module.code_version.__wrapped__("tasks.rm")
    monkeypatch.setattr(module, "library_versions", lambda: {"torch": "99.0"})
    assert module.code_version.__wrapped__("tasks.rm") != before


def test_checkpoint_manifests_keep_no_text_and_no_timings():
    metrics = {"step": 3, "loss": 0.5, "reward_errors": ["connection refused by 127.0.0.1:4242 (pid 77)"],
               "train_s": 1.2, "tokens_per_s": 900.0, "ok": True}
    assert deterministic_metrics(metrics) == {"step": 3, "loss": 0.5, "ok": True}


def test_a_custom_advantage_functions_source_enters_the_advantages_key(tmp_path, monkeypatch):
    """A user's advantage function is outside the code version: editing its module must re-run the advantages
    stage, not return the old samples from cache (as reward modules do for the score stage)."""
    from rollout_lib.config import RlConfig
    from rollout_lib.identity.sources import algorithm_sources

    module = tmp_path / "my_advantages.py"
    module.write_text("def credit(group):\n    return [[1.0] * n for n in group.completion_lengths]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(RlConfig, ROOT / "configs/rl-tiny.toml",
                         ['algorithm.rl.envs[0].algo={ type = "custom", import_path = "my_advantages:credit" }'])
    before = algorithm_sources(config)
    assert list(before["algorithm_sources"]) == ["my_advantages"]  # built-in algorithms are in the code version
    module.write_text(module.read_text() + "# edited\n")
    assert algorithm_sources(config) != before
    grpo = load_config(RlConfig, ROOT / "configs/rl-tiny.toml")
    assert algorithm_sources(grpo) == {"algorithm_sources": {}}
