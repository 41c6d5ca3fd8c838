"""Mismatch correction off-policy (issue 43): with `behaviour_logprobs = "trainer"` the sampler's logprobs travel as
a stream of their own (`sampler_logprobs`) beside the trainer's recompute, so at k >= 1 the trust region is
against π_old = the recompute under the weights that sampled and each rl token is reweighted by
w_t = exp(recompute_t - sampler_t), truncated. Through the real path: stamping, the recompute, packing, the loss;
and a k = 1 run of the flow, whose embedded fp32 sampler leaves nothing for TIS to correct."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from test_off_policy import rl_tiny, sampled_step, words_config

from rollout_lib.losses import component_loss, count_component_tokens
from rollout_lib.packing import collate_micro_batch, token_logprobs
from rollout_lib.rl.advantages import algorithm_resources, training_samples
from rollout_lib.rl.pack import pack
from rollout_lib.wire import SAMPLER_LOGPROBS

CAP = 2.0
TIS = {"correction": {"type": "tis", "cap": CAP}}
ONE_MICRO_BATCH = 1024  # tokens: the step's 12 samples in one micro-batch, whose rl tokens are then the step's


def _under_rated(scored: pa.Table) -> pa.Table:
    """`scored` as an engine that disagrees with the trainer would report it: every third completion token 1.5
    nats less likely than the sampler said (w = e^1.5 ≈ 4.5, above the cap), the others 0.3 more (w ≈ 0.74)."""
    reported = [[value - 1.5 if position % 3 == 0 else value + 0.3 for position, value in enumerate(row)]
                for row in scored.column("sampling_logprobs").to_pylist()]
    index = scored.schema.get_field_index("sampling_logprobs")
    return scored.set_column(index, scored.schema.field(index), pa.array(reported, scored.schema.field(index).type))


def test_off_policy_tis_weighs_each_token_by_the_recompute_over_the_sampler_truncated(tiny_model_dir):
    """k = 1, behaviour "trainer", TIS at C = 2: the samples keep the engine's report as `sampler_logprobs` and the
    recompute as `inference_logprobs`; packed and trained, each rl token's gradient is -A_t · min(w_t, C) / N_rl
    with w_t = exp(recompute_t - sampler_t) (the ratio against π_old is 1 at the sampling state)."""
    cfg = words_config(tiny_model_dir, behaviour_logprobs="trainer", max_off_policy_steps=1, loss=TIS,
                       micro_batch_tokens=ONE_MICRO_BATCH)
    with sampled_step(cfg, "memory://mismatch-off-policy", frozen_rows=()) as (policy, scored, reference):
        engine = _under_rated(scored)
        samples, metrics = training_samples(cfg, engine, algorithm_resources(cfg, policy=reference))
        honest, _ = training_samples(cfg, scored, algorithm_resources(cfg, policy=reference))
        micro_batches, _ = pack(cfg, samples)
        batch = collate_micro_batch(micro_batches.to_pylist()[0], packed=True,
                                    pad_token_id=policy.tokenizer.pad_token_id)
        logprobs = token_logprobs(policy.model.eval(), batch).detach().requires_grad_()
    assert metrics["behaviour/recomputed"] == scored.num_rows
    assert micro_batches.num_rows == 1

    # On the wire: the recompute does not depend on what the engine reported; the report is kept beside it.
    assert samples.column("inference_logprobs").equals(honest.column("inference_logprobs"))
    for sample, rollout in zip(samples.to_pylist(), engine.to_pylist()):
        offset = len(rollout["prompt_ids"])
        completion = sample[SAMPLER_LOGPROBS][offset:offset + len(rollout["sampling_logprobs"])]
        assert completion == pytest.approx(rollout["sampling_logprobs"], abs=0)

    loss_kwargs = cfg.settings.loss_kwargs()
    loss, step = component_loss(logprobs, batch, count_component_tokens(batch), **loss_kwargs)
    loss.backward()
    rl = batch["loss_mask"] & (batch["rl_weights"] != 0)
    w = torch.exp(batch["inference_logprobs"] - batch[SAMPLER_LOGPROBS])[rl]
    expected = w.clamp(max=CAP)
    advantages = batch["advantages"][rl]
    signal = advantages != 0
    assert int(signal.sum()) > 10
    factors = -logprobs.grad[rl] * int(rl.sum()) / advantages
    assert factors[signal] == pytest.approx(expected[signal].tolist(), rel=2e-3)
    # Both sides of the cap are hit: 1/3 of the tokens truncated at C, the rest weighted ~0.74.
    assert step["mismatch/clipped_fraction"] == pytest.approx(float((w > CAP).float().mean()))
    assert 0.25 < step["mismatch/clipped_fraction"] < 0.45
    assert step["mismatch/ratio_max"] == pytest.approx(float(w.max()), rel=1e-5)
    assert step["mismatch/kl"] == pytest.approx(float((w - 1 - torch.log(w)).mean()), rel=1e-4)
    assert step["mismatch/masked_fraction"] == 0.0
    # The recompute's own diagnostics, there with or without a correction, foretell what TIS at its default cap
    # (2, the one set here) cut, and what ICEPOP's default band [0.5, 2] would drop (the same tokens: none under 0.5).
    assert metrics["behaviour/sampler_over_cap_fraction"] == pytest.approx(step["mismatch/clipped_fraction"])
    assert metrics["behaviour/sampler_outside_band_fraction"] == metrics["behaviour/sampler_over_cap_fraction"]
    assert metrics["behaviour/sampler_ratio_max"] == pytest.approx(step["mismatch/ratio_max"], rel=1e-5)
    assert metrics["behaviour/sampler_kl"] == pytest.approx(step["mismatch/kl"], rel=1e-4)


def test_the_training_forward_keeps_the_samplers_stream_and_corrects_as_the_sampler_path_does(tiny_model_dir):
    """k = 0: with behaviour "training_forward" (the engine's default there) the sampler's report is kept beside the
    NaN behaviour stream, and TIS trains the same loss as with behaviour "sampler" (π_old: this forward's)."""
    configs = {mode: words_config(tiny_model_dir, behaviour_logprobs=mode, loss=TIS, micro_batch_tokens=ONE_MICRO_BATCH)
               for mode in ("sampler", "training_forward")}
    with sampled_step(configs["sampler"], "memory://mismatch-training-forward", frozen_rows=()) as \
            (policy, scored, reference):
        engine = _under_rated(scored)
        losses = {}
        for mode, cfg in configs.items():
            samples, _ = training_samples(cfg, engine, algorithm_resources(cfg, policy=reference))
            micro_batches, _ = pack(cfg, samples)
            batch = collate_micro_batch(micro_batches.to_pylist()[0], packed=True,
                                        pad_token_id=policy.tokenizer.pad_token_id)
            logprobs = token_logprobs(policy.model.eval(), batch).detach()
            assert micro_batches.num_rows == 1
            losses[mode] = component_loss(logprobs, batch, count_component_tokens(batch), **cfg.settings.loss_kwargs())
            if mode == "training_forward":
                assert SAMPLER_LOGPROBS in batch and torch.isnan(batch["inference_logprobs"][batch["loss_mask"]]).all()
            else:
                assert SAMPLER_LOGPROBS not in batch  # k = 0 "sampler": the micro-batch as before the stream
    (sampler_loss, sampler_metrics), (forward_loss, forward_metrics) = losses["sampler"], losses["training_forward"]
    assert forward_loss.item() == sampler_loss.item()
    assert sampler_metrics["mismatch/clipped_fraction"] > 0.25
    assert {k: v for k, v in forward_metrics.items() if k.startswith("mismatch/")} == \
        {k: v for k, v in sampler_metrics.items() if k.startswith("mismatch/")}


def test_without_a_correction_nothing_new_goes_on_the_wire(tiny_model_dir):
    """k = 1 without a correction: no sampler stream in the samples nor in the micro-batches (null), so a run
    trains the bits it trained before the stream existed; a table stored before the column reads back as null."""
    from rollout_lib import wire

    cfg = words_config(tiny_model_dir, behaviour_logprobs="trainer", max_off_policy_steps=1)
    with sampled_step(cfg, "memory://mismatch-none", frozen_rows=()) as (_, scored, reference):
        samples, _ = training_samples(cfg, scored, algorithm_resources(cfg, policy=reference))
    assert samples.column(SAMPLER_LOGPROBS).null_count == samples.num_rows
    micro_batches, _ = pack(cfg, samples)
    assert micro_batches.column(SAMPLER_LOGPROBS).null_count == micro_batches.num_rows
    older = samples.drop_columns([SAMPLER_LOGPROBS])
    assert wire.conform(older, wire.TRAINING_SAMPLES).equals(samples)
    with pytest.raises(ValueError, match="missing column"):  # any other column is still required
        wire.conform(samples.drop_columns(["advantages"]), wire.TRAINING_SAMPLES)


def test_a_micro_batch_packs_the_sampler_stream_with_nan_for_the_samples_without_it(tiny_model_dir):
    cfg = words_config(tiny_model_dir, behaviour_logprobs="trainer", max_off_policy_steps=1, loss=TIS)
    with sampled_step(cfg, "memory://mismatch-frozen-row", frozen_rows=(2,)) as (_, scored, reference):
        samples, _ = training_samples(cfg, scored, algorithm_resources(cfg, policy=reference))
    kept = samples.column(SAMPLER_LOGPROBS).to_pylist()
    assert kept[2] is None and all(row is not None for index, row in enumerate(kept) if index != 2)
    for share in (True, False):
        micro_batches, _ = pack(words_config(tiny_model_dir, behaviour_logprobs="trainer", max_off_policy_steps=1,
                                             loss=TIS, share_prompt_prefix=share), samples)
        for row in micro_batches.to_pylist():
            assert len(row[SAMPLER_LOGPROBS]) == len(row["input_ids"])
            nan = [math.isnan(value) for value in row[SAMPLER_LOGPROBS]]
            frozen = scored.column("sample_id")[2].as_py()
            assert any(nan) == (frozen in row["sample_ids"])


# --- the flow -----------------------------------------------------------------------------------------------------

K1 = ["train", "rl", "--config", "configs/rl-tiny.toml", "--max-steps", "3", "--set",
      "algorithm.rl.checkpoint_interval=3", "--set", "algorithm.rl.max_off_policy_steps=1"]
TIS_SET = ["--set", f'algorithm.rl.loss.correction={{ type = "tis", cap = {CAP} }}']


def test_k1_tis_on_the_embedded_fp32_sampler_changes_nothing_measurable(prefect_server, tmp_path):
    """k = 1, behaviour "trainer" + TIS, the embedded fp32 sampler: every step reports the mismatch diagnostics,
    its KL at float rounding (~1e-13) and no weight near the cap, and the run ends on the weights of the run
    without a correction (Adam's steps agree to float rounding); its identity is another (the correction enters
    it), and the rerun of the same command returns the same checkpoint."""
    from clirun import train_in_process

    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.store import ObjectStore

    plain = train_in_process(*K1, "--store", str(tmp_path / "plain"), "--name", "k1")
    corrected = train_in_process(*K1, *TIS_SET, "--store", str(tmp_path / "tis"), "--name", "k1")
    again = train_in_process(*K1, *TIS_SET, "--store", str(tmp_path / "tis"), "--name", "k1")
    assert again["checkpoint"] == corrected["checkpoint"] != plain["checkpoint"]

    store = ObjectStore(str(tmp_path / "tis"))
    steps = read_metrics(store, "k1")
    assert [m["off_policy_lag"] for m in steps] == [0, 1, 1]
    assert [m["staleness_mean"] for m in steps] == [0, 1, 1]
    for m in steps:
        assert m["mismatch/kl"] < 1e-10 and abs(m["mismatch/ratio_max"] - 1) < 1e-5, m
        assert m["mismatch/clipped_fraction"] == 0 and m["mismatch/masked_fraction"] == 0
        assert m["behaviour/sampler_kl"] < 1e-10
    assert not any(name.startswith("mismatch/") for name in read_metrics(ObjectStore(str(tmp_path / "plain")), "k1")[0])
    assert corrected["reward_curve"] == plain["reward_curve"]
    # Per step the same loss and gradient to float rounding ...
    for mine, theirs in zip(steps, read_metrics(ObjectStore(str(tmp_path / "plain")), "k1")):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-7)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    # ... and the weights: the two runs apart by a tiny fraction of how far training moved them (AdamW's
    # normalised step turns rounding in a near-zero gradient into up to lr, so not elementwise).
    from rollout_lib.config.common import ModelRef
    from rollout_lib.model.loading import load_causal_lm, resolve_model

    initial = load_causal_lm(resolve_model(ModelRef(uri="tiny:qwen2"))).state_dict()
    weights = [ObjectStore(str(tmp_path / name)).get_tensors(ObjectStore(str(tmp_path / name))
                                                             .get_json(result["checkpoint"])["weights"])
               for name, result in (("plain", plain), ("tis", corrected))]
    apart = math.sqrt(sum(float((tensor - weights[1][name]).square().sum()) for name, tensor in weights[0].items()))
    moved = math.sqrt(sum(float((tensor - initial[name]).square().sum()) for name, tensor in weights[0].items()))
    assert moved > 0.1 and apart < 1e-4 * moved  # measured 1.0e-4 against 6.6


@pytest.mark.slow
def test_k1_tis_a_kill_mid_training_reruns_to_the_same_checkpoint(prefect_server, tmp_path):
    """The corrected run is as exact as the uncorrected: SIGKILLed after step 2 packed, the rerun ends on the
    uninterrupted run's checkpoint (the sampler stream is the embedded sampler's, computed again bit for bit; on
    the engine it would be the rerun's report, which only the correction's weights read)."""
    from clirun import final_result, run_rollout, run_until_then_kill, train_in_process

    args = [*K1, *TIS_SET]
    expected = train_in_process(*args, "--store", str(tmp_path / "uninterrupted"), "--name", "k1")
    interrupted = [*args, "--store", str(tmp_path / "interrupted")]
    run_until_then_kill(interrupted, "pack-step-2' - Finished", tmp_path / "killed.log")
    rerun = run_rollout(*interrupted)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert final_result(rerun)["checkpoint"] == expected["checkpoint"]


def test_the_correction_enters_the_identity_only_when_set(tmp_path):
    from rollout_lib.identity.training import training_identity

    base = rl_tiny(tmp_path, "algorithm.rl.max_off_policy_steps=1")
    none = rl_tiny(tmp_path, "algorithm.rl.max_off_policy_steps=1", 'algorithm.rl.loss.correction={ type = "none" }')
    tis = rl_tiny(tmp_path, "algorithm.rl.max_off_policy_steps=1", 'algorithm.rl.loss.correction={ type = "tis" }')
    assert training_identity(none) == training_identity(base) != training_identity(tis)
