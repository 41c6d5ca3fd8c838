"""The RL step in-process (no Prefect): two envs with different sources, rewards and algorithms in one run,
missing rewards, a step where every reward fails, replay of the policy state from its last snapshot, and the
zero-advantage filter."""

from __future__ import annotations

from unittest.mock import ANY

import json

import pyarrow as pa
import pytest
import torch

from rollout_lib.identity.training import training_settings
from rollout_lib import wire
from rollout_lib.config import RlConfig
from rollout_lib.plan_checks import validate_config
from rollout_lib.reward.results import AllRewardsFailedError
from rollout_lib.rl.advantages import training_samples
from rollout_lib.rl.pack import pack
from rollout_lib.rl.policy import (
    initial_policy,
    pending_steps,
    policy_at,
    policy_inputs,
    snapshot_policy,
    train_policy_step,
)
from rollout_lib.rl.prompts import check_distinct_examples, load_prompts
from rollout_lib.rl.sample import build_samplers, sample_rollouts
from rollout_lib.rl.score import run_reward_loops, score_rollouts
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.resident import ResidentTrainer


@pytest.fixture
def resident():
    with ResidentTrainer() as trainer:
        yield trainer


@pytest.fixture
def reward_loops(tmp_path, tiny_model_dir):
    loops = {}

    def for_config(cfg: RlConfig):
        return loops.setdefault(id(cfg), run_reward_loops(cfg))

    yield for_config
    for loop in loops.values():
        loop.close()


def config(tmp_path, tiny_model_dir, words_reward=None, only_words=False, **settings) -> RlConfig:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(row) for row in [
        {"prompt": "Say a few words.", "answer": "3"},
        {"prompt": "Count to three."},  # no answer: number_match cannot score it -> missing reward
        {"prompt": "Hello there.", "answer": "7"},
    ]) + "\n")
    raw = {
        "run": {"name": "pipeline", "seed": 3, "store": "memory://unused"},
        "algorithm": {"rl": {
            "base_model": str(tiny_model_dir), "max_seq_len": 96, "checkpoint_interval": 1,
            "optimizer": {"lr": 1e-2}, "budget": {"max_steps": 2},
            "reward_loop": {"concurrency": 8, "timeout_s": 60},
            "envs": [
                {"name": "words", "source": {"type": "jsonl_path", "path": str(prompts)}, "prompts_per_step": 3,
                 "sampling": {"group_size": 3, "max_tokens": 8}, "algo": {"type": "grpo"},
                 "rewards": words_reward or [{"function": "target_length", "kwargs": {"target": 4}},
                                             {"function": "number_match", "weight": 0.5}]},
                {"name": "sums", "source": {"type": "reasoning_gym", "dataset": "chain_sum", "size": 6, "seed": 1},
                 "prompts_per_step": 2, "sampling": {"group_size": 2, "max_tokens": 6}, "algo": {"type": "max_rl"},
                 "rewards": [{"function": "reasoning_gym"}]},
            ],
            **settings,
        }},
    }
    if only_words:
        del raw["algorithm"]["rl"]["envs"][1]
    return validate_config(RlConfig, raw)


def run_for(cfg: RlConfig, store: ObjectStore) -> tuple[TrainingInputs, dict]:
    prompts = {env.name: load_prompts(env) for env in cfg.settings.envs}
    check_distinct_examples(prompts)
    ids = {name: store.put_table(table) for name, table in prompts.items()}
    return policy_inputs(store, cfg, ids), prompts


def one_step(cfg, run, prompts, state, step, resident, loops):
    policy = policy_at(run, state, resident)
    rollouts, sample_metrics = sample_rollouts(cfg, build_samplers(cfg, policy.model, policy.tokenizer), prompts, step)
    scored, reward_metrics = score_rollouts(cfg, rollouts, prompts, loops)
    samples, advantage_metrics = training_samples(cfg, scored)
    micro_batches, _ = pack(cfg, samples)
    state, train_metrics = train_policy_step(run, state, step, run.store.put_table(micro_batches), resident)
    return state, {**sample_metrics, **reward_metrics, **advantage_metrics, **train_metrics,
                   "rollouts_table": rollouts, "scored_table": scored, "samples_table": samples,
                   "micro_batches_table": micro_batches}


