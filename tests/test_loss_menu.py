"""The rl loss menu (issue 43): GSPO, CISPO, the Dr. GRPO normaliser, the ratio cap, the finite-gradient guard, and
their settings (registry, bad input, identity). Hand computations on small tensors; one tiny end-to-end run (slow)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rollout_lib.identity.training import training_settings
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.losses import component_loss, count_component_tokens, count_rl_sequences, rl_loss_terms
from rollout_lib.rl_losses import RL_LOSSES, build_rl_loss
from rollout_lib.rl_losses.cispo import CispoSettings
from rollout_lib.rl_losses.gspo import GspoSettings

ROOT = Path(__file__).resolve().parent.parent


def rl_streams(lengths: list[int], rl: list[int], advantages: list[float], inference: list[float]) -> dict:
    """Flat per-token streams of one packed micro-batch (as packing.collate_micro_batch gives them)."""
    n = sum(lengths)
    return {"loss_mask": torch.tensor(rl, dtype=torch.bool), "rl_weights": torch.tensor(rl, dtype=torch.float32),
            "advantages": torch.tensor(advantages), "inference_logprobs": torch.tensor(inference),
            "ce_weights": torch.zeros(n), "ref_kl_weights": torch.zeros(n), "ref_logprobs": torch.zeros(n),
            "sequence_lengths": torch.tensor(lengths)}


def rl_config(*overrides: str) -> RlConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(RlConfig, ROOT / "configs/rl-tiny.toml", list(overrides))


# --- GSPO ---------------------------------------------------------------------------------------------------------


def test_gspo_ratio_and_clip_are_per_sequence_over_a_packed_batch():
    # Two packed sequences: A = [prompt, a1, a2] (A = +1), B = [prompt, b1, b2, b3] (A = +2). The prompt tokens carry
    # no rl weight, so their (wild) logprob gap must not enter the sequence ratio.
    lengths, rl = [3, 4], [0, 1, 1, 0, 1, 1, 1]
    advantages = [0.0, 1.0, 1.0, 0.0, 2.0, 2.0, 2.0]
    inference = [-9.0, -1.0, -2.0, -9.0, -1.0, -1.0, -1.0]
    # A's log ratios +0.02, -0.04 (mean -0.01: s_A inside [0.9, 1.1]); B's +0.3, +0.3, 0.0 (mean 0.2: s_B = e^0.2,
    # above 1 + eps_high with A > 0: the whole sequence is clipped).
    logprobs = torch.tensor([0.0, -0.98, -2.04, 0.0, -0.7, -0.7, -1.0], requires_grad=True)
    streams = rl_streams(lengths, rl, advantages, inference)
    loss_fn = build_rl_loss(GspoSettings(type="gspo", eps_low=0.1, eps_high=0.1))
    loss, metrics = component_loss(logprobs, streams, count_component_tokens(streams), rl_loss=loss_fn)
    loss.backward()

    s_a = math.exp(-0.01)
    n_rl = 5
    assert loss.item() == pytest.approx((-2 * s_a * 1.0 - 3 * 1.1 * 2.0) / n_rl, rel=1e-5)
    # ∂/∂logp_t of -|y_A| · s_A · A over N_rl, with ∂s_A/∂logp_t = s_A / |y_A|: -s_A · A / N_rl on each A token.
    expected = [0.0, -s_a / n_rl, -s_a / n_rl, 0.0, 0.0, 0.0, 0.0]
    assert logprobs.grad.tolist() == pytest.approx(expected, abs=1e-6)
    assert metrics["rl/clipped_fraction"] == pytest.approx(3 / 5)
    assert metrics["rl/sequence_ratio_mean"] == pytest.approx((2 * s_a + 3 * math.exp(0.2)) / 5, rel=1e-5)


def test_gspo_negative_advantage_clips_low_and_keeps_a_ratio_that_moved_up():
    # A < 0: a sequence whose ratio fell below 1 - eps_low is clipped (no gradient); one whose ratio rose keeps the
    # unclipped s · A (the min picks it), so its gradient pulls it back down.
    lengths, rl = [2, 2], [0, 1, 0, 1]
    streams = rl_streams(lengths, rl, [0.0, -1.0, 0.0, -1.0], [0.0, -1.0, 0.0, -1.0])
    logprobs = torch.tensor([0.0, -1.5, 0.0, -0.5], requires_grad=True)  # s = e^-0.5 (low), e^0.5 (high)
    loss_fn = build_rl_loss(GspoSettings(type="gspo", eps_low=0.1, eps_high=0.1))
    loss, _ = component_loss(logprobs, streams, count_component_tokens(streams), rl_loss=loss_fn)
    loss.backward()
    assert loss.item() == pytest.approx((0.9 * 1.0 + math.exp(0.5) * 1.0) / 2, rel=1e-5)
    assert logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, math.exp(0.5) / 2], abs=1e-6)


def test_gspo_on_policy_is_the_token_level_policy_gradient_and_needs_sequences():
    streams = rl_streams([3], [0, 1, 1], [0.0, 0.5, 0.5], [float("nan")] * 3)  # NaN: the training forward's own
    logprobs = torch.tensor([0.0, -1.0, -2.0], requires_grad=True)
    loss_fn = build_rl_loss(GspoSettings(type="gspo"))
    loss, _ = component_loss(logprobs, streams, count_component_tokens(streams), rl_loss=loss_fn)
    loss.backward()
    assert loss.item() == pytest.approx(-0.5) and logprobs.grad.tolist() == pytest.approx([0.0, -0.25, -0.25])
    without = {key: value for key, value in streams.items() if key != "sequence_lengths"}
    with pytest.raises(ValueError, match="gspo needs each token's sequence"):
        component_loss(logprobs, without, count_component_tokens(without), rl_loss=loss_fn)


# --- CISPO --------------------------------------------------------------------------------------------------------


def test_cispo_keeps_every_token_and_scales_a_clipped_one_by_the_clipped_weight():
    # Ratios e^0.5 (above 1 + eps_high = 1.28), e^-0.1 (inside), e^-2 (far below: no lower bound by default).
    streams = rl_streams([4], [0, 1, 1, 1], [0.0, 1.0, 1.0, -1.0], [0.0, -1.0, -1.0, -1.0])
    logprobs = torch.tensor([0.0, -0.5, -1.1, -3.0], requires_grad=True)
    loss_fn = build_rl_loss(CispoSettings(type="cispo"))
    loss, metrics = component_loss(logprobs, streams, count_component_tokens(streams), rl_loss=loss_fn)
    loss.backward()
    weights = [1.28, math.exp(-0.1), math.exp(-2.0)]
    advantage, token_logprobs = [1.0, 1.0, -1.0], [-0.5, -1.1, -3.0]
    assert loss.item() == pytest.approx(-sum(w * a * lp for w, a, lp in zip(weights, advantage, token_logprobs)) / 3,
                                        rel=1e-5)
    # Every token has gradient -ŵ_t · A_t / N_rl: the clipped one too, at weight 1.28 (DPPO/PPO would drop it).
    assert logprobs.grad.tolist() == pytest.approx([0.0, *(-w * a / 3 for w, a in zip(weights, advantage))],
                                                   abs=1e-6)
    assert metrics["rl/clipped_fraction"] == pytest.approx(1 / 3)
    # A lower bound, when set, lifts the far-below token's weight to 1 - eps_low.
    logprobs.grad = None
    bounded = build_rl_loss(CispoSettings(type="cispo", eps_low=0.5))
    loss, _ = component_loss(logprobs, streams, count_component_tokens(streams), rl_loss=bounded)
    loss.backward()
    assert logprobs.grad[3].item() == pytest.approx(0.5 / 3, abs=1e-6)


# --- the ratio cap ------------------------------------------------------------------------------------------------


def test_max_ratio_caps_the_default_losss_ratio_without_gradient_and_reports_only_when_set():
    logprobs = torch.tensor([-0.1, -1.0], requires_grad=True)
    inference = torch.tensor([-5.0, -1.0])  # ratio e^4.9 on the first token (a stale behaviour logprob), 1 next
    advantages, weights = torch.tensor([-1.0, -1.0]), torch.ones(2)
    numerator, metrics = rl_loss_terms(logprobs, inference, advantages, weights, kl_coef=0.0, eps_low=1.0,
                                       max_ratio=10.0)
    numerator.backward()
    assert numerator.item() == pytest.approx(10.0 + 1.0) and metrics["capped_fraction"] == 0.5
    assert logprobs.grad.tolist() == pytest.approx([0.0, 1.0])  # the capped token carries no gradient
    _, uncapped = rl_loss_terms(logprobs.detach(), inference, advantages, weights)
    assert "capped_fraction" not in uncapped  # the default's metrics, in checkpoint manifests, are as before


# --- Dr. GRPO: a constant normaliser ------------------------------------------------------------------------------


def test_a_constant_normaliser_divides_by_c_times_sequences_and_removes_the_length_bias():
    def grad_of_first_token(lengths, rl, normalizer):
        n = sum(lengths)
        streams = rl_streams(lengths, rl, [1.0] * n, [float("nan")] * n)
        logprobs = torch.full((n,), -1.0, requires_grad=True)
        counts = {**count_component_tokens(streams), "rl_sequences": count_rl_sequences(streams)}
        loss, _ = component_loss(logprobs, streams, counts, rl_loss=build_rl_loss(GspoSettings(type="gspo")),
                                 rl_normalizer=normalizer)
        loss.backward()
        return logprobs.grad[1].item(), counts

    short, counts = grad_of_first_token([2, 2], [0, 1, 0, 1], 16.0)
    assert counts["rl_sequences"] == 2 and short == pytest.approx(-1 / (16 * 2))
    # The other sequence grows from 1 to 5 rl tokens: with the constant, this token's gradient is unchanged...
    longer, _ = grad_of_first_token([2, 6], [0, 1, 0, 1, 1, 1, 1, 1], 16.0)
    assert longer == pytest.approx(short)
    # ...with the step's token count it shrinks (1/2 -> 1/6): the length coupling Dr. GRPO removes.
    assert grad_of_first_token([2, 2], [0, 1, 0, 1], None)[0] == pytest.approx(-1 / 2)
    assert grad_of_first_token([2, 6], [0, 1, 0, 1, 1, 1, 1, 1], None)[0] == pytest.approx(-1 / 6)


def test_a_constant_normaliser_gives_the_same_gradient_on_one_rank_or_two():
    """Data parallelism's arithmetic (trainer/causal.py): each rank trains its micro-batches over the step-global
    counts (rl_sequences summed over the ranks like N_c); the summed rank gradients are the one-process gradient."""
    torch.manual_seed(0)
    batches = [rl_streams([3, 2], [0, 1, 1, 0, 1], [0.5, 0.5, 0.5, -1.0, -1.0], [-1.0] * 5),
               rl_streams([4], [0, 1, 1, 1], [2.0] * 4, [-1.2] * 4),
               rl_streams([2, 3], [0, 1, 0, 1, 1], [-0.5] * 5, [-0.8] * 5)]
    logprobs = [torch.randn(sum(b["sequence_lengths"].tolist())).clamp(max=-0.1) for b in batches]
    loss_fn = build_rl_loss(CispoSettings(type="cispo"))

    def gradients(shares: list[list[int]]) -> list[torch.Tensor]:
        counts = {c: sum(count_component_tokens(b)[c] for b in batches) for c in ("rl", "ce", "ref_kl")}
        # Each rank counts its own sequences; the step's count is their sum.
        counts["rl_sequences"] = sum(count_rl_sequences(*[batches[i] for i in share]) for share in shares)
        grads = [torch.zeros_like(lp) for lp in logprobs]
        for share in shares:
            for index in share:
                leaf = logprobs[index].clone().requires_grad_(True)
                loss, _ = component_loss(leaf, batches[index], counts, rl_loss=loss_fn, rl_normalizer=64.0)
                loss.backward()
                grads[index] += leaf.grad
        return grads

    one, two = gradients([[0, 1, 2]]), gradients([[0, 2], [1]])
    assert all(torch.allclose(a, b, atol=0, rtol=0) for a, b in zip(one, two))
    assert any(bool(g.abs().sum() > 0) for g in one)


# --- settings: registry, bad input, identity ----------------------------------------------------------------------


def test_every_built_in_loss_is_registered_and_named_in_the_unknown_type_error():
    assert {"default", "gspo", "cispo"} <= set(RL_LOSSES)
    with pytest.raises(ConfigError) as info:
        rl_config("algorithm.rl.loss.type=gpso")
    assert str(info.value).endswith("algorithm.rl.loss: `type` must be one of: cispo, custom, default, gspo")
    with pytest.raises(ConfigError, match=r"algorithm.rl.loss.eps_high: must be > 0"):
        rl_config("algorithm.rl.loss.type=gspo", "algorithm.rl.loss.eps_high=0")
    with pytest.raises(ConfigError, match=r"max_ratio \(1.1\) must be >= 1 \+ eps_high"):
        rl_config("algorithm.rl.loss.max_ratio=1.1")
    with pytest.raises(ConfigError, match="normalizer"):
        rl_config('algorithm.rl.loss.normalizer="sequences"')


def test_an_unknown_loss_type_exits_2_in_one_line_before_anything_runs(capsys):
    from rollout_cli.main import main

    capsys.readouterr()
    assert main(["train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run",
                 "--set", "algorithm.rl.loss.type=dr_gspo"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "algorithm.rl.loss: `type` must be one of: cispo, custom, default, gspo" in lines[0]


# The shipped configs' training hashes before the loss menu (main at 7ba6f27): none may move.
PINNED_HASHES = {
    "rl-tiny.toml": "b4d49ebfcbc68806bdd51f37ee3a80362e56cd21b75b4802f4f3995f78b30bda",
    "rl-smollm2.toml": "a34e6dcadc40d6736689a279c30b7d40afc1f48887cece1fe9ed3fa17579c90a",
    "rl-opd.toml": "c81052c762370c1ec1c93c4920ba5ca783da8196e83530119dd21926b973ca92",
}


def test_the_default_loss_keeps_every_identity_and_each_choice_enters_it():
    for name, expected in PINNED_HASHES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert training_hash(load_config(RlConfig, ROOT / "configs" / name, [])) == expected, name
    base = training_hash(rl_config())
    assert set(training_settings(rl_config())["loss"]) == {"eps_low", "eps_high", "kl_coef", "ref_kl_eps_low",
                                                            "ref_kl_kl_coef"}
    # Spelling the default, or changing what only decides whether a run stops, is the same training.
    for same in ("algorithm.rl.loss.type=default", "algorithm.rl.loss.max_nonfinite_steps=7"):
        assert training_hash(rl_config(same)) == base, same
    changed = [("algorithm.rl.loss.type=gspo",), ("algorithm.rl.loss.type=cispo",),
               ("algorithm.rl.loss.type=gspo", "algorithm.rl.loss.eps_high=0.001"),
               ("algorithm.rl.loss.max_ratio=10",), ("algorithm.rl.loss.normalizer={ constant = 512 }",)]
    hashes = {training_hash(rl_config(*overrides)) for overrides in changed}
    assert base not in hashes and len(hashes) == len(changed)


def test_loss_kwargs_build_the_registered_loss_and_the_normaliser():
    kwargs = rl_config("algorithm.rl.loss.type=gspo", "algorithm.rl.loss.normalizer={ constant = 512 }").settings \
        .loss_kwargs()
    assert kwargs["rl_loss"].type_name == "gspo" and kwargs["rl_normalizer"] == 512
    assert rl_config().settings.loss_kwargs()["rl_normalizer"] is None


# --- the finite-gradient guard ------------------------------------------------------------------------------------


def _micro_batches(inference: float) -> pa.Table:
    from rollout_lib import wire
    from rollout_lib.packing import pack_samples

    rows = [{"sample_id": f"s{i}", "env": "e", "input_ids": [1, 2, 3, 4 + i, 5], "loss_mask": [False, False, True,
             True, True], "advantages": [0.0, 0.0, 1.0 - i, 1.0 - i, 1.0 - i], "rl_weights": None,
             "ce_weights": None, "ref_kl_weights": None, "ref_logprobs": None,
             "inference_logprobs": [0.0, 0.0, -2.0, inference, -2.0], "temperatures": None} for i in range(2)]
    return pack_samples(pa.Table.from_pylist(rows, schema=wire.TRAINING_SAMPLES), max_seq_len=16)


def test_an_impossible_logprob_skips_the_step_and_the_third_in_a_row_fails_naming_step_and_tensor(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rollout_lib.store import ObjectStore
    from rollout_lib.trainer.base import NonFiniteLossError, TrainingInputs
    from rollout_lib.trainer.causal import CausalLmTrainer, RecordedBatches

    store = ObjectStore("memory://loss-menu-guard")
    batches = RecordedBatches(store)
    steps = {1: -2.0, 2: math.inf, 3: math.inf, 4: -2.0, 5: math.inf, 6: math.inf, 7: math.inf}
    for step, inference in steps.items():  # a behaviour logprob of +inf: probability e^inf, impossible
        batches.record(step, store.put_table(_micro_batches(inference)))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = rl_config("algorithm.rl.loss.max_nonfinite_steps=3")
    inputs = TrainingInputs(store=store, config=config, identity="test")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = CausalLmTrainer(inputs, model, type("T", (), {"pad_token_id": 0})(), optimizer, 0, None, {},
                              batches=batches)

    def weights() -> dict:
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    first = trainer.train_step(1)
    assert "skipped_nonfinite" not in first and math.isfinite(first["loss"])
    for step in (2, 3):  # skipped: the weights do not move, the step says so, its numbers stay finite
        before = weights()
        metrics = trainer.train_step(step)
        assert metrics["skipped_nonfinite"] == 1 and "nonfinite_tensor" not in metrics
        assert all(isinstance(v, str) or math.isfinite(v) for v in metrics.values())
        assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
        assert all(p.grad is None for p in model.parameters())
    assert "skipped_nonfinite" not in trainer.train_step(4)  # a finite step resets the count...
    trainer.train_step(5)
    trainer.train_step(6)
    before = weights()
    with pytest.raises(NonFiniteLossError) as info:  # ...so the third in a row is step 7
        trainer.train_step(7)
    message = str(info.value)
    assert "\n" not in message and message.startswith("step 7: 3 step(s) in a row with a non-finite loss")
    assert "first non-finite tensor: loss of micro-batch 0 (inf)" in message
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


def test_a_non_finite_gradient_is_named_by_its_parameter(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rollout_lib.trainer.causal import train_on_micro_batches

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    def poison(parameter: torch.nn.Parameter) -> None:
        parameter.grad.fill_(float("nan"))

    # A finite loss whose gradient is not: poison the final norm weight's accumulated gradient, and only its.
    model.model.norm.weight.register_post_accumulate_grad_hook(poison)
    metrics = train_on_micro_batches(model, torch.optim.SGD(model.parameters(), lr=0.1), _micro_batches(-2.0),
                                     packed=True, pad_token_id=0, max_grad_norm=1.0, skip_nonfinite=True)
    assert metrics["skipped_nonfinite"] == 1 and metrics["nonfinite_tensor"] == "gradient of model.norm.weight"


# --- end to end ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["gspo", "cispo"])
def test_rl_tiny_trains_two_steps_with_each_menu_loss(prefect_server, tmp_path, loss_type):
    from clirun import train_in_process  # the flow in this process: the loss is what is tested, not the CLI

    result = train_in_process("train", "rl", "--config", "configs/rl-tiny.toml", "--max-steps", "2",
                              "--set", f"algorithm.rl.loss.type={loss_type}",
                              "--set", "algorithm.rl.loss.normalizer={ constant = 16 }",
                              "--set", f"run.store={tmp_path / 'store'}", "--set", f"run.name=menu-{loss_type}")
    assert len(result["reward_curve"]) == 2 and result["checkpoint"]


@pytest.mark.slow
def test_gspo_with_a_constant_normaliser_trains_on_two_ranks_what_one_trains(tmp_path):
    """The numerator / (C · sequences) scheme through real data parallelism (2 torchrun ranks, gloo): rl_sequences
    is summed over the ranks like every N_c, so the step is the one-process step within float rounding."""
    from test_rl_data_parallel import assert_same_training, run_in_process

    menu = ("algorithm.rl.loss.type=gspo", "algorithm.rl.loss.normalizer={ constant = 16 }")
    one = run_in_process(str(tmp_path / "one"), 1, 2, *menu)
    two = run_in_process(str(tmp_path / "two"), 2, 2, *menu)
    assert all(m["micro_batches"] > 2 for m in one["history"])  # both ranks had real micro-batches
    assert_same_training(one, two)


@pytest.mark.slow
def test_a_run_records_a_skipped_step_and_goes_on(prefect_server, tmp_path, monkeypatch):
    """The guard through the flow: step 2's loss is made non-finite (as an impossible behaviour logprob makes it);
    the run skips it, records it, logs it and trains step 3."""
    from clirun import train_in_process

    import rollout_lib.trainer.causal as causal
    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.store import ObjectStore

    real_train, trained = causal.train_on_micro_batches, {"steps": 0}

    def counting_steps(*args, **kwargs):
        trained["steps"] += 1
        return real_train(*args, **kwargs)

    def poisoned_second_step(logprobs, streams, counts, **kwargs):
        loss, metrics = component_loss(logprobs, streams, counts, **kwargs)
        if trained["steps"] != 2:
            return loss, metrics
        return loss * math.inf, {**metrics, "loss/total": math.inf}

    monkeypatch.setattr(causal, "component_loss", poisoned_second_step)
    monkeypatch.setattr(causal, "train_on_micro_batches", counting_steps)
    store = str(tmp_path / "store")
    result = train_in_process("train", "rl", "--config", "configs/rl-tiny.toml", "--max-steps", "3",
                              "--set", f"run.store={store}", "--set", "run.name=guarded")
    steps = [record for record in read_metrics(ObjectStore(store), "guarded") if record["step"] > 0]
    assert [record.get("skipped_nonfinite") for record in steps] == [None, 1, None]
    # The skipped step keeps only its finite numbers (neither its loss nor its gradient norm was: the step's log
    # line says "skipped"); the others trained.
    assert "loss" not in steps[1] and "grad_norm" not in steps[1]
    assert all(record["grad_norm"] > 0 and math.isfinite(record["loss"]) for record in (steps[0], steps[2]))
    assert len(result["reward_curve"]) == 3
