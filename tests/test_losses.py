"""Golden values and gradient checks for rollout_lib.losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rollout_lib import losses
from rollout_lib.losses import (
    bradley_terry_batch_mean,
    bradley_terry_loss,
    component_loss,
    count_component_tokens,
    logsigmoid,
    masked_nll_sum,
    pair_metrics,
    ref_kl_loss_terms,
    rl_loss_terms,
)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --- Bradley-Terry: the six golden cases of the RM spec (seed 000) -------------------------------------------


def test_bt_zero_diff_is_ln2():
    assert bradley_terry_loss(t(1.0), t(1.0)).item() == pytest.approx(math.log(2), abs=1e-4)


def test_bt_strong_preference_is_near_zero():
    assert bradley_terry_loss(t(5.0), t(-5.0)).item() < 1e-3


def test_bt_inverted_preference_is_about_ten():
    assert bradley_terry_loss(t(-5.0), t(5.0)).item() == pytest.approx(10.0, abs=1e-3)


def test_bt_mixed_batch_mean():
    assert bradley_terry_batch_mean(t(2.0, 1.0), t(1.0, 2.0)).item() == pytest.approx(0.8133, abs=1e-4)


def test_bt_empty_batch_is_exactly_zero_and_backprops():
    r_chosen = torch.zeros(0, requires_grad=True)
    r_rejected = torch.zeros(0, requires_grad=True)
    loss = bradley_terry_batch_mean(r_chosen, r_rejected, center_rewards_coefficient=0.01)
    assert isinstance(loss, torch.Tensor)
    assert loss.item() == 0.0
    loss.backward()
    assert r_chosen.grad is not None and r_chosen.grad.numel() == 0


def test_logsigmoid_is_finite_at_the_extremes():
    out = logsigmoid(t(50.0, -50.0))
    assert torch.isfinite(out).all()
    assert abs(out[0].item() - 0.0) < 1e-4  # log σ(x) -> 0 as x -> +inf
    assert abs(out[1].item() - (-50.0)) < 1e-4  # log σ(x) -> x as x -> -inf


# --- Bradley-Terry: margin, centering, metrics ----------------------------------------------------------------


def test_bt_margin_shifts_the_difference():
    # -log σ(3 - 1 - 0.5) = log(1 + e^-1.5)
    expected = math.log1p(math.exp(-1.5))
    assert bradley_terry_loss(t(3.0), t(1.0), margin=0.5).item() == pytest.approx(expected, abs=1e-6)
    # a per-pair margin tensor: pair 1 diff 2 - 2 = 0 -> ln 2; pair 2 diff 0 - (-1) = 1 -> log(1 + e^-1)
    per_pair = bradley_terry_loss(t(2.0, 0.0), t(0.0, 0.0), margin=t(2.0, -1.0))
    assert per_pair.tolist() == pytest.approx([math.log(2), math.log1p(math.exp(-1.0))], abs=1e-6)


def test_bt_center_rewards_coefficient_matches_trl():
    r_chosen, r_rejected = t(2.0, 1.0), t(1.0, 2.0)
    # 0.8133 from the mixed batch + 0.01 * mean((2+1)^2, (1+2)^2) = 0.01 * 9
    expected = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(1.0))) / 2 + 0.01 * 9.0
    loss = bradley_terry_batch_mean(r_chosen, r_rejected, center_rewards_coefficient=0.01)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_bt_margin_and_center_together():
    r_chosen, r_rejected = t(1.0, 0.5), t(0.0, 1.5)
    margin = t(0.5, 0.0)
    # diffs: 1 - 0 - 0.5 = 0.5, 0.5 - 1.5 - 0 = -1; sums: 1, 2 -> mean of squares 2.5
    expected = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(1.0))) / 2 + 0.1 * 2.5
    loss = bradley_terry_batch_mean(r_chosen, r_rejected, margin=margin, center_rewards_coefficient=0.1)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_pair_metrics():
    metrics = pair_metrics(t(2.0, 1.0, 0.0, 3.0), t(1.0, 2.0, 0.0, 0.0))
    assert metrics["accuracy"] == pytest.approx(0.5)  # 2 > 1 and 3 > 0; the tie counts as wrong
    assert metrics["mean_margin"] == pytest.approx((1.0 - 1.0 + 0.0 + 3.0) / 4)
    assert isinstance(metrics["accuracy"], float) and isinstance(metrics["mean_margin"], float)
    assert pair_metrics(t(), t()) == {"accuracy": 0.0, "mean_margin": 0.0, "pairs": 0}


# --- helpers for the token components -------------------------------------------------------------------------


def streams_for(n: int, **overrides: torch.Tensor) -> dict[str, torch.Tensor]:
    """A micro-batch's streams with every component empty, then the given overrides."""
    streams = {
        "loss_mask": torch.zeros(n, dtype=torch.bool),
        "advantages": torch.zeros(n),
        "rl_weights": torch.zeros(n),
        "ce_weights": torch.zeros(n),
        "ref_kl_weights": torch.zeros(n),
        "ref_logprobs": torch.zeros(n),
        "inference_logprobs": torch.zeros(n),
    }
    streams.update(overrides)
    return streams


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


