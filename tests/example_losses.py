"""Example custom rl losses (`[algorithm.rl.loss] type = "custom", import_path = "example_losses:<name>"`), user
code kept out of the library like example_advantages.py: importable in tests (pytest puts tests/ on sys.path) and
from the CLI with `PYTHONPATH=tests`.

A loss function gets per-token tensors (losses.custom_rl_terms states the contract) and returns the **sum** over
tokens of w_t * loss_t, attached to `logprobs`' graph; rollout divides it by the step's rl token count.
"""

from __future__ import annotations

import torch

from rollout_lib.losses import rl_loss_terms


def clipped_importance_pg(*, logprobs, inference_logprobs, advantages, weights, clip: float = 0.2):
    """PPO's clipped surrogate, -min(r A, clip(r, 1 - clip, 1 + clip) A), token by token, with its clip fraction."""
    ratio = torch.exp(logprobs - inference_logprobs)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip, 1 + clip) * advantages)
    member = weights != 0
    clipped = ((ratio < 1 - clip) | (ratio > 1 + clip)) & member
    fraction = float(clipped.sum()) / max(int(member.sum()), 1)
    return -(weights * surrogate).sum(), {"clip_fraction": fraction}


def the_built_in_one(*, logprobs, inference_logprobs, advantages, weights, **settings):
    """rollout's own rl numerator, called through the custom path: it must train exactly as type = "default"."""
    numerator, _ = rl_loss_terms(logprobs, inference_logprobs, advantages, weights, **settings)
    return numerator


def a_mean_per_token(*, logprobs, inference_logprobs, advantages, weights):
    """Wrong on purpose: per-token values, not their sum."""
    return -(weights * logprobs * advantages)
