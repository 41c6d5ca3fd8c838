"""Inference-training mismatch corrections (issue 43): token TIS, sequence TIS, MIS, ICEPOP on hand-made tensors
(value and gradient), their settings (bad input, identity), the step's `mismatch/*` diagnostics, and the embedded
fp32 sampler's logprobs agreeing with the trainer's to rounding."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from rollout_lib.identity.training import training_settings
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.losses import component_loss, count_component_tokens
from rollout_lib.rl_losses.correction import CorrectionSettings, MismatchCorrection, build_correction

ROOT = Path(__file__).resolve().parent.parent

# Two packed sequences, each [prompt, t1, t2], advantage +1 on every rl token. The sampler reports logprob -1 on
# every token; the trainer's (this forward, π_old) gives w_t = exp(logp_t + 1).
LENGTHS, RL = [3, 3], [0, 1, 1, 0, 1, 1]
W = [1.0, 1.5, 3.0, 1.0, 0.4, 1.2]  # the mismatch ratios; the prompt tokens' (1.0) are never read


def streams() -> dict:
    n = sum(LENGTHS)
    return {"loss_mask": torch.tensor(RL, dtype=torch.bool), "rl_weights": torch.tensor(RL, dtype=torch.float32),
            "advantages": torch.tensor([float(m) for m in RL]), "inference_logprobs": torch.full((n,), -1.0),
            "ce_weights": torch.zeros(n), "ref_kl_weights": torch.zeros(n), "ref_logprobs": torch.zeros(n),
            "sequence_lengths": torch.tensor(LENGTHS)}


def corrected(kind: str, **knobs) -> tuple[float, list[float], dict]:
    """(loss, d loss / d logp, metrics) of the default rl loss under correction `kind`."""
    logprobs = torch.tensor([math.log(w) - 1.0 for w in W], requires_grad=True)
    batch = streams()
    correction = build_correction(CorrectionSettings(type=kind, **knobs))
    loss, metrics = component_loss(logprobs, batch, count_component_tokens(batch), correction=correction)
    loss.backward()
    return loss.item(), logprobs.grad.tolist(), metrics


def expected_gradient(factors: list[float]) -> list[float]:
    # Ratio against π_old is 1 (value) with ∂r/∂logp = 1: each rl token's gradient is -A · factor / N_rl.
    n_rl = sum(RL)
    return [-member * factor / n_rl for member, factor in zip(RL, factors)]


def test_token_tis_truncates_each_token_weight_at_the_cap_without_gradient():
    loss, grad, metrics = corrected("tis", cap=2.0)
    factors = [0.0, 1.5, 2.0, 0.0, 0.4, 1.2]  # 3.0 truncated to C = 2
    assert loss == pytest.approx(-sum(factors) / 4, rel=1e-6)
    assert grad == pytest.approx(expected_gradient(factors), abs=1e-6)
    assert metrics["mismatch/clipped_fraction"] == 0.25 and metrics["mismatch/masked_fraction"] == 0.0
    assert metrics["mismatch/ratio_max"] == pytest.approx(3.0, rel=1e-6)
    k3 = sum(w - 1 - math.log(w) for w, member in zip(W, RL) if member) / 4
    assert metrics["mismatch/kl"] == pytest.approx(k3, rel=1e-5)


def test_sequence_tis_weighs_every_token_by_its_sequences_truncated_product():
    _, grad, metrics = corrected("seq_tis", cap=2.0)
    # Sequence 0: 1.5 · 3.0 = 4.5 -> truncated to 2; sequence 1: 0.4 · 1.2 = 0.48, kept.
    assert grad == pytest.approx(expected_gradient([0.0, 2.0, 2.0, 0.0, 0.48, 0.48]), abs=1e-6)
    assert metrics["mismatch/clipped_fraction"] == 0.5
    # A higher cap keeps the first product whole.
    _, grad, _ = corrected("seq_tis", cap=5.0)
    assert grad == pytest.approx(expected_gradient([0.0, 4.5, 4.5, 0.0, 0.48, 0.48]), abs=1e-6)


def test_mis_masks_tokens_above_the_cap_and_leaves_the_rest_unweighted():
    loss, grad, metrics = corrected("mis", cap=2.0)
    factors = [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert loss == pytest.approx(-3 / 4, rel=1e-6)  # a masked token still counts in N_rl
    assert grad == pytest.approx(expected_gradient(factors), abs=1e-6)
    assert metrics["mismatch/masked_fraction"] == 0.25 and metrics["mismatch/clipped_fraction"] == 0.0


def test_icepop_masks_tokens_outside_the_band_on_both_sides():
    _, grad, metrics = corrected("icepop", low=0.5, high=2.0)
    # 3.0 above high, 0.4 below low: both dropped.
    assert grad == pytest.approx(expected_gradient([0.0, 1.0, 0.0, 0.0, 0.0, 1.0]), abs=1e-6)
    assert metrics["mismatch/masked_fraction"] == 0.5


def test_none_leaves_the_loss_exactly_as_before():
    assert build_correction(CorrectionSettings()) is None
    logprobs = torch.tensor([math.log(w) - 1.0 for w in W])
    batch = streams()
    before, metrics = component_loss(logprobs, batch, count_component_tokens(batch))
    again, _ = component_loss(logprobs, batch, count_component_tokens(batch), correction=None)
    assert torch.equal(before, again) and not any(name.startswith("mismatch/") for name in metrics)
    # Without a correction the ratio is against the sampler's logprobs, with one against π_old: not the same loss.
    assert before.item() != pytest.approx(corrected("tis", cap=100.0)[0])


def test_seq_tis_needs_sequence_boundaries():
    correction = MismatchCorrection(CorrectionSettings(type="seq_tis"))
    with pytest.raises(ValueError, match="seq_tis needs each token's sequence"):
        correction.token_factors(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool))


# --- settings -----------------------------------------------------------------------------------------------------


def rl_config(*overrides: str) -> RlConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(RlConfig, ROOT / "configs/rl-tiny.toml", list(overrides))


def test_none_keeps_the_identity_and_each_correction_enters_it():
    base = training_hash(rl_config())
    assert training_hash(rl_config('algorithm.rl.loss.correction={ type = "none" }')) == base
    assert "correction" not in training_settings(rl_config())["loss"]
    assert "correction" not in rl_config().settings.loss_kwargs()
    kinds = ("tis", "seq_tis", "mis", "icepop")
    hashes = {training_hash(rl_config(f'algorithm.rl.loss.correction={{ type = "{kind}" }}')) for kind in kinds}
    assert base not in hashes and len(hashes) == len(kinds)
    kwargs = rl_config('algorithm.rl.loss.correction={ type = "tis", cap = 3.0 }').settings.loss_kwargs()
    assert kwargs["correction"].settings.cap == 3.0


def test_an_unknown_correction_exits_2_in_one_line_naming_the_valid_types(capsys):
    from rollout_cli.main import main

    capsys.readouterr()
    assert main(["train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run",
                 "--set", 'algorithm.rl.loss.correction={ type = "tiss" }']) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "unknown correction type 'tiss': one of none, tis, seq_tis, mis, icepop" in lines[0]


def test_a_correction_with_the_samplers_logprobs_as_behaviour_needs_k_0():
    tis = 'algorithm.rl.loss.correction={ type = "tis" }'
    assert rl_config(tis).settings.behaviour_logprobs_source == "sampler"  # embedded sampler, k = 0
    # Off-policy with the sampler's logprobs as π_old's stand-in: no stream holds the sampling state's π_old.
    with pytest.raises(ConfigError, match=r"loss\.correction 'tis' with behaviour_logprobs = \"sampler\" needs "
                                          r"max_off_policy_steps = 0 \(here k = 1\)"):
        rl_config(tis, "algorithm.rl.max_off_policy_steps=1", 'algorithm.rl.behaviour_logprobs="sampler"')
    # Partial rollouts: π_old is the trainer's logprob of each token under the version that drew it (rl/partial.py
    # scores every stage's tokens when a correction is set), "sampler" spelt or resolved.
    for spelt in ("auto", "sampler"):
        partial = rl_config(tis, "algorithm.rl.max_off_policy_steps=1", f'algorithm.rl.behaviour_logprobs="{spelt}"',
                            "algorithm.rl.partial_rollouts={ token_budget = 4 }")
        assert partial.settings.loss.correction.active and partial.settings.behaviour_logprobs_source == "sampler"
    # The trainer's recompute (any k) and the training forward (vllm at k = 0) keep the sampler's stream beside.
    for other in ('algorithm.rl.behaviour_logprobs="trainer"', "algorithm.rl.max_off_policy_steps=1",
                  'algorithm.rl.policy_sampler={ type = "vllm" }'):
        assert rl_config(tis, other).settings.loss.correction.active, other
    assert rl_config(tis, 'algorithm.rl.policy_sampler={ type = "vllm" }', 'algorithm.rl.behaviour_logprobs="sampler"')


def test_a_correction_on_a_frozen_models_rollouts_exits_2_at_plan_time(capsys):
    from rollout_cli.main import main

    capsys.readouterr()
    code = main(["train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run",
                 "--set", 'algorithm.rl.loss.correction={ type = "mis" }',
                 "--set", 'algorithm.rl.envs[0].sampler={ source = { base_url = ["http://x:1/v1"], name = "t" } }'])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "algorithm.rl.envs[0].sampler.source" in err and "loss.correction 'mis'" in err


# --- the step's diagnostics and the embedded sampler --------------------------------------------------------------


def test_the_step_reports_the_mismatch_diagnostics_over_its_micro_batches(tiny_model_dir):
    from test_loss_menu import _micro_batches
    from transformers import AutoModelForCausalLM

    from rollout_lib.trainer.causal import train_on_micro_batches

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    kwargs = rl_config('algorithm.rl.loss.correction={ type = "mis", cap = 1.5 }').settings.loss_kwargs()
    metrics = train_on_micro_batches(model, optimizer, _micro_batches(-2.0), packed=True, pad_token_id=0,
                                     max_grad_norm=1.0, loss_kwargs=kwargs)
    names = {"mismatch/kl", "mismatch/ratio_max", "mismatch/clipped_fraction", "mismatch/masked_fraction"}
    assert names <= set(metrics)
    assert metrics["mismatch/kl"] > 0 and metrics["mismatch/ratio_max"] > 0
    assert 0 <= metrics["mismatch/masked_fraction"] <= 1
    plain = train_on_micro_batches(model, optimizer, _micro_batches(-2.0), packed=True, pad_token_id=0,
                                   max_grad_norm=1.0, loss_kwargs=rl_config().settings.loss_kwargs())
    assert not any(name.startswith("mismatch/") for name in plain)


def test_the_embedded_fp32_samplers_logprobs_are_the_trainers_to_rounding(tiny_model_dir):
    from test_off_policy import sampled_step, words_config

    from rollout_lib.rl.advantages import algorithm_resources, training_samples

    cfg = words_config(tiny_model_dir, behaviour_logprobs="trainer")
    with sampled_step(cfg, "memory://mismatch-fp32", frozen_rows=()) as (policy, scored, reference):
        assert next(policy.model.parameters()).dtype == torch.float32
        _, metrics = training_samples(cfg, scored, algorithm_resources(cfg, policy=reference))
    assert metrics["behaviour/recomputed"] == scored.num_rows
    # Measured 4.8e-7 and 4.5e-14: float32 rounding between a generate step and a padded batch forward.
    assert metrics["behaviour/sampler_diff_max"] < 1e-5
    assert metrics["behaviour/sampler_kl"] < 1e-10


def test_the_curves_draw_the_mismatch_panels_only_where_a_run_reports_them():
    from rollout_lib.runlog.plot import curve_panels

    history = [{"step": step, "loss": 1.0, "mismatch/kl": 1e-3 * step, "mismatch/ratio_max": 1.5,
                "mismatch/masked_fraction": 0.0} for step in (1, 2)]
    titles = [panel.title for panel in curve_panels(history)]
    assert {"sampler-trainer mismatch KL", "mismatch ratio max", "mismatch masked fraction"} <= set(titles)
    kl = next(panel for panel in curve_panels(history) if panel.title == "sampler-trainer mismatch KL")
    assert kl.series[0].values == [1e-3, 2e-3]
    assert not any("mismatch" in panel.title for panel in curve_panels([{"step": 1, "loss": 1.0}]))