# --- rl ---------------------------------------------------------------------------------------------------------


def test_rl_loss_matches_hand_computed_reference():
    logprobs = torch.log(t(0.5, 0.1, 0.2, 0.3)).requires_grad_()
    inference_logprobs = torch.log(t(0.1, 0.5, 0.2, 0.25))
    advantages = t(1.0, 1.0, 0.5, 2.0)
    # token 3 is not trainable (loss_mask false), so its weight is 0; token 2 is weighted 2
    weights = t(1.0, 1.0, 2.0, 0.0)
    kl_coef = 0.1

    numerator, metrics = rl_loss_terms(
        logprobs, inference_logprobs, advantages, weights, eps_low=0.2, eps_high=0.2, kl_coef=kl_coef
    )
    numerator.backward()

    # token 0: p rose 0.1 -> 0.5 (+0.4 > eps_high) with A > 0: masked; only the KL term ½ kl (log 5)² remains.
    # token 1: p fell 0.5 -> 0.1 but A > 0 pushes it back up: kept. r = 0.2: -r A + ½ kl (log 0.2)².
    # token 2: on-policy, r = 1: weight 2 · (-1 · 0.5).
    # token 3: weight 0.
    expected_value = (
        0.5 * kl_coef * math.log(5) ** 2
        + (-0.2 * 1.0 + 0.5 * kl_coef * math.log(0.2) ** 2)
        + 2.0 * (-1.0 * 0.5)
    )
    # d/dlogp: -r A (since dr/dlogp = r) + kl log r, times the weight
    expected_grad = [kl_coef * math.log(5), -0.2 * 1.0 + kl_coef * math.log(0.2), 2.0 * -0.5, 0.0]
    assert numerator.item() == pytest.approx(expected_value, abs=1e-6)
    assert logprobs.grad.tolist() == pytest.approx(expected_grad, abs=1e-6)

    assert metrics["tokens"] == 3
    assert metrics["masked_fraction"] == pytest.approx(1 / 3)
    assert metrics["masked_high_fraction"] == pytest.approx(1 / 3)
    assert metrics["ratio_mean"] == pytest.approx((5.0 + 0.2 + 1.0) / 3, abs=1e-6)
    k3 = [5.0 - 1 - math.log(5), 0.2 - 1 - math.log(0.2), 0.0]
    assert metrics["mismatch_kl"] == pytest.approx(sum(k3) / 3, abs=1e-6)
    assert all(isinstance(value, (float, int)) for value in metrics.values())


def test_rl_mask_is_one_sided_by_advantage_sign():
    # The same probability drop (0.5 -> 0.1) is masked when A < 0 pushes further down, kept when A > 0.
    logprobs = torch.log(t(0.1, 0.1)).requires_grad_()
    inference_logprobs = torch.log(t(0.5, 0.5))
    numerator, metrics = rl_loss_terms(logprobs, inference_logprobs, t(-1.0, 1.0), t(1.0, 1.0), kl_coef=0.0)
    numerator.backward()
    assert logprobs.grad.tolist() == pytest.approx([0.0, -0.2], abs=1e-6)
    assert metrics["masked_low_fraction"] == pytest.approx(0.5)