def test_two_envs_two_algorithms_one_step_with_missing_rewards(tmp_path, tiny_model_dir, resident, reward_loops):
    # Micro-batches of 192 tokens: room for groups of both envs in one (each group's prompt is stored once, so a
    # group packs as one unit of 38-82 tokens here).
    cfg = config(tmp_path, tiny_model_dir, micro_batch_tokens=192)
    run, prompts = run_for(cfg, ObjectStore("memory://rl-pipeline-a"))
    state = initial_policy(run, resident)
    state, out = one_step(cfg, run, prompts, state, 1, resident, reward_loops(cfg))

    scored = out["scored_table"]
    assert scored.schema == wire.ROLLOUTS and scored.num_rows == 3 * 3 + 2 * 2
    assert scored.column("env").to_pylist() == ["words"] * 9 + ["sums"] * 4
    # The prompt without an answer: its 3 samples have a missing reward with number_match's error.
    missing = [r for r in scored.to_pylist() if r["reward"] is None]
    assert len(missing) == 3 and out["missing_rewards"] == 3
    assert all("number_match needs an answer" in r["reward_error"] for r in missing)
    assert out["missing_rewards/words"] == 3 and out["missing_rewards/sums"] == 0

    samples = {row["sample_id"]: row for row in out["samples_table"].to_pylist()}
    for row in missing:
        assert not any(samples[row["sample_id"]]["rl_weights"])  # ships, trains nothing
    assert out["trainable_samples"] == 13 - 3
    # Both envs in one micro-batch: at least one bin mixes them.
    envs_by_id = dict(zip(scored.column("sample_id").to_pylist(), scored.column("env").to_pylist()))
    mixed = [ids for ids in out["micro_batches_table"].column("sample_ids").to_pylist()
             if len({envs_by_id[i] for i in ids}) == 2]
    assert mixed, [(ids, lengths) for ids, lengths in zip(out["micro_batches_table"].column("sample_ids").to_pylist(),
                                                         out["micro_batches_table"].column("sequence_lengths").to_pylist())]
    assert out["tokens/rl"] == out["rl_tokens"] > 0 and out["grad_norm"] > 0
    assert out["rl/mismatch_kl"] == pytest.approx(0.0, abs=1e-5)  # sampler and trainer agree on-policy


def test_a_step_where_every_reward_fails_fails_loudly(tmp_path, tiny_model_dir, resident, reward_loops):
    cfg = config(tmp_path, tiny_model_dir, words_reward=[{"function": "example_rewards:always_fails"}],
                 only_words=True)
    run, prompts = run_for(cfg, ObjectStore("memory://rl-pipeline-b"))
    policy = policy_at(run, initial_policy(run, resident), resident)
    rollouts, _ = sample_rollouts(cfg, build_samplers(cfg, policy.model, policy.tokenizer), prompts, 1)
    with pytest.raises(AllRewardsFailedError, match="all 9 rewards failed"):
        score_rollouts(cfg, rollouts, prompts, reward_loops(cfg))


def test_replay_from_the_last_snapshot_reaches_the_same_weights(tmp_path, tiny_model_dir, resident, reward_loops):
    cfg = config(tmp_path, tiny_model_dir, words_reward=[{"function": "target_length", "kwargs": {"target": 4}}],
                 only_words=True)
    run, prompts = run_for(cfg, ObjectStore("memory://rl-pipeline-c"))
    start = state = initial_policy(run, resident)
    history = []
    for step in (1, 2):
        state, out = one_step(cfg, run, prompts, state, step, resident, reward_loops(cfg))
        history.append(out)
    live_weights = {k: v.clone() for k, v in policy_at(run, state, resident).model.state_dict().items()}
    # The step records chain back to the step-0 snapshot and name each step's micro-batches.
    base, batches = pending_steps(run.store, state, cfg.settings.checkpoint_interval)
    assert base == start and sorted(batches) == [1, 2]

    resident.close()  # a new process: nothing in memory
    replayed = policy_at(run, state, resident)
    assert replayed.step == 2
    for name, tensor in replayed.model.state_dict().items():
        assert torch.equal(tensor, live_weights[name]), name
    # ... and it samples step 3 exactly as the live policy would have.
    sampler = build_samplers(cfg, replayed.model, replayed.tokenizer)
    again, _ = sample_rollouts(cfg, sampler, prompts, 3)
    assert again.column("completion_ids").to_pylist() == sample_rollouts(cfg, sampler, prompts, 3)[0].column(
        "completion_ids").to_pylist()

    # A snapshot at step 3, then a checkpoint id that does not depend on the store it was written to.
    state, out = one_step(cfg, run, prompts, state, 3, resident, reward_loops(cfg))
    history.append(out)
    checkpoint = snapshot_policy(run, state, resident, {})
    interval = cfg.settings.checkpoint_interval
    assert pending_steps(run.store, state, interval) == (checkpoint, {})  # the run's schedule: rebuilt from it
    assert pending_steps(run.store, state, 3) == (start, {1: ANY, 2: ANY, 3: ANY})  # another's never uses it
    other_run, _ = run_for(cfg, ObjectStore("memory://rl-pipeline-d"))
    with ResidentTrainer() as other_resident:
        other_state = initial_policy(other_run, other_resident)
        for step, out in zip((1, 2, 3), history):
            other_state, _ = train_policy_step(other_run, other_state, step,
                                               other_run.store.put_table(out["micro_batches_table"]), other_resident)
        assert other_state == state  # a state's id is what was trained, whatever the store
        assert snapshot_policy(other_run, other_state, other_resident, {}) == checkpoint


