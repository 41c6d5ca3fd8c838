"""Preference pairs as model inputs: tokenized once, collated per step (chosen rows first, then rejected)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import torch

from rollout_lib import wire
from rollout_lib.model.reward import pad_right, reward_scores
from rollout_lib.rm.heads import DEFAULT_HEAD, pair_inputs


def tokenize_pairs(pairs: pa.Table, tokenizer, max_seq_len: int, head: str = DEFAULT_HEAD) -> pa.Table:
    rows = pairs.to_pydict()
    inputs = [pair_inputs(head, tokenizer, p, c, r, max_seq_len)
              for p, c, r in zip(rows["prompt"], rows["chosen"], rows["rejected"])]
    chosen, rejected = [pair[0] for pair in inputs], [pair[1] for pair in inputs]
    return pa.Table.from_pydict(
        {"chosen_input_ids": chosen, "rejected_input_ids": rejected, "margin": rows["margin"],
         "source_line": rows["source_line"]},
        schema=wire.TOKENIZED_PAIRS,
    )


@dataclass
class PairBatch:
    input_ids: torch.Tensor  # [2B, T]: chosen rows first, then rejected rows
    attention_mask: torch.Tensor
    margin: torch.Tensor | None
    size: int


def collate_pairs(tokenized: pa.Table | dict[str, list], rows: list[int], pad_token_id: int) -> PairBatch:
    """The batch of pairs `rows` of a TOKENIZED_PAIRS table, or of its columns as Python lists (`to_pydict()`,
    done once: per step, arrow's take + to_pydict cost a tenth of a tiny model's step)."""
    columns = tokenized.to_pydict() if isinstance(tokenized, pa.Table) else tokenized
    chosen = [columns["chosen_input_ids"][row] for row in rows]
    rejected = [columns["rejected_input_ids"][row] for row in rows]
    input_ids, attention_mask = pad_right(chosen + rejected, pad_token_id)
    margins = [columns["margin"][row] for row in rows]
    margin = None
    if any(m is not None for m in margins):
        margin = torch.tensor([m or 0.0 for m in margins], dtype=torch.float32)
    return PairBatch(input_ids, attention_mask, margin, len(rows))


def forward_pairs(model, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards of the chosen responses, rewards of the rejected ones)."""
    rewards = reward_scores(model, batch.input_ids, batch.attention_mask)
    return rewards[: batch.size], rewards[batch.size:]