def test_rl_on_policy_is_plain_policy_gradient():
    # r = 1 everywhere: the loss is -Σ A logp's gradient, and the KL term is zero in value and gradient.
    logprobs = torch.log(t(0.3, 0.6)).requires_grad_()
    numerator, metrics = rl_loss_terms(logprobs, logprobs.detach(), t(1.0, -2.0), t(1.0, 1.0), kl_coef=1.0)
    numerator.backward()
    assert logprobs.grad.tolist() == pytest.approx([-1.0, 2.0], abs=1e-6)
    assert metrics["masked_fraction"] == 0.0 and metrics["mismatch_kl"] == pytest.approx(0.0, abs=1e-7)


# --- ce -----------------------------------------------------------------------------------------------------------


def test_ce_component_equals_cross_entropy_mean():
    torch.manual_seed(0)
    n, vocab = 10, 7
    logits = torch.randn(n, vocab, requires_grad=True)
    targets = torch.randint(vocab, (n,))
    trainable = torch.tensor([False, False, True, True, True, False, True, True, False, True])

    ce_weights = trainable.float()
    streams = streams_for(n, ce_weights=ce_weights)
    loss, metrics = component_loss(token_logprobs(logits, targets), streams, count_component_tokens(streams))
    loss.backward()
    ours = logits.grad.clone()

    logits.grad = None
    reference = F.cross_entropy(logits[trainable], targets[trainable])
    reference.backward()

    assert loss.item() == pytest.approx(reference.item(), abs=1e-6)
    assert torch.allclose(ours, logits.grad, atol=1e-7)
    assert metrics["ce/tokens"] == int(trainable.sum())
    assert masked_nll_sum(t(-1.0, -2.0), t(1.0, 0.0)).item() == pytest.approx(1.0)


# --- ref_kl -------------------------------------------------------------------------------------------------------


def test_ref_kl_is_zero_in_value_and_gradient_when_ref_is_policy():
    logprobs = torch.log(t(0.2, 0.7, 0.05)).requires_grad_()
    numerator, metrics = ref_kl_loss_terms(logprobs, logprobs.detach().clone(), logprobs.detach().clone(),
                                           t(1.0, 1.0, 1.0))
    numerator.backward()
    assert numerator.item() == 0.0
    assert logprobs.grad.abs().max().item() == 0.0
    assert metrics["kl"] == 0.0


def test_ref_kl_gradient_moves_logprobs_toward_the_reference():
    logprobs = torch.log(t(0.5, 0.1, 0.3)).requires_grad_()
    ref_logprobs = torch.log(t(0.2, 0.4, 0.3))
    weights = t(1.0, 1.0, 1.0)
    numerator, metrics = ref_kl_loss_terms(logprobs, ref_logprobs, logprobs.detach(), weights)  # on-policy
    numerator.backward()

    # gradient = w (logp - logp_ref): positive above the reference (descent lowers logp), negative below
    gap = logprobs.detach() - ref_logprobs
    assert logprobs.grad.tolist() == pytest.approx(gap.tolist(), abs=1e-6)
    assert logprobs.grad[0] > 0 and logprobs.grad[1] < 0 and logprobs.grad[2] == 0

    stepped = logprobs.detach() - 0.1 * logprobs.grad
    assert ((stepped - ref_logprobs).abs() <= gap.abs()).all()
    assert ((stepped - ref_logprobs).abs()[:2] < gap.abs()[:2]).all()
    assert metrics["kl"] == pytest.approx(gap.mean().item(), abs=1e-6)


