"""Off-policy steps (`max_off_policy_steps = k`): step n trains on rollouts sampled from the state after step
n-1-k, sampled while the step before trains; the trainer recomputes the behaviour logprobs (rl/behaviour.py), so
a rerun after SIGKILL anywhere (sampling, a reload of the policy server, training) ends on the uninterrupted
run's checkpoint id, on the engine at any concurrency too."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from rollout_lib.identity.training import training_settings
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.plan_checks import load_config, validate_config
from rollout_lib.rl.advantages import PolicyReference, algorithm_resources, training_samples
from rollout_lib.rl.policy import FrozenPolicy, initial_policy, policy_at, policy_inputs, sampling_policy
from rollout_lib.rl.prompts import load_prompts
from rollout_lib.rl.sample import build_samplers, sample_rollouts
from rollout_lib.rl.score import run_reward_loops, score_rollouts
from rollout_lib.store import ObjectStore
from rollout_lib.identity.training import training_identity
from rollout_lib.trainer.resident import ResidentTrainer

ROOT = Path(__file__).resolve().parent.parent


def rl_tiny(tmp_path, *overrides: str) -> RlConfig:
    return load_config(RlConfig, ROOT / "configs/rl-tiny.toml", [f"run.store={tmp_path / 'store'}", *overrides])


# --- settings ---------------------------------------------------------------------------------------------------

def test_k_and_the_resolved_behaviour_logprobs_enter_the_identity_the_spelling_does_not(tmp_path):
    synchronous = rl_tiny(tmp_path)
    assert not synchronous.settings.recomputes_behaviour_logprobs  # embedded sampler, k = 0: today's loop
    off_policy = rl_tiny(tmp_path, "algorithm.rl.max_off_policy_steps=1")
    engine = rl_tiny(tmp_path, 'algorithm.rl.policy_sampler={ type = "vllm" }')
    assert off_policy.settings.recomputes_behaviour_logprobs and not engine.settings.recomputes_behaviour_logprobs
    assert training_identity(off_policy) != training_identity(synchronous)
    # "auto" and what it resolves to are one training; another choice is another.
    explicit = rl_tiny(tmp_path, "algorithm.rl.max_off_policy_steps=1", 'algorithm.rl.behaviour_logprobs="trainer"')
    assert training_identity(explicit) == training_identity(off_policy)
    reported = rl_tiny(tmp_path, "algorithm.rl.max_off_policy_steps=1", 'algorithm.rl.behaviour_logprobs="sampler"')
    assert training_identity(reported) != training_identity(off_policy)
    with pytest.raises(ConfigError, match=r"algorithm\.rl\.max_off_policy_steps"):
        rl_tiny(tmp_path, "algorithm.rl.max_off_policy_steps=-1")
    with pytest.raises(ConfigError, match=r"algorithm\.rl\.behaviour_logprobs"):
        rl_tiny(tmp_path, 'algorithm.rl.behaviour_logprobs="engine"')
    # On the engine at k = 0 the training forward's own logprobs are the behaviour's: that path is recorded.
    assert engine.settings.behaviour_logprobs_source == "training_forward"
    assert training_settings(engine)["behaviour_logprobs"] == "training_forward"
    recomputing = rl_tiny(tmp_path, 'algorithm.rl.policy_sampler={ type = "vllm" }',
                          'algorithm.rl.behaviour_logprobs="trainer"')
    assert training_identity(recomputing) != training_identity(engine)
    with pytest.raises(ConfigError, match=r"algorithm\.rl.*training_forward.*max_off_policy_steps = 0"):
        rl_tiny(tmp_path, "algorithm.rl.max_off_policy_steps=1", 'algorithm.rl.behaviour_logprobs="training_forward"')


def test_frozen_copies_are_bounded_and_survive_the_trainer_moving_on():
    resident = ResidentTrainer(frozen_capacity=2)
    resident.put("s1", "trainer")
    for state in ("s0", "s1", "s2"):
        assert resident.keep_frozen(state, f"copy-{state}") == f"copy-{state}"
    assert resident.frozen("s0") is None and resident.frozen("s2") == "copy-s2"  # the oldest dropped
    assert resident.keep_frozen("s2", "another") == "copy-s2"  # one copy per state: the first kept
    assert resident.pop("s1") == "trainer" and resident.frozen("s1") == "copy-s1"  # training on keeps copies
    resident.close()
    assert resident.frozen("s1") is None


# --- the behaviour logprobs, in process ------------------------------------------------------------------------

def words_config(tiny_model_dir, **settings) -> RlConfig:
    return validate_config(RlConfig, {
        "run": {"name": "off-policy", "seed": 5, "store": "memory://unused"},
        "algorithm": {"rl": {
            "base_model": str(tiny_model_dir), "max_seq_len": 96, "checkpoint_interval": 1,
            "optimizer": {"lr": 1e-2}, "budget": {"max_steps": 2},
            "envs": [{"name": "words",
                      "source": {"type": "jsonl_path", "path": str(ROOT / "data/rl-tiny-prompts.jsonl")},
                      "prompts_per_step": 3, "sampling": {"group_size": 4, "max_tokens": 10},
                      "algo": {"type": "grpo"}, "rewards": [{"function": "target_length", "kwargs": {"target": 4}}]}],
            **settings,
        }},
    })


@contextlib.contextmanager
def sampled_step(cfg: RlConfig, store_url: str, frozen_rows: tuple[int, ...]):
    """The initial policy of `cfg` (embedded sampler) and one step of its scored rollouts, with `frozen_rows`
    marked as a frozen model's (their logprobs are that model's: never recomputed nor replaced). Yields (policy,
    scored, reference) inside the resident trainer's lifetime."""
    store = ObjectStore(store_url)
    prompts = {"words": load_prompts(cfg.settings.envs[0])}
    run = policy_inputs(store, cfg, {"words": store.put_table(prompts["words"])})
    with ResidentTrainer() as resident, run_reward_loops(cfg) as loops:
        state = initial_policy(run, resident)
        policy = policy_at(run, state, resident)
        rollouts, _ = sample_rollouts(cfg, build_samplers(cfg, policy.model, policy.tokenizer, policy_state=state),
                                      prompts, 1)
        scored, _ = score_rollouts(cfg, rollouts, prompts, loops)
        sources = scored.column("sampled_from").to_pylist()
        for row in frozen_rows:
            sources[row] = "frozen:served:teacher"
        scored = scored.set_column(scored.schema.get_field_index("sampled_from"), "sampled_from",
                                   pa.array(sources, pa.string()))
        yield policy, scored, PolicyReference(lambda: policy_at(run, state, resident), cfg.settings.base_model,
                                              state_id=state)


