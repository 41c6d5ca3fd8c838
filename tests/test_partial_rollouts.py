"""Partial rollouts (`algorithm.rl.partial_rollouts`, rl/partial.py): requests cut at a token budget per policy
version and resubmitted token-in to the next, each token recording the version that drew it; a rerun after SIGKILL
ends on the uninterrupted run's checkpoint id, and every prompt drawn is trained exactly once."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.identity.training import training_identity
from rollout_lib.plan_checks import load_config
from rollout_lib.store import ObjectStore
from rollout_lib import wire

ROOT = Path(__file__).resolve().parent.parent


def rl_tiny(tmp_path, *overrides: str) -> RlConfig:
    return load_config(RlConfig, ROOT / "configs/rl-tiny.toml", [f"run.store={tmp_path / 'store'}", *overrides])


def test_partial_rollouts_settings_refuse_what_is_not_built_and_enter_the_identity_only_when_on(tmp_path):
    k1 = "algorithm.rl.max_off_policy_steps=1"
    on = rl_tiny(tmp_path, k1, "algorithm.rl.partial_rollouts={ token_budget = 8 }")
    assert on.settings.staleness_bound == 2 and on.settings.behaviour_logprobs_source == "sampler"
    from rollout_lib.plan import describe_plan

    assert describe_plan(on)["partial_rollouts"]["max_staleness"] == 2  # the dry run says what runs
    off = rl_tiny(tmp_path, k1)
    engine = rl_tiny(tmp_path, k1, "algorithm.rl.partial_rollouts={ token_budget = 8 }",
                     'algorithm.rl.policy_sampler={ type = "vllm" }')
    assert engine.settings.behaviour_logprobs_source == "sampler"  # the stage's own recompute, rl/partial.py
    assert "partial_rollouts" not in off.settings.model_dump(mode="json")  # identities of runs without it stay
    assert training_identity(on) != training_identity(off)
    assert training_identity(rl_tiny(tmp_path, k1, "algorithm.rl.partial_rollouts={ token_budget = 4 }")) \
        != training_identity(on)
    refused = {
        "max_off_policy_steps >= 1": ["algorithm.rl.partial_rollouts={ token_budget = 8 }"],
        "below what max_off_policy_steps = 2 needs": [
            "algorithm.rl.max_off_policy_steps=2", "algorithm.rl.partial_rollouts={ token_budget = 8, max_staleness = 1 }"],
        "recomputes them under one state": [
            k1, "algorithm.rl.partial_rollouts={ token_budget = 8 }", 'algorithm.rl.behaviour_logprobs="trainer"'],
        "token_budget": [k1, "algorithm.rl.partial_rollouts={ token_budget = 0 }"],
    }
    for message, overrides in refused.items():
        with pytest.raises(ConfigError, match=r"algorithm\.rl") as raised:
            rl_tiny(tmp_path, *overrides)
        assert message in str(raised.value), (message, str(raised.value))


# 4 steps at k = 1, a budget of 8 of the 16 tokens rl-tiny's completions take at most: the tiny random policy rarely
# stops early, so most requests are cut and finish in a later stage (the staleness bound, k + 1 = 2: a group's oldest
# token at most 2 versions older than the state it trains from). Step 3 trains groups whose tokens are of versions
# 0 and 1.
PARTIAL = ["train", "rl", "--config", "configs/rl-tiny.toml", "--max-steps", "4", "--set",
           "algorithm.rl.checkpoint_interval=2", "--set", "algorithm.rl.max_off_policy_steps=1",
           "--set", "algorithm.rl.partial_rollouts={ token_budget = 8 }"]


def _trained_rollouts(store: ObjectStore, run: str, steps: int) -> dict[int, list[dict]]:
    from rollout_lib.runlog.step_tables import read_step_tables

    return {step: store.get_table(read_step_tables(store, run, step)["rollouts"], wire.ROLLOUTS).to_pylist()
            for step in range(1, steps + 1)}


ENGINE_PARTIAL = [*PARTIAL, "--set", 'algorithm.rl.policy_sampler={ type = "vllm", concurrency = 8 }',
                  "--set", 'algorithm.rl.loss.correction={ type = "tis", cap = 2.0 }']


@pytest.mark.slow
def test_partial_rollouts_on_the_engine_carry_tokens_across_versions_train_every_prompt_once_and_resume_exactly(
        prefect_server, tmp_path):
    """The policy on the engine, 8 requests in flight (its logprob bits vary with batch composition): carried
    requests are resubmitted token-in to the reloaded server, each token recording the version that drew it; each
    stage scores its new tokens with the trainer's forward under the version it holds (`behaviour_logprobs`); TIS
    weighs each token by those against the engine's report (on the float32 engine: w = 1 to 1e-6, nothing cut);
    every prompt drawn is trained once, whole; SIGKILLed while step 4 samples (requests carried from step 3 in flight),
    the rerun trains the same tables (tokens, versions, trainer logprobs) and ends on the uninterrupted run's
    checkpoint, after a first kill at a random moment of steps 2-3 and its own rerun (the draw is in the failure
    message). The one input the rerun may not reproduce is the engine's report of a stage sampled again, which only
    the correction's weights read: where its bits differ, the weights must be ~1e-6 apart. The embedded sampler runs
    the same stage code with its own logprobs (the stage test below: same inputs, same tables), so one flow-level
    kill test, on the engine, covers the flow's side for both."""
    from clirun import final_result, run_rollout, run_until_then_kill, task_run_states, train_in_process

    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.serving import engine
    from test_off_policy import _state_after

    expected = train_in_process(*ENGINE_PARTIAL, "--store", str(tmp_path / "uninterrupted"), "--name", "partial")
    store = ObjectStore(str(tmp_path / "uninterrupted"))
    trained = _trained_rollouts(store, "partial", 4)
    metrics = read_metrics(store, "partial")
    rows = [row for step_rows in trained.values() for row in step_rows]

    # Per-token versions on the wire: a version the step's schedule allows, and samples that span two versions.
    for step, step_rows in trained.items():
        for row in step_rows:
            versions = row["token_policy_versions"]
            assert len(versions) == len(row["completion_ids"]) == len(row["sampling_logprobs"])
            # drawn by this step's version (step - 2 at k = 1) or, carried, by the one before
            assert versions == sorted(versions) and set(versions) <= {max(0, step - 3), max(0, step - 2)}
    spanning = [row for row in trained[3] if len(set(row["token_policy_versions"])) == 2]
    assert spanning and all(row["drawn_at_step"] < 3 for row in spanning)
    assert sum(m["partial/multi_version_samples"] for m in metrics) >= len(spanning)
    assert any(m["partial/carried_samples"] > 0 for m in metrics) and metrics[-1]["partial/carried_samples"] == 0
    assert max(m["staleness_max"] for m in metrics) == 2  # k + 1: the bound, reached by carried tokens
    # The trainer's logprobs are the engine's within float32 engine noise: the stage scored the tokens it drew.
    assert all(len(row["behaviour_logprobs"]) == len(row["completion_ids"]) for row in rows)
    assert max(abs(a - b) for row in rows for a, b in zip(row["sampling_logprobs"], row["behaviour_logprobs"])) < 1e-3
    # TIS over tokens of several versions, each weighed against the trainer's logprob under the version that drew
    # it: on the float32 engine nothing to correct, every step.
    for m in metrics:
        assert m["mismatch/kl"] < 1e-8 and abs(m["mismatch/ratio_max"] - 1) < 1e-3, m
        assert m["mismatch/clipped_fraction"] == 0 and m["mismatch/masked_fraction"] == 0, m
    assert all(m["behaviour/sampler_over_cap_fraction"] == 0 for m in metrics)

    # The prompt ledger: every group drawn is trained once, whole, and the last step drained what was in flight.
    ledger = Counter((row["example_id"], row["drawn_at_step"]) for row in rows)
    assert len(ledger) == 16 and set(ledger.values()) == {8}  # group_size rows each, never twice
    drawn = Counter(row["drawn_at_step"] for row in rows if row["group_index"] == 0)
    assert drawn == Counter({step: m["partial/drawn_prompts"] for step, m in enumerate(metrics, 1)})
    assert sum(drawn.values()) == 4 * 4  # prompts_per_step x steps: none lost

    # Killed twice: first at a random moment (up to 1.5 s after step 1 trained: inside step 2's or 3's stages,
    # wherever the draw lands), then, in the rerun, while step 4 samples with requests carried from step 3 in flight.
    # The last rerun ends on the same checkpoint with the same trained tables.
    args = [*ENGINE_PARTIAL, "--store", str(tmp_path / "interrupted")]
    after_s = random.Random().uniform(0.0, 1.5)
    run_until_then_kill(args, "train-step-1' - Finished in state Completed", tmp_path / "killed-1.log",
                        after_s=after_s)
    killed = run_until_then_kill(args, f"with state {_state_after(store, 2)}", tmp_path / "killed-2.log")
    assert "train-step-2' - Finished" in killed, f"first kill {after_s:.2f} s after step 1 trained"
    rerun = run_rollout(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = final_result(rerun)
    states = task_run_states(resumed["flow_run_id"])
    assert states["train-step-2"] == "Cached" and states["train-step-4"] == "Completed"
    # The same rows: the same tokens, versions and trainer logprobs. The engine's own report, whose bits may vary
    # with batch composition, is read by the correction's weights alone.
    def engine_free(tables):
        return {step: [{**row, "sampling_logprobs": None} for row in rows] for step, rows in tables.items()}

    again = _trained_rollouts(ObjectStore(str(tmp_path / "interrupted")), "rl-tiny", 4)
    assert engine_free(again) == engine_free(trained)
    if again == trained:  # the engine reported the same bits for the same requests (every run so far)
        assert resumed["checkpoint"] == expected["checkpoint"], f"first kill {after_s:.2f} s after step 1 trained"
    else:  # a stage sampled again reported other bits: the weights differ by what w read of them, ~1e-6
        apart, moved = _weights_apart(store, expected["checkpoint"],
                                      ObjectStore(str(tmp_path / "interrupted")), resumed["checkpoint"])
        assert apart < 1e-4 * moved, (apart, moved)
    assert not [d for d in engine.running_deployments() if d.live_policy]


def _weights_apart(store: ObjectStore, checkpoint: str, other_store: ObjectStore, other: str) -> tuple[float, float]:
    """(L2 distance between two checkpoints' weights, L2 distance of the first from the initial rl-tiny policy)."""
    from rollout_lib.config.common import ModelRef
    from rollout_lib.model.loading import load_causal_lm, resolve_model

    initial = load_causal_lm(resolve_model(ModelRef(uri="tiny:qwen2"))).state_dict()
    mine, theirs = (where.get_tensors(where.get_json(checkpoint_id)["weights"])
                    for where, checkpoint_id in ((store, checkpoint), (other_store, other)))
    return (sum(float((tensor - theirs[name]).square().sum()) for name, tensor in mine.items()) ** 0.5,
            sum(float((tensor - initial[name]).square().sum()) for name, tensor in mine.items()) ** 0.5)


@pytest.mark.slow
def test_at_k_2_a_step_waits_for_what_the_stage_before_carries_and_the_bound_is_k_plus_1(prefect_server, tmp_path):
    """k = 2 on the embedded sampler, with MIS: step n samples with version n-3 and resumes what step n-1's stage
    carried, so it is submitted once that stage has ended (not only once its state exists); the staleness grows to
    k + 1 = 3 and no further; every prompt drawn is trained once, whole, and the last step drains; the correction
    weighs every token against the trainer's logprob under its version and finds nothing to drop."""
    from clirun import train_in_process

    from rollout_lib.runlog.metrics_file import read_metrics

    args = [*PARTIAL, "--set", "algorithm.rl.max_off_policy_steps=2", "--store", str(tmp_path / "store"),
            "--name", "k2", "--set", 'algorithm.rl.loss.correction={ type = "mis", cap = 2.0 }']
    train_in_process(*args)
    store = ObjectStore(str(tmp_path / "store"))
    trained, metrics = _trained_rollouts(store, "k2", 4), read_metrics(store, "k2")
    assert [m["staleness_max"] for m in metrics] == [0, 1, 2, 3]  # the state n-1 trains tokens of version >= n-4
    # MIS on the embedded sampler: its stages score their tokens for the correction (w = 1 to fp32 rounding, every
    # token up to 3 versions stale weighed against its own version's logprob; nothing dropped).
    for m in metrics:
        assert m["mismatch/kl"] < 1e-10 and abs(m["mismatch/ratio_max"] - 1) < 1e-5 and \
            m["mismatch/masked_fraction"] == 0, m
    for step, step_rows in trained.items():
        for row in step_rows:
            assert set(row["token_policy_versions"]) <= {max(0, step - 4), max(0, step - 3)}, (step, row)
    assert any(len(set(row["token_policy_versions"])) == 2 for row in trained[4])  # carried across versions 0 and 1
    rows = [row for step_rows in trained.values() for row in step_rows]
    ledger = Counter((row["example_id"], row["drawn_at_step"]) for row in rows)
    assert len(ledger) == 16 and set(ledger.values()) == {8}  # each group drawn once, trained once and whole
    assert metrics[-1]["partial/carried_samples"] == 0


# --- the stage itself, on the embedded sampler, without a flow ----------------------------------------------------

def _stage_config(tiny_model_dir, settings: dict | None = None, **partial) -> RlConfig:
    from rollout_lib.plan_checks import validate_config

    return validate_config(RlConfig, {
        "run": {"name": "partial", "seed": 3, "store": "memory://unused"},
        "algorithm": {"rl": {
            **(settings or {}),
            "base_model": str(tiny_model_dir), "max_seq_len": 96, "optimizer": {"lr": 1e-2},
            "budget": {"max_steps": 3}, "max_off_policy_steps": 1, "partial_rollouts": {"token_budget": 3, **partial},
            "envs": [{"name": "words",
                      "source": {"type": "jsonl_path", "path": str(ROOT / "data/rl-tiny-prompts.jsonl")},
                      "prompts_per_step": 2, "sampling": {"group_size": 2, "max_tokens": 8},
                      "algo": {"type": "grpo"}, "rewards": [{"function": "target_length", "kwargs": {"target": 4}}]}],
        }},
    })


def test_a_stage_carries_draws_around_what_is_in_flight_is_deterministic_and_the_bound_and_the_last_step_finish_all(
        tiny_model_dir):
    from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model
    from rollout_lib.rl.partial import PartialStage, sample_partial
    from rollout_lib.rl.prompts import load_prompts
    from rollout_lib.sampling.base import stop_token_ids
    from rollout_lib.sampling.hf import HfSampler, HfSamplerSettings

    resolved = resolve_model(str(tiny_model_dir))
    model, tokenizer = load_causal_lm(resolved), load_tokenizer(resolved)
    stops = set(stop_token_ids(tokenizer, model.generation_config))
    sampler = {"words": HfSampler(HfSamplerSettings(), model.eval(), tokenizer)}
    cfg = _stage_config(tiny_model_dir)
    prompts = {"words": load_prompts(cfg.settings.envs[0])}

    def stage(config, step, carried, final=False):
        return sample_partial(config, sampler, prompts, PartialStage.of(config, step, f"state-{step}", final), carried)

    rollouts, carry, metrics = stage(cfg, 1, None)
    assert carry is not None and metrics["partial/carried_groups"] >= 1  # 8 tokens at most, 3 per version
    assert stage(cfg, 1, None)[0].equals(rollouts) and stage(cfg, 1, None)[1].equals(carry)  # content, not timing
    in_flight = set(carry.column("example_id").to_pylist())
    second, carry2, _ = stage(cfg, 2, carry)
    fresh = {row["example_id"] for row in [*second.to_pylist(), *(carry2.to_pylist() if carry2 else [])]
             if row["drawn_at_step"] == 2}
    assert len(fresh) == 2 and not fresh & in_flight  # step 2 draws around the prompts in flight
    drained, none_left, drained_metrics = stage(cfg, 3, carry2, final=True)
    assert none_left is None and drained_metrics["partial/carried_samples"] == 0
    # the last step drains: every sample it trains has ended (max_tokens, or a stop token)
    assert all(len(row["completion_ids"]) == 8 or row["completion_ids"][-1] in stops for row in drained.to_pylist())
    drawn = Counter((row["example_id"], row["drawn_at_step"])
                    for table in (rollouts, second, drained) for row in table.to_pylist())
    assert len(drawn) == 6 and set(drawn.values()) == {2}  # 3 steps x 2 prompts, each group once and whole

    # max_staleness = k: past the first steps (which all sample version 0, so a carry there stays within the
    # bound), nothing is carried: every group runs to its end in the stage that draws it.
    strict = _stage_config(tiny_model_dir, max_staleness=1)
    table, nothing, strict_metrics = stage(strict, 3, None)
    assert nothing is None and table.num_rows == 4 and strict_metrics["partial/forced_groups"] == 2


# --- a mismatch correction over tokens of several versions ---------------------------------------------------------

CAP = 2.0


def test_a_correction_weighs_each_token_against_the_trainers_logprob_under_the_version_that_drew_it(tiny_model_dir):
    """TIS at C = 2 with partial rollouts: a stage scores the tokens it drew with the trainer's forward under its
    version (`behaviour_logprobs`, here on the embedded sampler too, since a correction is set); a sample carried
    from version 0 to version 1 has each token's π_old from its own version. With the sampler's report altered as a
    disagreeing engine's would be, through stamping, packing and the loss (at π_θ = π_old, ratio 1), each rl token's
    gradient is -A_t · min(exp(π_old_t - report_t), C) / N_rl."""
    import copy

    from rollout_lib.losses import component_loss, count_component_tokens
    from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model
    from rollout_lib.packing import collate_micro_batch
    from rollout_lib.rl.advantages import training_samples
    from rollout_lib.rl.behaviour import ForwardInputs, chunk_logprobs
    from rollout_lib.rl.pack import pack
    from rollout_lib.rl.partial import PartialStage, sample_partial
    from rollout_lib.rl.prompts import load_prompts
    from rollout_lib.sampling.hf import HfSampler, HfSamplerSettings
    import pyarrow as pa
    import torch

    resolved = resolve_model(str(tiny_model_dir))
    tokenizer = load_tokenizer(resolved)
    versions = [load_causal_lm(resolved).eval()]
    versions.append(copy.deepcopy(versions[0]))
    with torch.no_grad():  # version 1: another policy, so that a token's version decides its π_old
        generator = torch.Generator().manual_seed(1)
        for parameter in versions[1].parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    cfg = _stage_config(tiny_model_dir, {"loss": {"correction": {"type": "tis", "cap": CAP}},
                                         "micro_batch_tokens": 2048})
    prompts = {"words": load_prompts(cfg.settings.envs[0])}

    def stage(step, version, carried, final=False):
        sampler = {"words": HfSampler(HfSamplerSettings(), versions[version], tokenizer)}
        return sample_partial(cfg, sampler, prompts, PartialStage.of(cfg, step, f"state-{step}", final), carried)

    first, carry, _ = stage(1, 0, None)  # version 0 draws 3 tokens per request; most are carried
    assert carry is not None
    scored, none_left, metrics = stage(3, 1, carry, final=True)  # version 1 (k = 1) finishes them all
    assert none_left is None
    scored = pa.concat_tables([first, scored])
    rows = scored.to_pylist()
    spanning = [row for row in rows if set(row["token_policy_versions"]) == {0, 1}]
    assert spanning
    # π_old per token is the drawing version's: each version's forward of the whole sample, at its own tokens.
    for row in spanning:
        ids = row["prompt_ids"] + row["completion_ids"]
        forward = [chunk_logprobs(model, [ForwardInputs(ids, [True] * len(ids), [1.0] * len(ids))])[0]
                   [len(row["prompt_ids"]):] for model in versions]
        expected = [forward[version][t] for t, version in enumerate(row["token_policy_versions"])]
        assert row["behaviour_logprobs"] == pytest.approx(expected, abs=1e-5)
        assert row["behaviour_logprobs"] != pytest.approx(forward[0][:len(expected)], abs=1e-3)  # not one version's
    # The embedded sampler's own report is the trainer's forward within fp32 rounding (9.5e-7 measured): w = 1.
    assert metrics["behaviour/sampler_diff_max"] < 1e-5 and metrics["behaviour/sampler_over_cap_fraction"] == 0

    # An engine that disagrees: every third token 1.5 nats under-rated (w ≈ 4.5, cut at C), the others 0.3 over.
    reported = [[value - 1.5 if t % 3 == 0 else value + 0.3 for t, value in enumerate(row["sampling_logprobs"])]
                for row in rows]
    rewards = [float(row["group_index"] % 2) for row in rows]  # each group of 2: one right, one wrong
    for name, values in (("sampling_logprobs", reported), ("reward", rewards)):
        index = scored.schema.get_field_index(name)
        scored = scored.set_column(index, scored.schema.field(index), pa.array(values, scored.schema.field(index).type))
    samples, _ = training_samples(cfg, scored)
    # A rollout no stage scored (never so when a correction is set) would be weighed against the step's own forward.
    index = scored.schema.get_field_index("behaviour_logprobs")
    field = scored.schema.field(index)
    unscored = scored.set_column(index, field, pa.nulls(scored.num_rows, field.type))
    with pytest.raises(ValueError, match=r"loss.correction with partial_rollouts: \d+ rollouts .* carry no trainer"):
        training_samples(cfg, unscored)
    for sample, row, report in zip(samples.to_pylist(), rows, scored.column("sampling_logprobs").to_pylist()):
        start, end = len(row["prompt_ids"]), len(row["prompt_ids"]) + len(report)
        assert sample["sampler_logprobs"][start:end] == pytest.approx(report, abs=0)
        assert sample["inference_logprobs"][start:end] == pytest.approx(row["behaviour_logprobs"], abs=0)
    micro_batches, _ = pack(cfg, samples)
    assert micro_batches.num_rows == 1
    batch = collate_micro_batch(micro_batches.to_pylist()[0], packed=True, pad_token_id=tokenizer.pad_token_id or 0)
    logprobs = batch["inference_logprobs"].clone().requires_grad_()  # π_θ = π_old: ratio 1, inside the trust region
    loss, step = component_loss(logprobs, batch, count_component_tokens(batch), **cfg.settings.loss_kwargs())
    loss.backward()
    rl = batch["loss_mask"] & (batch["rl_weights"] != 0)
    w = torch.exp(batch["inference_logprobs"] - batch["sampler_logprobs"])[rl]
    advantages = batch["advantages"][rl]
    assert int((advantages != 0).sum()) > 20
    assert (-logprobs.grad[rl] * int(rl.sum())).tolist() == pytest.approx((advantages * w.clamp(max=CAP)).tolist(),
                                                                           rel=1e-5, abs=1e-7)
    assert 0.25 < step["mismatch/clipped_fraction"] < 0.45
    assert step["mismatch/clipped_fraction"] == pytest.approx(float((w > CAP).float().mean()))
    assert step["mismatch/ratio_max"] == pytest.approx(float(w.max()), rel=1e-5)
