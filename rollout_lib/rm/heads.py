"""The RM's heads (`algorithm.rm.head`): how a preference pair becomes the model's two inputs, and the loss on their
two scores. The model is the same sequence classifier with one scalar output either way.

- `bradley_terry` (default, seed 000): each response scored alone, r = f(prompt, response);
  L = -ln σ(r_chosen - r_rejected - margin). Its score of one response is a reward.
- `pairwise_logistic` (seed 000 names it and defers it to when the RL pipeline lands; our reading, the seed gives
  no formula): a pairwise preference model. It reads the prompt with both responses, s = f(prompt, A, B) is the
  logit of P(A ≻ B), and it is trained by logistic regression on both orders of each pair:
  L = ½ [-ln σ(s(chosen, rejected)) - ln σ(-s(rejected, chosen))], so it cannot learn "the first one wins".
  It compares two responses and has no score of one alone: its checkpoints are refused where a scalar reward is
  read. A pair's margin is not used (the logit is not a reward gap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout_lib.losses import bradley_terry_batch_mean
from rollout_lib.model.reward import encode_prompt_response

DEFAULT_HEAD = "bradley_terry"


def pair_inputs(head: str, tokenizer, prompt: str, chosen: str, rejected: str,
                max_seq_len: int) -> tuple[list[int], list[int]]:
    """The pair's two inputs, in TOKENIZED_PAIRS' chosen/rejected columns: the responses alone (bradley_terry), or
    the two orders of the joint input, chosen first then rejected first (pairwise_logistic)."""
    if head == "pairwise_logistic":
        return (encode_prompt_response(tokenizer, prompt, joint_response(chosen, rejected), max_seq_len),
                encode_prompt_response(tokenizer, prompt, joint_response(rejected, chosen), max_seq_len))
    return (encode_prompt_response(tokenizer, prompt, chosen, max_seq_len),
            encode_prompt_response(tokenizer, prompt, rejected, max_seq_len))


def joint_response(first: str, second: str) -> str:
    return f"Response A:\n{first}\n\nResponse B:\n{second}"


def pair_loss(head: str, r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None,
              center_rewards_coefficient: float = 0.0) -> torch.Tensor:
    """The batch mean of the head's loss on the two scores of each pair (collated by rm.pairs)."""
    if head == "pairwise_logistic":
        if r_chosen.numel() == 0:
            return (r_chosen.sum() + r_rejected.sum()) * 0.0  # exactly 0, still on the graph
        return pairwise_logistic_losses(r_chosen, r_rejected).mean()
    return bradley_terry_batch_mean(r_chosen, r_rejected, margin, center_rewards_coefficient)


def pairwise_logistic_losses(s_chosen_first: torch.Tensor, s_rejected_first: torch.Tensor) -> torch.Tensor:
    """Per pair: ½ [-ln σ(s(chosen, rejected)) - ln σ(-s(rejected, chosen))]."""
    return 0.5 * (F.softplus(-s_chosen_first) + F.softplus(s_rejected_first))
