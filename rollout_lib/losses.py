"""The losses: Bradley-Terry for reward models, and the three token components of the algorithm-blind trainer.

Pure torch functions over already-computed tensors: no Prefect, no model code.

Reward models (spec: seed 000, TRL's RewardTrainer):
    L = mean_i -log σ(r_chosen_i - r_rejected_i - margin_i)  +  λ · mean_i (r_chosen_i + r_rejected_i)²

Token components (seed 002, the prime-rl algorithm abstraction). Inputs are already-shifted per-token tensors of
one micro-batch: `logprobs[t]` is the policy's log-probability of target token t; every stream in
`wire.TOKEN_FLOAT_COLUMNS` (plus `loss_mask`) is aligned with it. The trainer knows no algorithm; it sums

    loss = Σ_c numerator_c / N_c        c ∈ {rl, ce, ref_kl}

where N_c is the number of tokens with non-zero weight in component c over the WHOLE optimizer step (every
micro-batch). Each component has its own denominator so components never dilute each other (echo's observation
tokens do not shrink the rl term's per-token step), and dividing by the step-global count makes gradient
accumulation over micro-batches equal the one-big-batch gradient.

The rl component (`type = "default"`): DPPO-Binary-TV trust-region mask + a k2 KL regulariser (prime-rl's "DPPO+KL").
    r_t = exp(logp_t - logp_inf_t);  keep_t = not (A_t > 0 and p_t - p_inf_t > eps_high)
                                                 and not (A_t <= 0 and p_t - p_inf_t < -eps_low)
    loss_t = w_t · ( -keep_t · r_t · A_t  +  kl_coef · ½ (logp_t - logp_inf_t)² )
The ce component: masked NLL, Σ_t w_t · -logp_t. The ref_kl component (opd/opsd): the rl math with
a_t = logp_ref_t - logp_t (detached) for A_t and the low side of the trust region only. Why these variants:
docs/algorithms.md, "Why the default rl and ref_kl losses".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rollout_lib.wire import LOSS_STREAMS, SAMPLER_LOGPROBS

# The components of the trainer's sum, in the order they are reported.
COMPONENTS = ("rl", "ce", "ref_kl")


# prime-rl's vetted defaults (DefaultLossConfig: dppo_mask_low/high = 0.2, kl_tau = 1e-3), and the values its
# opd loss fixes for the ref_kl component (dppo mask 0.2, KL coefficient 1e-3).
DEFAULT_EPS_LOW = 0.2
DEFAULT_EPS_HIGH = 0.2
DEFAULT_KL_COEF = 1e-3
DEFAULT_REF_KL_EPS_LOW = 0.2
DEFAULT_REF_KL_KL_COEF = 1e-3


# --- Bradley-Terry (reward models) ---------------------------------------------------------------------------


logsigmoid = F.logsigmoid  # log σ(x) = -softplus(-x): finite where log(sigmoid(x)) underflows


def bradley_terry_loss(r_chosen: Tensor, r_rejected: Tensor, margin: Tensor | float | None = None) -> Tensor:
    """Per-pair loss: -log σ(r_chosen - r_rejected - margin).

    A margin (TRL's `margin` column) asks the chosen reward to beat the rejected one by at least that much.
    """
    r_chosen, r_rejected = _as_tensor(r_chosen), _as_tensor(r_rejected)
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - _as_tensor(margin).to(diff)
    return -logsigmoid(diff)


def bradley_terry_batch_mean(r_chosen: Tensor, r_rejected: Tensor, margin: Tensor | float | None = None,
                             center_rewards_coefficient: float = 0.0) -> Tensor:
    """mean_i -log σ(r_c - r_r - m) + λ · mean_i (r_c + r_r)²  (TRL RewardTrainer's center_rewards_coefficient).

    Returns exactly 0.0 for an empty batch, still attached to the inputs' graph so `.backward()` works.
    """
    r_chosen, r_rejected = _as_tensor(r_chosen), _as_tensor(r_rejected)
    if r_chosen.numel() == 0:
        # The sum of an empty tensor is exactly 0, so this is exactly 0.0 and keeps any autograd graph.
        return (r_chosen.sum() + r_rejected.sum()) * 0.0
    loss = bradley_terry_loss(r_chosen, r_rejected, margin).mean()
    if center_rewards_coefficient:
        # Pins the rewards' scale-free offset near zero (Eisenstein et al. 2023), as TRL does.
        loss = loss + center_rewards_coefficient * ((r_chosen + r_rejected) ** 2).mean()
    return loss


def pair_metrics(r_chosen: Tensor, r_rejected: Tensor) -> dict[str, float]:
    """accuracy = fraction of pairs with r_chosen > r_rejected (ties count as wrong); mean_margin = mean(r_c - r_r).

    Both are 0.0 for an empty batch; `pairs` carries the count so callers can weight averages.
    """
    with torch.no_grad():
        r_chosen, r_rejected = _as_tensor(r_chosen), _as_tensor(r_rejected)
        pairs = r_chosen.numel()
        if pairs == 0:
            return {"accuracy": 0.0, "mean_margin": 0.0, "pairs": 0}
        diff = (r_chosen - r_rejected).float()
        return {"accuracy": (diff > 0).float().mean().item(), "mean_margin": diff.mean().item(), "pairs": pairs}


# --- token components ---------------------------------------------------------------------------------------


def masked_nll_sum(logprobs: Tensor, weights: Tensor) -> Tensor:
    """ce numerator: Σ_t w_t · -logp_t (the caller divides by the step-global ce token count)."""
    return -(weights * logprobs).sum()


def rl_loss_terms(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, weights: Tensor, *,
                  eps_low: float = DEFAULT_EPS_LOW, eps_high: float = DEFAULT_EPS_HIGH,
                  kl_coef: float = DEFAULT_KL_COEF, max_ratio: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """rl numerator: Σ_t w_t (-keep_t · r_t · A_t + kl_coef · ½ log² r_t), r_t = exp(logp_t - logp_inf_t).

    keep_t drops a token whose probability moved past the trust region in its advantage's direction
    (A > 0: p - p_inf > eps_high; A <= 0: p - p_inf < -eps_low). See the module docstring for why. `max_ratio`:
    r_t above it counts as max_ratio, without gradient (`capped`); None: no ceiling.
    """
    log_ratio = logprobs - inference_logprobs
    ratio = capped(torch.exp(log_ratio), max_ratio)
    member = weights != 0

    with torch.no_grad():
        # The trust-region decision is a mask, never a path for gradient.
        prob_delta = torch.exp(logprobs) - torch.exp(inference_logprobs)
        positive = advantages > 0
        outside_high = prob_delta > eps_high
        outside_low = prob_delta < -eps_low
        masked = member & torch.where(positive, outside_high, outside_low)
        keep = member & ~masked

    numerator = _trust_region_numerator(ratio, log_ratio, advantages, keep, weights, kl_coef)

    with torch.no_grad():
        tokens = int(member.sum())
        metrics = {
            "tokens": tokens,
            "masked_fraction": mean_over(masked.float(), member),
            "masked_high_fraction": mean_over((masked & positive).float(), member),
            "masked_low_fraction": mean_over((masked & ~positive).float(), member),
            "ratio_mean": mean_over(ratio, member),
            # k3 = r - 1 - log r: the non-negative, unbiased estimate of KL(π_inf‖π) on sampler tokens, i.e. how
            # far the trainer has drifted from the sampler (off-policyness plus trainer/inference mismatch).
            "mismatch_kl": mean_over(ratio - 1 - log_ratio, member),
        }
        if max_ratio is not None:  # only then: the default's metrics (in checkpoint manifests) stay as they were
            metrics["capped_fraction"] = mean_over((log_ratio > math.log(max_ratio)).float(), member)
    return numerator, metrics


def capped(ratio: Tensor, max_ratio: float | None) -> Tensor:
    """`ratio` with values above `max_ratio` set to it; those carry no gradient (clamp's), so a wild ratio (a stale
    or mismatched behaviour logprob) can dominate neither the step's value nor its update. None: `ratio` as it is."""
    return ratio if max_ratio is None else ratio.clamp(max=max_ratio)


RL_LOSS_WHAT = "rl loss function"


def custom_rl_terms(function: Callable[..., Any], logprobs: Tensor, inference_logprobs: Tensor,
                    advantages: Tensor, weights: Tensor) -> tuple[Tensor, dict[str, float]]:
    """A user's rl numerator (`[algorithm.rl.loss] type = "custom"`, docs/algorithms.md): `function(logprobs=,
    inference_logprobs=, advantages=, weights=, **kwargs)` returns the **sum** over tokens of w_t · loss_t, a
    0-dimensional tensor attached to `logprobs`' graph (rollout divides by N_rl), and optionally a dict of metrics."""
    member = weights != 0
    returned = function(logprobs=logprobs, inference_logprobs=inference_logprobs, advantages=advantages,
                        weights=weights)
    numerator, extra = returned if isinstance(returned, tuple) else (returned, {})
    name = getattr(function, "func", function)
    where = f"{RL_LOSS_WHAT} {getattr(name, '__module__', '?')}:{getattr(name, '__qualname__', name)}"
    if not isinstance(numerator, Tensor) or numerator.dim() != 0:
        raise ValueError(f"{where} returned {type(numerator).__name__}"
                         f"{'' if not isinstance(numerator, Tensor) else f' of shape {tuple(numerator.shape)}'}; "
                         "expected a 0-dimensional tensor (the sum over tokens of w_t * loss_t)")
    if not numerator.requires_grad and bool(member.any()):
        raise ValueError(f"{where} returned a tensor without a gradient path: compute it from `logprobs`")
    metrics = {"tokens": int(member.sum()), **{str(key): float(value) for key, value in dict(extra).items()}}
    return numerator, metrics


def ref_kl_loss_terms(logprobs: Tensor, ref_logprobs: Tensor, inference_logprobs: Tensor, weights: Tensor, *,
                      eps_low: float = DEFAULT_REF_KL_EPS_LOW,
                      kl_coef: float = DEFAULT_REF_KL_KL_COEF) -> tuple[Tensor, dict[str, float]]:
    """ref_kl numerator: Σ_t w_t (-keep_t · r_t · a_t + kl_coef · ½ log² r_t), a_t = logp_ref_t - logp_t.detach().

    keep_t drops a token whose probability fell more than eps_low below the sampler's (the low side only; see the
    module docstring for why). On-policy the gradient is w_t (logp_t - logp_ref_t) ∇logp_t.
    """
    log_ratio = logprobs - inference_logprobs
    ratio = torch.exp(log_ratio)
    advantage = ref_logprobs - logprobs.detach()
    member = weights != 0

    with torch.no_grad():
        masked = member & (torch.exp(logprobs) - torch.exp(inference_logprobs) < -eps_low)
        keep = member & ~masked

    numerator = _trust_region_numerator(ratio, log_ratio, advantage, keep, weights, kl_coef)

    with torch.no_grad():
        metrics = {
            "tokens": int(member.sum()),
            # logp - logp_ref on tokens sampled from the policy is the per-token (k1) estimate of KL(π‖π_ref).
            "kl": mean_over(logprobs - ref_logprobs, member),
            "masked_fraction": mean_over(masked.float(), member),
            "mismatch_kl": mean_over(ratio - 1 - log_ratio, member),
        }
    return numerator, metrics


def _trust_region_numerator(ratio: Tensor, log_ratio: Tensor, advantages: Tensor, keep: Tensor, weights: Tensor,
                            kl_coef: float) -> Tensor:
    """Σ_t w_t (-keep_t · r_t · A_t + kl_coef · ½ log² r_t): the importance-weighted policy gradient on the tokens
    inside the trust region, plus the log-ratio penalty (rl and ref_kl differ only in A_t and keep_t)."""
    policy_gradient = torch.where(keep, ratio * advantages, torch.zeros_like(ratio))
    return (weights * (-policy_gradient + kl_coef * (0.5 * log_ratio.square()))).sum()


def count_component_tokens(*micro_batches: Mapping[str, Tensor]) -> dict[str, int]:
    """N_c = number of tokens with non-zero weight in component c, summed over the given micro-batches.

    Pass every micro-batch of an optimizer step to get the `token_counts` for `component_loss`.
    """
    counts = dict.fromkeys(COMPONENTS, 0)
    for streams in micro_batches:
        masks = _component_masks(streams)
        for component in COMPONENTS:
            counts[component] += int(masks[component].sum())
    return counts


def count_rl_sequences(*micro_batches: Mapping[str, Tensor]) -> int:
    """Packed sequences with at least one rl token, summed over the given micro-batches: the `rl_sequences` count a
    constant rl normaliser (Dr. GRPO) divides by, C · rl_sequences. Streams without `sequence_lengths` are one
    sequence."""
    total = 0
    for streams in micro_batches:
        rl = _component_masks(streams)["rl"]
        if "sequence_lengths" not in streams:
            total += int(bool(rl.any()))
            continue
        sequence_ids = sequence_ids_of(streams["sequence_lengths"], rl.device)
        total += int(torch.unique(sequence_ids[rl]).numel())
    return total


def sequence_ids_of(sequence_lengths: Tensor, device: torch.device | None = None) -> Tensor:
    """[T] index of each token's packed sequence, from a micro-batch's `sequence_lengths` (streams are flat in
    packed order for both layouts, packing.collate_micro_batch)."""
    lengths = sequence_lengths.to(device=device, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)


def loss_tokens(streams: Mapping[str, Tensor]) -> Tensor:
    """[T] bool: the tokens some component trains on, the only ones whose logprobs the loss reads."""
    masks = _component_masks(streams)
    return masks["rl"] | masks["ce"] | masks["ref_kl"]


def component_loss(logprobs: Tensor, streams: Mapping[str, Tensor], token_counts: Mapping[str, int | float], *,
                   eps_low: float = DEFAULT_EPS_LOW, eps_high: float = DEFAULT_EPS_HIGH,
                   kl_coef: float = DEFAULT_KL_COEF, ref_kl_eps_low: float = DEFAULT_REF_KL_EPS_LOW,
                   ref_kl_kl_coef: float = DEFAULT_REF_KL_KL_COEF, rl_loss: Callable[..., Any] | Any | None = None,
                   rl_normalizer: float | None = None,
                   correction: Any | None = None) -> tuple[Tensor, dict[str, float]]:
    """loss = Σ_c numerator_c / N_c over c ∈ {rl, ce, ref_kl}; N_c is step-global, so micro-batch losses add up.

    rl weights are `(loss_mask & rl_weights != 0) · rl_weights`; ce and ref_kl weights apply as they are. The
    keyword settings are the rl and ref_kl components' (config: RlLossSettings); `rl_loss`: the rl numerator in
    place of rl_loss_terms, a registered loss (rollout_lib.rl_losses: an object with `terms`, given each token's
    sequence from `streams["sequence_lengths"]`) or a user's function (custom_rl_terms). `rl_normalizer` C: N_rl =
    C · token_counts["rl_sequences"] (count_rl_sequences) instead of the rl token count (Dr. GRPO). `correction`
    (rl_losses/correction.py): the rl ratio is taken against the trainer's π_old and each rl token's weight is
    scaled by the correction's factor, w_t against the sampler's logprobs (`correction_inputs`: with a
    `sampler_logprobs` stream, π_old is `inference_logprobs`, the trainer's recompute; without one,
    `inference_logprobs` are the sampler's and π_old this forward's, on-policy); its diagnostics are
    `mismatch/<name>`. None: the loss as before the setting.
    """
    _check_streams(logprobs, streams)
    sequence_lengths = streams.get("sequence_lengths")
    sampler_logprobs = streams.get(SAMPLER_LOGPROBS)
    # Streams take logprobs' dtype: pass float32 logprobs (ratios of bf16 logprobs are too coarse for the mask).
    streams = {key: streams[key].to(device=logprobs.device) for key in LOSS_STREAMS}
    masks = _component_masks(streams)
    weights = {c: torch.where(masks[c], streams[f"{c}_weights"].to(logprobs.dtype), 0.0) for c in COMPONENTS}

    denominators = dict(token_counts)
    if rl_normalizer is not None:
        if "rl_sequences" not in token_counts:
            raise KeyError("a constant rl normaliser divides by C · token_counts['rl_sequences']: count them over "
                           "every micro-batch of the step (count_rl_sequences)")
        denominators["rl"] = rl_normalizer * token_counts["rl_sequences"]
    for component in COMPONENTS:
        local = int(masks[component].sum())
        if local > token_counts.get(component, 0):
            # A count smaller than this micro-batch's own tokens means the counts were not built over the step.
            raise ValueError(
                f"token_counts[{component!r}] = {token_counts.get(component, 0)} but this micro-batch alone has "
                f"{local} {component} tokens; count over every micro-batch of the step (count_component_tokens)"
            )

    # Seeded with a graph-attached zero: a micro-batch whose components are all empty still backpropagates
    # (zero gradients), so every rank of a distributed step runs backward and its collectives stay in sync.
    loss = logprobs.sum() * 0.0
    metrics: dict[str, float] = {}

    inference_logprobs = streams["inference_logprobs"].to(logprobs.dtype)
    # NaN (wire.TRAINING_SAMPLES): sampled by the very state being trained, so the behaviour logprob is this
    # forward's own, detached (behaviour_logprobs = "training_forward": ratio 1, no trust-region mask, no KL).
    on_policy = torch.isnan(inference_logprobs)
    if bool(on_policy.any()):
        inference_logprobs = torch.where(on_policy, logprobs.detach(), inference_logprobs)
    numerators: dict[str, tuple[Tensor, dict[str, float]]] = {}
    sequence_ids = None if sequence_lengths is None else sequence_ids_of(sequence_lengths, logprobs.device)
    rl_inference_logprobs = inference_logprobs
    if correction is not None and token_counts.get("rl", 0):
        # The sampler's logprobs are the correction's denominator; the trust region is against the trainer's π_old.
        old_logprobs, sampler = correction_inputs(logprobs, inference_logprobs, sampler_logprobs)
        factors, diagnostics = correction.token_factors(old_logprobs, sampler, masks["rl"], sequence_ids)
        weights["rl"] = weights["rl"] * factors.to(logprobs.dtype)
        rl_inference_logprobs = old_logprobs
        metrics.update({f"mismatch/{name}": value for name, value in diagnostics.items()})
    if token_counts.get("rl", 0):
        rl_inputs = (logprobs, rl_inference_logprobs, streams["advantages"].to(logprobs.dtype), weights["rl"])
        if hasattr(rl_loss, "terms"):
            numerators["rl"] = rl_loss.terms(*rl_inputs, sequence_ids=sequence_ids)
        elif rl_loss is not None:
            numerators["rl"] = custom_rl_terms(rl_loss, *rl_inputs)
        else:
            numerators["rl"] = rl_loss_terms(*rl_inputs, eps_low=eps_low, eps_high=eps_high, kl_coef=kl_coef)
    if token_counts.get("ce", 0):
        numerators["ce"] = masked_nll_sum(logprobs, weights["ce"]), {"tokens": int(masks["ce"].sum())}
    if token_counts.get("ref_kl", 0):
        numerators["ref_kl"] = ref_kl_loss_terms(logprobs, streams["ref_logprobs"].to(logprobs.dtype),
                                                 inference_logprobs, weights["ref_kl"], eps_low=ref_kl_eps_low,
                                                 kl_coef=ref_kl_kl_coef)

    for component, (numerator, component_metrics) in numerators.items():
        contribution = numerator / denominators[component]
        loss = loss + contribution
        metrics[f"loss/{component}"] = contribution.detach().item()
        metrics.update({f"{component}/{name}": value for name, value in component_metrics.items()})
    metrics["loss/total"] = loss.detach().item()
    return loss, metrics


def correction_inputs(logprobs: Tensor, inference_logprobs: Tensor,
                      sampler_logprobs: Tensor | None) -> tuple[Tensor, Tensor]:
    """(π_old, π_sampler) of each token for a mismatch correction. Where the wire keeps the sampler's logprobs
    (`sampler_logprobs`, not NaN) the behaviour stream is the trainer's (its recompute under the weights that
    sampled, or this forward's own where NaN), so π_old is that stream: off-policy too. Elsewhere the behaviour
    stream is the sampler's report and π_old is this forward (on-policy, behaviour_logprobs = "sampler")."""
    this_forward = logprobs.detach()
    if sampler_logprobs is None:
        return this_forward, inference_logprobs
    sampler_logprobs = sampler_logprobs.to(device=logprobs.device, dtype=logprobs.dtype)
    kept = ~torch.isnan(sampler_logprobs)
    return (torch.where(kept, inference_logprobs, this_forward),
            torch.where(kept, sampler_logprobs, inference_logprobs))


# --- helpers --------------------------------------------------------------------------------------------------


def _component_masks(streams: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Which tokens belong to each component: rl needs loss_mask and a non-zero weight, ce/ref_kl a non-zero weight.

    ce and ref_kl ignore loss_mask on purpose: echo trains ce on env-provided observation tokens, which are not
    trainable action tokens.
    """
    return {
        "rl": streams["loss_mask"].bool() & (streams["rl_weights"] != 0),
        "ce": streams["ce_weights"] != 0,
        "ref_kl": streams["ref_kl_weights"] != 0,
    }


def _check_streams(logprobs: Tensor, streams: Mapping[str, Tensor]) -> None:
    missing = [key for key in LOSS_STREAMS if key not in streams]
    if missing:
        raise KeyError(f"token streams are missing {missing}; packing materialises all of {list(LOSS_STREAMS)}")
    for key in LOSS_STREAMS:
        if streams[key].shape != logprobs.shape:
            raise ValueError(
                f"stream {key!r} has shape {tuple(streams[key].shape)} but logprobs has {tuple(logprobs.shape)}; "
                "every per-token stream must align with the target tokens"
            )


def mean_over(values: Tensor, mask: Tensor) -> float:
    """Mean of `values` where `mask` holds, as a python float; 0.0 when nothing is selected."""
    count = int(mask.sum())
    return float(values[mask].float().sum().item() / count) if count else 0.0


def _as_tensor(x: Tensor | float | list[float]) -> Tensor:
    # Tensors pass through untouched (keeping their graph); numbers and lists become float tensors.
    return x if isinstance(x, Tensor) else torch.as_tensor(x, dtype=torch.float32)