def test_ref_kl_trust_region_is_the_low_side_only_with_a_log_ratio_penalty():
    # token 0: rose 0.3 past the sampler, a > 0 (kept: no high side);   1: fell 0.4, a > 0 (masked: low side
    # whatever a's sign);   2: on the sampler, a < 0 (kept);   3: fell 0.55, a < 0 (masked).
    p, p_inf, p_ref = (0.5, 0.1, 0.3, 0.05), (0.2, 0.5, 0.3, 0.6), (0.8, 0.4, 0.1, 0.01)
    w, kl_coef = (1.0, 1.0, 0.5, 1.0), 0.1
    keep = (True, False, True, False)
    logprobs = torch.log(t(*p)).requires_grad_()
    numerator, metrics = ref_kl_loss_terms(logprobs, torch.log(t(*p_ref)), torch.log(t(*p_inf)), t(*w),
                                           eps_low=0.2, kl_coef=kl_coef)
    numerator.backward()

    expected_value = 0.0
    grads = []
    for pi, pinf, pref, wi, kept in zip(p, p_inf, p_ref, w, keep):
        log_r, a = math.log(pi / pinf), math.log(pref) - math.log(pi)
        expected_value += wi * (-(kept * (pi / pinf) * a) + kl_coef * 0.5 * log_r ** 2)
        grads.append(wi * (-(kept * (pi / pinf) * a) + kl_coef * log_r))  # d(r)/dlogp = r; a is detached
    assert numerator.item() == pytest.approx(expected_value, abs=1e-5)
    assert logprobs.grad.tolist() == pytest.approx(grads, abs=1e-5)
    assert metrics["masked_fraction"] == 0.5
    # The masked tokens keep only the penalty's pull toward the sampler.
    assert logprobs.grad[1].item() == pytest.approx(kl_coef * math.log(0.1 / 0.5), abs=1e-6)


# --- the component sum ----------------------------------------------------------------------------------------------