def test_the_trainer_recomputes_behaviour_logprobs_bit_stably_and_only_for_policy_tokens(tiny_model_dir):
    """Recomputed logprobs agree with the embedded sampler's own (same weights) within float noise, come out the
    same bits every time, replace only sampled completion tokens of rows sampled from that state, and leave a
    frozen model's rows as their sampler reported them."""
    cfg = words_config(tiny_model_dir, behaviour_logprobs="trainer")
    reported_cfg = words_config(tiny_model_dir, behaviour_logprobs="sampler")
    # Two rows as if a frozen model had sampled them: their logprobs are that model's, never recomputed.
    with sampled_step(cfg, "memory://off-policy-recompute", frozen_rows=(0, 5)) as (_, scored, reference):
        recomputed, metrics = training_samples(cfg, scored, algorithm_resources(cfg, policy=reference))
        again, _ = training_samples(cfg, scored, algorithm_resources(cfg, policy=reference))
        reported, reported_metrics = training_samples(reported_cfg, scored)

    assert recomputed.equals(again)  # bit for bit
    assert metrics["behaviour/recomputed"] == scored.num_rows - 2
    assert 0 < metrics["behaviour/sampler_diff_max"] < 1e-4 and metrics["behaviour/sampler_kl"] < 1e-8
    assert "behaviour/recomputed" not in reported_metrics
    mine, theirs = recomputed.to_pylist(), reported.to_pylist()
    changed = 0
    for row, (new, old) in enumerate(zip(mine, theirs)):
        assert {k: v for k, v in new.items() if k != "inference_logprobs"} == \
            {k: v for k, v in old.items() if k != "inference_logprobs"}
        for member, value, before in zip(new["loss_mask"], new["inference_logprobs"], old["inference_logprobs"]):
            if row in (0, 5) or not member:
                assert value == before  # a frozen model's row, or a prompt token: as stamped
            else:
                assert value == pytest.approx(before, abs=1e-4)
                changed += value != before
    assert changed > 0  # recomputed, not copied


