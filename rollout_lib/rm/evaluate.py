"""A reward model measured and used: held-out pair accuracy (with each pair's scores), and rewards of
(prompt, response) rows."""

from __future__ import annotations

import pyarrow as pa
import torch

from rollout_lib import wire
from rollout_lib.losses import bradley_terry_loss, pair_metrics
from rollout_lib.model.reward import encode_prompt_response, pad_right, reward_scores
from rollout_lib.rm.heads import DEFAULT_HEAD, pair_loss, pairwise_logistic_losses
from rollout_lib.rm.pairs import collate_pairs, forward_pairs


@torch.no_grad()
def evaluate_pairs(model, tokenized: pa.Table, pad_token_id: int, batch_size: int,
                   head: str = DEFAULT_HEAD) -> dict[str, float]:
    """Held-out pair accuracy (r_chosen > r_rejected), mean reward margin and mean loss, dropout off."""
    return evaluate_pairs_with_rows(model, tokenized, pad_token_id, batch_size, head)[0]


@torch.no_grad()
def evaluate_pairs_with_rows(model, tokenized: pa.Table, pad_token_id: int, batch_size: int,
                             head: str = DEFAULT_HEAD) -> tuple[dict[str, float], pa.Table]:
    """`evaluate_pairs`'s metrics and the pairs they average, one wire.RM_EVAL_ROWS row per pair. With the
    pairwise_logistic head r_chosen / r_rejected are the logits of the chosen-first and rejected-first orders."""
    model.eval()
    chosen, rejected = [], []
    for start in range(0, tokenized.num_rows, batch_size):
        rows = list(range(start, min(start + batch_size, tokenized.num_rows)))
        r_c, r_r = forward_pairs(model, collate_pairs(tokenized, rows, pad_token_id))
        chosen.append(r_c)
        rejected.append(r_r)
    r_c, r_r = torch.cat(chosen), torch.cat(rejected)
    metrics = {**pair_metrics(r_c, r_r), "loss": pair_loss(head, r_c, r_r).item(), "pairs": tokenized.num_rows}
    return metrics, pair_rows(tokenized, r_c, r_r, head)


def pair_rows(tokenized: pa.Table, r_chosen: torch.Tensor, r_rejected: torch.Tensor,
              head: str = DEFAULT_HEAD) -> pa.Table:
    """Each pair's scores, margin, the head's loss (no margin term, as the evaluation's mean) and correctness."""
    r_chosen, r_rejected = r_chosen.double().cpu(), r_rejected.double().cpu()
    margin = r_chosen - r_rejected
    losses = (pairwise_logistic_losses(r_chosen, r_rejected) if head == "pairwise_logistic"
              else bradley_terry_loss(r_chosen, r_rejected))
    return pa.Table.from_pydict({
        "pair_index": list(range(tokenized.num_rows)), "source_line": tokenized.column("source_line"),
        "r_chosen": r_chosen.tolist(), "r_rejected": r_rejected.tolist(), "margin": margin.tolist(),
        "loss": losses.tolist(), "correct": (margin > 0).tolist(),
    }, schema=wire.RM_EVAL_ROWS)


@torch.no_grad()
def score_responses(model, tokenizer, responses: pa.Table, max_seq_len: int, batch_size: int = 32) -> pa.Table:
    model.eval()
    rows = responses.to_pydict()
    encoded = [encode_prompt_response(tokenizer, p, r, max_seq_len) for p, r in zip(rows["prompt"], rows["response"])]
    rewards: list[float] = []
    for start in range(0, len(encoded), batch_size):
        input_ids, attention_mask = pad_right(encoded[start:start + batch_size], tokenizer.pad_token_id)
        rewards.extend(reward_scores(model, input_ids, attention_mask).tolist())
    return responses.append_column(wire.SCORED_RESPONSES.field("reward"), pa.array(rewards, pa.float64()))