def mixed_streams(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Random streams where the components overlap, some rl tokens sit outside loss_mask, weights vary."""
    generator = torch.Generator().manual_seed(seed)

    def bern(p: float) -> torch.Tensor:
        return torch.rand(n, generator=generator) < p

    return {
        "loss_mask": bern(0.7),
        "advantages": torch.randn(n, generator=generator),
        "rl_weights": bern(0.8).float() * (0.5 + torch.rand(n, generator=generator)),
        "ce_weights": bern(0.3).float() * torch.rand(n, generator=generator),
        "ref_kl_weights": bern(0.4).float(),
        "ref_logprobs": -torch.rand(n, generator=generator) * 3,
        "inference_logprobs": -torch.rand(n, generator=generator) * 3,
    }


def test_ce_tokens_do_not_dilute_the_rl_gradient():
    torch.manual_seed(1)
    n, vocab = 8, 5
    logits = torch.randn(n, vocab)
    targets = torch.randint(vocab, (n,))
    rl_part = torch.arange(n) < 4

    def rl_gradient(with_ce: bool) -> torch.Tensor:
        logprobs = token_logprobs(logits, targets).detach().requires_grad_()
        streams = streams_for(
            n,
            loss_mask=rl_part,
            advantages=torch.where(rl_part, t(1.0, -0.5, 2.0, 0.3, 0, 0, 0, 0), 0.0),
            rl_weights=rl_part.float(),
            inference_logprobs=logprobs.detach() - 0.05,
            # echo-style: ce on the non-trainable observation tokens only
            ce_weights=(~rl_part).float() if with_ce else torch.zeros(n),
        )
        loss, _ = component_loss(logprobs, streams, count_component_tokens(streams), kl_coef=0.1)
        loss.backward()
        return logprobs.grad

    without_ce, with_ce = rl_gradient(False), rl_gradient(True)
    assert torch.equal(without_ce[:4], with_ce[:4])  # the rl tokens' gradient is untouched by ce tokens
    assert torch.all(without_ce[4:] == 0) and torch.all(with_ce[4:] != 0)


def test_gradient_accumulation_matches_one_big_batch():
    torch.manual_seed(2)
    n, vocab = 24, 11
    logits = (3 * torch.randn(n, vocab)).requires_grad_()
    targets = logits.detach().argmax(-1)  # likely tokens, as sampling mostly picks, so probabilities can move a lot
    streams = mixed_streams(n, seed=3)
    # A sampler that disagrees with the trainer, so the rl trust region masks some tokens too.
    streams["inference_logprobs"] = (token_logprobs(logits, targets).detach() + torch.randn(n)).clamp(max=0.0)

    big_loss, big_metrics = component_loss(token_logprobs(logits, targets), streams, count_component_tokens(streams))
    big_loss.backward()
    big_grad = logits.grad.clone()
    assert 0.0 < big_metrics["rl/masked_fraction"] < 1.0

    # Uneven split: each component's share differs per micro-batch, so a mean of micro-batch means would differ.
    logits.grad = None
    split = 7
    micro_batches = [{k: v[:split] for k, v in streams.items()}, {k: v[split:] for k, v in streams.items()}]
    counts = count_component_tokens(*micro_batches)
    assert counts == count_component_tokens(streams)
    total = 0.0
    for rows, micro in zip((slice(0, split), slice(split, n)), micro_batches):
        loss, _ = component_loss(token_logprobs(logits[rows], targets[rows]), micro, counts)
        loss.backward()
        total += loss.item()

    assert all(counts[c] > 0 for c in losses.COMPONENTS)
    assert total == pytest.approx(big_loss.item(), abs=1e-6)
    assert torch.allclose(logits.grad, big_grad, atol=1e-6)

    # The test can tell: normalising each micro-batch by its own counts (a mean of means) gives another gradient.
    logits.grad = None
    for rows, micro in zip((slice(0, split), slice(split, n)), micro_batches):
        loss, _ = component_loss(token_logprobs(logits[rows], targets[rows]), micro, count_component_tokens(micro))
        loss.backward()
    assert not torch.allclose(logits.grad, big_grad, atol=1e-4)


def test_all_empty_batch_backprops_to_zero():
    logits = torch.randn(5, 3, requires_grad=True)
    streams = streams_for(5, loss_mask=torch.ones(5, dtype=torch.bool))  # trainable, but every weight is 0
    counts = count_component_tokens(streams)
    assert counts == {"rl": 0, "ce": 0, "ref_kl": 0}

    loss, metrics = component_loss(token_logprobs(logits, torch.zeros(5, dtype=torch.long)), streams, counts)
    loss.backward()
    assert loss.item() == 0.0
    assert logits.grad is not None and logits.grad.abs().max().item() == 0.0
    assert metrics == {"loss/total": 0.0}


def test_components_absent_from_the_micro_batch_add_exactly_zero():
    # Only ce tokens here; the step has rl tokens in other micro-batches (rl adds 0) and no ref_kl at all (skipped).
    logprobs = torch.log(t(0.5, 0.25)).requires_grad_()
    streams = streams_for(2, ce_weights=t(1.0, 1.0))
    loss, metrics = component_loss(logprobs, streams, {"rl": 10, "ce": 2, "ref_kl": 0})
    assert loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.25)) / 2, abs=1e-6)
    assert metrics["loss/rl"] == 0.0 and "loss/ref_kl" not in metrics


def test_counts_smaller_than_the_micro_batch_raise():
    streams = streams_for(3, ce_weights=t(1.0, 1.0, 0.0))
    with pytest.raises(ValueError, match="token_counts\\['ce'\\]"):
        component_loss(torch.zeros(3, requires_grad=True), streams, {"rl": 0, "ce": 1, "ref_kl": 0})


def test_missing_or_misaligned_streams_raise():
    streams = streams_for(3)
    del streams["ref_logprobs"]
    with pytest.raises(KeyError, match="ref_logprobs"):
        component_loss(torch.zeros(3), streams, {"rl": 0, "ce": 0, "ref_kl": 0})
    streams = streams_for(3, advantages=torch.zeros(4))
    with pytest.raises(ValueError, match="advantages"):
        component_loss(torch.zeros(3), streams, {"rl": 0, "ce": 0, "ref_kl": 0})


def test_rl_weights_outside_loss_mask_are_ignored():
    logprobs = torch.log(t(0.4, 0.4)).requires_grad_()
    streams = streams_for(
        2,
        loss_mask=torch.tensor([True, False]),
        rl_weights=t(2.0, 1.0),
        advantages=t(1.0, 1.0),
        inference_logprobs=logprobs.detach(),
    )
    counts = count_component_tokens(streams)
    assert counts["rl"] == 1
    loss, _ = component_loss(logprobs, streams, counts, kl_coef=0.0)
    loss.backward()
    assert logprobs.grad.tolist() == pytest.approx([-2.0, 0.0], abs=1e-6)  # weight 2 · -r A / N_rl = 1


# --- a custom rl loss (seed 002's [trainer.loss] type = "custom") -------------------------------------------------


def _custom_loss_batch():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, requires_grad=True)
    streams = {
        "loss_mask": torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool),
        "advantages": torch.tensor([[0.0, 0.5, 0.5, 0.5, 0.5, 0.0], [0.0, 0.0, -1.0, -1.0, -1.0, -1.0]]),
        "rl_weights": torch.ones(2, 6), "ce_weights": torch.zeros(2, 6), "ref_kl_weights": torch.zeros(2, 6),
        "ref_logprobs": torch.zeros(2, 6), "inference_logprobs": torch.full((2, 6), -1.2),
    }
    return logits, streams


def test_a_custom_rl_loss_that_is_the_built_in_one_trains_exactly_as_the_default():
    import functools

    import example_losses
    from rollout_lib.losses import component_loss, count_component_tokens

    settings = {"eps_low": 0.2, "eps_high": 0.2, "kl_coef": 1e-3}
    results = []
    for custom in (None, functools.partial(example_losses.the_built_in_one, **settings)):
        logits, streams = _custom_loss_batch()
        logprobs = torch.nn.functional.logsigmoid(logits)
        loss, metrics = component_loss(logprobs, streams, count_component_tokens(streams), **settings,
                                       rl_loss=custom)
        loss.backward()
        results.append((loss.detach(), logits.grad.clone(), metrics["rl/tokens"]))
    (default_loss, default_grad, tokens), (custom_loss, custom_grad, custom_tokens) = results
    assert torch.equal(default_loss, custom_loss) and torch.equal(default_grad, custom_grad)
    assert tokens == custom_tokens == 8


def test_a_custom_rl_loss_is_normalised_by_the_rl_token_count_and_its_metrics_are_logged():
    import example_losses
    from rollout_lib.losses import component_loss, count_component_tokens

    logits, streams = _custom_loss_batch()
    logprobs = torch.nn.functional.logsigmoid(logits)
    counts = count_component_tokens(streams)
    loss, metrics = component_loss(logprobs, streams, counts, rl_loss=example_losses.clipped_importance_pg)
    numerator, own_metrics = example_losses.clipped_importance_pg(
        logprobs=logprobs, inference_logprobs=streams["inference_logprobs"], advantages=streams["advantages"],
        weights=streams["rl_weights"] * streams["loss_mask"])
    assert loss.item() == pytest.approx(numerator.item() / counts["rl"])
    # The function's own metric, logged as rl/<name>: 5 of the 8 rl tokens have a ratio outside [0.8, 1.2].
    assert metrics["rl/clip_fraction"] == own_metrics["clip_fraction"] == 5 / 8


def test_a_custom_rl_loss_that_breaks_the_contract_fails_naming_it():
    import example_losses
    from rollout_lib.losses import component_loss, count_component_tokens

    logits, streams = _custom_loss_batch()
    logprobs = torch.nn.functional.logsigmoid(logits)
    with pytest.raises(ValueError, match=r"rl loss function example_losses:a_mean_per_token returned Tensor of "
                                         r"shape \(2, 6\); expected a 0-dimensional tensor"):
        component_loss(logprobs, streams, count_component_tokens(streams), rl_loss=example_losses.a_mean_per_token)
    with pytest.raises(ValueError, match="without a gradient path"):
        component_loss(logprobs, streams, count_component_tokens(streams),
                       rl_loss=lambda **t: (t["weights"] * t["advantages"]).sum())