def test_the_training_forwards_own_logprobs_train_what_the_recompute_trains(tiny_model_dir):
    """k = 0: the shortcut (behaviour_logprobs = "training_forward": policy tokens marked NaN, the loss takes its
    own forward's detached logprobs) trains the same step as the recompute, within float rounding (the recompute's
    padded no-grad batch vs the packed training batch): same loss, same gradient norm, same weights; a frozen
    model's rows keep their sampler's logprobs in both."""
    import copy
    import math

    from rollout_lib.rl.pack import pack
    from rollout_lib.trainer.causal import train_on_micro_batches
    from rollout_lib.trainer.optim import build_optimizer

    configs = {mode: words_config(tiny_model_dir, behaviour_logprobs=mode) for mode in ("trainer", "training_forward")}
    cfg = configs["trainer"]
    with sampled_step(cfg, "memory://off-policy-training-forward", frozen_rows=(3,)) as (policy, scored, reference):
        results = {}
        for mode, mode_cfg in configs.items():
            samples, metrics = training_samples(mode_cfg, scored, algorithm_resources(mode_cfg, policy=reference))
            model = copy.deepcopy(policy.model)
            micro_batches, _ = pack(mode_cfg, samples)
            step = train_on_micro_batches(model, build_optimizer(model.parameters(), mode_cfg.settings.optimizer),
                                          micro_batches, packed=True, pad_token_id=policy.tokenizer.pad_token_id,
                                          max_grad_norm=1.0, loss_kwargs=mode_cfg.settings.loss_kwargs())
            results[mode] = (samples, metrics, step, model)

    marked, marked_metrics, shortcut, shortcut_model = results["training_forward"]
    _, recompute_metrics, recompute, recompute_model = results["trainer"]
    assert marked_metrics["behaviour/training_forward"] == scored.num_rows - 1
    assert "behaviour/recomputed" not in marked_metrics and recompute_metrics["behaviour/recomputed"] > 0
    for row, sample in enumerate(marked.to_pylist()):
        for member, value in zip(sample["loss_mask"], sample["inference_logprobs"]):
            assert math.isnan(value) == (member and row != 3)  # the frozen row keeps its sampler's logprobs
    assert shortcut["rl/ratio_mean"] == 1.0 and shortcut["rl/mismatch_kl"] == 0.0  # exactly on-policy
    assert shortcut["rl/masked_fraction"] == recompute["rl/masked_fraction"] == 0.0
    assert shortcut["loss"] == pytest.approx(recompute["loss"], rel=1e-5, abs=1e-7)
    assert shortcut["grad_norm"] == pytest.approx(recompute["grad_norm"], rel=1e-4)
    moved = 0.0
    for (name, mine), theirs in zip(shortcut_model.state_dict().items(), recompute_model.state_dict().values()):
        assert torch_allclose(mine, theirs), name
        moved = max(moved, float((mine - policy.model.state_dict()[name]).abs().max()))
    assert moved > 1e-4  # the step trained: the agreement is not two untouched copies


def torch_allclose(a, b) -> bool:
    import torch

    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6))


def test_off_policy_stages_read_a_frozen_copy_never_the_training_trainer(tiny_model_dir):
    cfg = words_config(tiny_model_dir, max_off_policy_steps=1)
    store = ObjectStore("memory://off-policy-frozen")
    prompts = {"words": load_prompts(cfg.settings.envs[0])}
    run = policy_inputs(store, cfg, {"words": store.put_table(prompts["words"])})
    with ResidentTrainer(frozen_capacity=3) as resident:
        state = initial_policy(run, resident)
        frozen = sampling_policy(run, state, resident)
        assert isinstance(frozen, FrozenPolicy) and frozen.state_id == state
        trainer = resident.get(state)
        assert frozen.model is not trainer.model and not frozen.model.training
        for name, tensor in trainer.model.state_dict().items():
            assert tensor.equal(frozen.model.state_dict()[name])
        with ResidentTrainer() as fresh:  # a rerun's process: no copy kept, rebuilt from the store, same bits
            rebuilt = sampling_policy(run, state, fresh)
            assert fresh.get(state) is None  # the trainer slot is left to the training thread
        for name, tensor in rebuilt.model.state_dict().items():
            assert tensor.equal(frozen.model.state_dict()[name])


# --- the flow --------------------------------------------------------------------------------------------------

def _steps_sampled_from(store: ObjectStore) -> Counter:
    """How many rollouts tables were sampled from the state after each step (0: the initial policy)."""
    found: Counter = Counter()
    for object_id in store.list_objects():
        try:
            table = store.get_table(object_id)
        except (OSError, pa.ArrowInvalid):
            continue
        if "sampled_from" in table.column_names and "completion_ids" in table.column_names \
                and "reward" in table.column_names and table.column("reward").null_count == table.num_rows:
            (state,) = set(table.column("sampled_from").to_pylist())
            found[store.get_json(state)["step"]] += 1
    return found


def _state_after(store: ObjectStore, step: int) -> str:
    """The policy state after `step`: its step record (a snapshot of it is a checkpoint, not the state)."""
    from rollout_lib.rl.policy import STEP_STATE_KIND

    for object_id in store.list_objects():
        try:
            record = json.loads(store.get_bytes(object_id))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and record.get("kind") == STEP_STATE_KIND and record.get("step") == step:
            return object_id
    raise AssertionError(f"no state after step {step}")


