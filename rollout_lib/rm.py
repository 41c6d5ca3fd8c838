"""Bradley-Terry reward-model training on pairs: tokenization, the batch plan, the train step, evaluation.

Everything here is deterministic on CPU: the batch plan derives from the seed, each step seeds dropout from
(seed, step), and the learning rate is a function of the step, so a run restored from a snapshot replays
exactly what an uninterrupted run computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyarrow as pa
import torch

from rollout_lib import wire
from rollout_lib.config.rm import RmConfig
from rollout_lib.losses import bradley_terry_batch_mean, pair_metrics
from rollout_lib.model.loading import load_reward_model, load_tokenizer, resolve_model
from rollout_lib.model.reward import encode_prompt_response, pad_right, reward_scores
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import CheckpointedTrainer, NonFiniteLossError
from rollout_lib.trainer.determinism import plan_batches, seed_for_step, use_deterministic_torch  # noqa: F401
from rollout_lib.trainer.optim import build_optimizer, clip_gradients


def tokenize_pairs(pairs: pa.Table, tokenizer, max_seq_len: int) -> pa.Table:
    rows = pairs.to_pydict()
    chosen = [encode_prompt_response(tokenizer, p, c, max_seq_len) for p, c in zip(rows["prompt"], rows["chosen"])]
    rejected = [encode_prompt_response(tokenizer, p, r, max_seq_len)
                for p, r in zip(rows["prompt"], rows["rejected"])]
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


def collate_pairs(tokenized: pa.Table, rows: list[int], pad_token_id: int) -> PairBatch:
    picked = tokenized.take(rows).to_pydict()
    input_ids, attention_mask = pad_right(picked["chosen_input_ids"] + picked["rejected_input_ids"], pad_token_id)
    margins = picked["margin"]
    margin = None
    if any(m is not None for m in margins):
        margin = torch.tensor([m or 0.0 for m in margins], dtype=torch.float32)
    return PairBatch(input_ids, attention_mask, margin, len(rows))


def forward_pairs(model, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = reward_scores(model, batch.input_ids, batch.attention_mask)
    return rewards[: batch.size], rewards[batch.size:]


@dataclass
class RmRun:
    """Content ids and settings that define a run; everything a trainer needs to (re)build itself."""

    store: ObjectStore
    config: RmConfig
    settings_hash: str
    tokenized_id: str
    plan_id: str


class RewardModelTrainer(CheckpointedTrainer):
    kind_of_model = "reward_model"
    timing_metrics = frozenset({"pairs_per_s"})

    @classmethod
    def build(cls, run: RmRun):
        use_deterministic_torch()
        resolved = resolve_model(run.config.settings.base_model)
        tokenizer = load_tokenizer(resolved)
        torch.manual_seed(run.config.run.seed)  # the new score head is initialised from the run's seed
        model = load_reward_model(resolved)
        model.config.pad_token_id = tokenizer.pad_token_id
        optimizer = build_optimizer(model.parameters(), run.config.settings.optimizer)
        return model, tokenizer, optimizer

    def data_ids(self) -> dict[str, str]:
        return {"tokenized": self.run.tokenized_id, "plan": self.run.plan_id}

    # --- training -----------------------------------------------------------------------------------------

    @property
    def tokenized(self) -> pa.Table:
        return self.table(self.run.tokenized_id, wire.TOKENIZED_PAIRS)

    @property
    def plan(self) -> pa.Table:
        return self.table(self.run.plan_id, wire.BATCH_PLAN)

    def run_step(self, step: int) -> dict[str, float]:
        settings = self.run.config.settings
        started = time.perf_counter()
        rows = self.plan.column("row_indices")[step - 1].as_py()
        batch = collate_pairs(self.tokenized, rows, self.tokenizer.pad_token_id)
        self.model.train()
        r_chosen, r_rejected = forward_pairs(self.model, batch)
        loss = bradley_terry_batch_mean(r_chosen, r_rejected, batch.margin, settings.center_rewards_coefficient)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"train step {step}: loss is {loss.item()} (non-finite); weights not updated")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = clip_gradients(self.model.parameters(), settings.optimizer.max_grad_norm)
        if not torch.isfinite(grad_norm):
            raise NonFiniteLossError(f"train step {step}: gradient norm is {grad_norm.item()}; weights not updated")
        self.optimizer.step()
        elapsed = time.perf_counter() - started
        return {
            "loss": loss.item(),
            **pair_metrics(r_chosen.detach(), r_rejected.detach()),
            "grad_norm": grad_norm.item(),
            "pairs_per_s": batch.size / elapsed,
        }


@torch.no_grad()
def evaluate_pairs(model, tokenized: pa.Table, pad_token_id: int, batch_size: int) -> dict[str, float]:
    """Held-out pair accuracy (r_chosen > r_rejected), mean reward margin and mean loss, dropout off."""
    model.eval()
    chosen, rejected = [], []
    for start in range(0, tokenized.num_rows, batch_size):
        rows = list(range(start, min(start + batch_size, tokenized.num_rows)))
        r_c, r_r = forward_pairs(model, collate_pairs(tokenized, rows, pad_token_id))
        chosen.append(r_c)
        rejected.append(r_r)
    r_c, r_r = torch.cat(chosen), torch.cat(rejected)
    return {**pair_metrics(r_c, r_r), "loss": bradley_terry_batch_mean(r_c, r_r).item(), "pairs": tokenized.num_rows}


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