def test_the_zero_advantage_filter_drops_samples_without_credit_and_keeps_every_other_signal():
    """seed 002's filter (rl/filters.py): rl-only samples whose every rl advantage is 0 go; ce / ref_kl samples
    stay whatever their advantages; a sample missing its advantages stays for packing to refuse; a step left with
    nothing keeps one sample with every weight zeroed, so it trains nothing."""
    from rollout_lib.rl.filters import drop_zero_advantage_samples

    def sample(name, advantages, **streams):
        return {"sample_id": name, "env": "e", "input_ids": [1, 2, 3, 4], "loss_mask": [False, False, True, True],
                "advantages": advantages, "rl_weights": None, "ce_weights": None, "ref_kl_weights": None,
                "ref_logprobs": None, "inference_logprobs": [0.0] * 4, "temperatures": None, **streams}

    rows = [sample("flat", [0.0, 0.0, 0.0, 0.0]),
            sample("credit", [0.0, 0.0, 0.5, 0.5]),
            sample("credit-outside-rl", [0.0, 0.0, 0.0, 0.0], rl_weights=[0.0, 0.0, 1.0, 0.0]),
            sample("prompt-only-credit", [0.3, 0.3, 0.0, 0.0]),  # advantages outside the rl tokens do not count
            sample("distilled", [0.0] * 4, rl_weights=[0.0] * 4, ref_kl_weights=[0.0, 0.0, 1.0, 1.0],
                   ref_logprobs=[0.0] * 4),
            sample("no-advantages", None)]
    kept, dropped = drop_zero_advantage_samples(pa.Table.from_pylist(rows, schema=wire.TRAINING_SAMPLES))
    assert kept.column("sample_id").to_pylist() == ["credit", "distilled", "no-advantages"]
    assert dropped == 3

    flat = pa.Table.from_pylist([sample("a", [0.0] * 4), sample("b", [0.0] * 4)], schema=wire.TRAINING_SAMPLES)
    kept, dropped = drop_zero_advantage_samples(flat)
    assert dropped == 2 and kept.num_rows == 1 and kept.column("rl_weights").to_pylist() == [[0.0] * 4]