# 4 steps: the fewest in which a step (4) samples a state after another step (2), and in which the engine test's two
# kills (reloading state 2, then sampling from it for step 4) still leave a step to rerun.
HF_K1 = ["train", "rl", "--config", "configs/rl-tiny.toml", "--max-steps", "4", "--set",
         "algorithm.rl.checkpoint_interval=2", "--set", "algorithm.rl.max_off_policy_steps=1"]


@pytest.mark.slow
def test_k1_samples_one_step_stale_and_a_kill_mid_training_reruns_to_the_same_checkpoint(prefect_server, tmp_path):
    """4 steps at k = 1: step 1 and 2 sample the initial policy, step n the state after n-2 (the rollouts record
    it), the trainer recomputed every behaviour logprob; SIGKILLed as step 3 starts training, the rerun returns
    what finished from cache and ends on the uninterrupted run's checkpoint."""
    from clirun import run_until_then_kill, task_run_states, train_in_process

    from rollout_lib.runlog.metrics_file import read_metrics

    expected = train_in_process(*HF_K1, "--store", str(tmp_path / "uninterrupted"), "--name", "k1")
    store = ObjectStore(str(tmp_path / "uninterrupted"))
    assert _steps_sampled_from(store) == Counter({0: 2, 1: 1, 2: 1})
    steps = read_metrics(store, "k1")
    assert [m["off_policy_lag"] for m in steps] == [0, 1, 1, 1]
    assert all(m["behaviour/recomputed"] == 32 for m in steps)
    assert all(m["rl/mismatch_kl"] > 0 for m in steps[1:])  # stale rollouts: the ratio is off 1 from step 2

    args = [*HF_K1, "--store", str(tmp_path / "interrupted")]
    run_until_then_kill(args, "pack-step-3' - Finished", tmp_path / "killed.log")
    resumed = train_in_process(*args)  # the rerun: the flow in this process
    states = task_run_states(resumed["flow_run_id"])
    assert states["train-step-2"] == "Cached" and states["train-step-4"] == "Completed"
    assert resumed["checkpoint"] == expected["checkpoint"]
    assert resumed["reward_curve"] == expected["reward_curve"]


ENGINE_K1 = [*HF_K1, "--set", 'algorithm.rl.policy_sampler={ type = "vllm", concurrency = 8 }']


@pytest.mark.slow
def test_k1_on_the_engine_a_kill_mid_reload_or_mid_sampling_reruns_to_the_same_checkpoint(prefect_server,
                                                                                          tmp_path):
    """The policy on the engine at k = 1, 8 requests in flight (the engine's logprob bits then vary with batch
    composition; the trainer's recomputed ones do not): SIGKILLed while the server reloads the state after step 2;
    the rerun, SIGKILLed in turn while step 4 samples from that state; each adopts the orphaned server, and the
    third run ends on the uninterrupted run's checkpoint."""
    from clirun import run_until_then_kill, train_in_process

    from rollout_lib.serving import engine

    expected = train_in_process(*ENGINE_K1, "--store", str(tmp_path / "uninterrupted"))
    state = _state_after(ObjectStore(str(tmp_path / "uninterrupted")), 2)

    args = [*ENGINE_K1, "--store", str(tmp_path / "interrupted")]
    for where, marker in (("reload", f"to state {state}"), ("sampling", f"with state {state}")):
        killed = run_until_then_kill(args, marker, tmp_path / f"killed-{where}.log")
        assert "train-step-2' - Finished" in killed, where
    # the third run, the flow in this process, adopts the orphan in turn
    assert train_in_process(*args)["checkpoint"] == expected["checkpoint"]
    assert not [d for d in engine.running_deployments() if d.live_policy]


def test_model_loads_take_the_process_lock_so_threads_never_untie_each_others_weights():
    """transformers swaps PreTrainedModel.tie_weights for a no-op class-wide while from_pretrained runs; two loads
    in two threads (a sampling thread rebuilding a past state beside the training thread) could leave the no-op in
    place for good, and every later model with an untied lm_head (seen: 'checkpoint weights do not fit the model:
    missing lm_head.weight' on a k = 1 rerun). Every load waits for the lock."""
    import threading

    from rollout_lib.config.common import ModelRef
    from rollout_lib.model.loading import FROM_PRETRAINED, load_causal_lm, resolve_model

    resolved = resolve_model(ModelRef(uri="tiny:qwen2"))
    loaded = []
    with FROM_PRETRAINED:
        loader = threading.Thread(target=lambda: loaded.append(load_causal_lm(resolved)))
        loader.start()
        loader.join(timeout=2.0)
        assert loader.is_alive() and not loaded  # waiting for the lock
    loader.join(timeout=60)
    (model,) = loaded
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