def test_a_filtered_step_trains_on_what_is_left_and_a_step_left_with_nothing_trains_nothing(
        tmp_path, tiny_model_dir, resident, reward_loops):
    """`zero_advantage_filter = true` (absent from the identity when off): the pack stage drops the samples without
    credit and counts them; a step whose every advantage is 0 keeps a zero-weight placeholder and takes no
    optimizer step (weights unchanged)."""
    from rollout_lib.identity.training import training_hash
    from rollout_lib.rl.filters import drop_zero_advantage_samples

    off = config(tmp_path, tiny_model_dir, only_words=True)
    cfg = config(tmp_path, tiny_model_dir, only_words=True, zero_advantage_filter=True)
    assert "zero_advantage_filter" not in training_settings(off) and training_hash(cfg) != training_hash(off)
    run, prompts = run_for(cfg, ObjectStore("memory://rl-pipeline-filter"))
    state = initial_policy(run, resident)
    policy = policy_at(run, state, resident)
    rollouts, _ = sample_rollouts(cfg, build_samplers(cfg, policy.model, policy.tokenizer), prompts, 1)
    scored, _ = score_rollouts(cfg, rollouts, prompts, reward_loops(cfg))
    samples, _ = training_samples(cfg, scored)
    flat = sum(1 for row in samples.to_pylist() if not any(row["advantages"] or [0.0]))
    micro_batches, metrics = pack(cfg, samples)
    assert metrics["filtered/zero_advantage"] == flat >= 3  # the group whose rewards are all missing, at least
    assert sum(len(ids) for ids in micro_batches.column("sample_ids").to_pylist()) == samples.num_rows - flat

    no_credit = samples.set_column(samples.schema.get_field_index("advantages"), "advantages",
                                   pa.array([[0.0] * len(ids) for ids in samples.column("input_ids").to_pylist()],
                                            pa.list_(pa.float32())))
    placeholder, dropped = drop_zero_advantage_samples(no_credit)
    assert dropped == samples.num_rows and placeholder.num_rows == 1
    before = {name: tensor.clone() for name, tensor in policy.model.state_dict().items()}
    micro_batches, _ = pack(off, placeholder)
    state, trained = train_policy_step(run, state, 1, run.store.put_table(micro_batches), resident)
    assert trained["grad_norm"] == 0.0 and trained["tokens/rl"] == 0
    after = policy_at(run, state, resident).model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_a_step_with_a_custom_rl_loss_trains_and_logs_its_metrics(tmp_path, tiny_model_dir, resident,
                                                                   reward_loops):
    cfg = config(tmp_path, tiny_model_dir, only_words=True,
                 loss={"type": "custom", "import_path": "example_losses:clipped_importance_pg",
                       "kwargs": {"clip": 0.2}})
    run, prompts = run_for(cfg, ObjectStore("memory://rl-pipeline-custom-loss"))
    state = initial_policy(run, resident)
    state, out = one_step(cfg, run, prompts, state, 1, resident, reward_loops(cfg))
    assert out["grad_norm"] > 0 and out["tokens/rl"] > 0 and 0.0 <= out["rl/clip_fraction"] <= 1.0
    assert "rl/masked_fraction" not in out  # the built-in loss's diagnostics: it did not run


def test_each_groups_prompt_is_packed_once_and_the_setting_is_in_the_identity(tmp_path, tiny_model_dir, resident,
                                                                               reward_loops):
    """`share_prompt_prefix` (on by default; absent from the identity when off, so older identities stay): the
    pack stage stores each group's prompt once, and what it leaves out is exactly the other samples' prompts
    (tests/test_packing.py shows the logprobs and gradients are the unshared packing's)."""
    from rollout_lib.identity.training import training_hash

    cfg = config(tmp_path, tiny_model_dir, only_words=True)
    off = config(tmp_path, tiny_model_dir, only_words=True, share_prompt_prefix=False)
    assert training_settings(cfg)["share_prompt_prefix"] is True
    assert "share_prompt_prefix" not in training_settings(off)
    assert training_hash(cfg) != training_hash(off)
    run, prompts = run_for(cfg, ObjectStore("memory://rl-pipeline-shared-prefix"))
    policy = policy_at(run, initial_policy(run, resident), resident)
    rollouts, _ = sample_rollouts(cfg, build_samplers(cfg, policy.model, policy.tokenizer), prompts, 1)
    scored, _ = score_rollouts(cfg, rollouts, prompts, reward_loops(cfg))
    samples, _ = training_samples(cfg, scored)
    shared, metrics = pack(cfg, samples)
    plain, plain_metrics = pack(off, samples)
    groups: dict[str, list[int]] = {}  # example id -> the prompt length of each of its samples
    for row in samples.to_pylist():
        groups.setdefault(row["sample_id"].rsplit("#", 1)[0], []).append(row["loss_mask"].index(True))
    stored = sum(sum(lengths) for lengths in shared["sequence_lengths"].to_pylist())
    everything = sum(sum(lengths) for lengths in plain["sequence_lengths"].to_pylist())
    assert plain_metrics["shared_prefix_tokens"] == 0
    # At least every later sample's prompt; more where a sample without credit (its reward missing: no weight at
    # all) also starts its completion as the group's first sample does.
    assert metrics["shared_prefix_tokens"] == everything - stored >= sum(
        lengths[0] * (len(lengths) - 1) for lengths in groups.values()) > 0, (metrics, groups)
    assert sorted(sum(shared["sample_ids"].to_pylist(), [])) == sorted(samples.column("sample_id").to_pylist())
