"""The reward-model trainer: one optimizer step per planned minibatch of pairs, on its head's loss (rm/heads.py).

Deterministic on CPU: the batch plan derives from the seed, each step seeds dropout from (seed, step), and the
learning rate is a function of the step, so a run restored from a snapshot replays exactly what an uninterrupted
run computed (on CUDA, see docs/hardware.md). Its inputs' data id is `tokenized` (wire.TOKENIZED_PAIRS); each
step's pairs follow from the seed (`determinism.step_rows`), not from the run's length.
"""

from __future__ import annotations

import functools
import time

import torch

from rollout_lib import wire
from rollout_lib.losses import pair_metrics
from rollout_lib.model.loading import load_reward_model
from rollout_lib.rm.heads import DEFAULT_HEAD, pair_loss
from rollout_lib.rm.pairs import collate_pairs, forward_pairs
from rollout_lib.trainer.base import CheckpointedTrainer, NonFiniteLossError, TrainingInputs
from rollout_lib.determinism import step_rows
from rollout_lib.trainer.optim import clip_gradients
from rollout_lib.trainer.sharding import is_sharded


class RewardModelTrainer(CheckpointedTrainer):
    kind_of_model = "reward_model"

    @classmethod
    def load_model(cls, resolved, inputs: TrainingInputs, hardware):
        return load_reward_model(resolved)

    def manifest_facts(self) -> dict:
        # A pairwise head's model compares two responses: readers of a scalar reward refuse it. Absent at the
        # default, so checkpoint ids from before the setting stay.
        head = self.inputs.settings.head
        return {} if head == DEFAULT_HEAD else {"reward_head": head}

    @functools.cached_property
    def pairs(self) -> dict[str, list]:
        """The tokenized pairs' columns as Python lists, read once."""
        return self.inputs.store.get_table(self.inputs.data_ids["tokenized"], wire.TOKENIZED_PAIRS).to_pydict()

    def run_step(self, step: int) -> dict[str, float]:
        """One step over the step's pairs. Data-parallel (`self.data_parallel`), a rank trains pairs
        rank, rank + N, ... and scales its batch mean by its share of the step's pairs, so the summed gradients are
        those of the step's mean (a rank without a pair runs one pair scaled by zero); metrics are the step's."""
        settings = self.inputs.settings
        started = time.perf_counter()
        rows = step_rows(len(self.pairs["margin"]), settings.minibatch_size, self.inputs.config.run.seed, step)
        share = 1.0
        if self.data_parallel is not None:
            mine = self.data_parallel.share_rows(rows)
            share = len(mine) / len(rows)
            rows = mine or rows[:1]  # nothing to train: a pair still runs forward and backward, scaled by zero
        batch = collate_pairs(self.pairs, rows, self.tokenizer.pad_token_id)
        if not self.model.training:  # a no-op walk over every module costs ~1 ms a step on a tiny model
            self.model.train()
        r_chosen, r_rejected = forward_pairs(self.model, batch)
        margin = batch.margin.to(r_chosen.device) if batch.margin is not None else None
        loss = pair_loss(settings.head, r_chosen, r_rejected, margin, settings.center_rewards_coefficient)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"loss is {loss.item()} (non-finite); weights not updated")
        if self.data_parallel is not None:
            loss = loss * share
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.data_parallel is not None and not is_sharded(self.model):  # FSDP reduce-scattered them already
            self.data_parallel.sum_gradients(self.model.parameters())
        grad_norm = clip_gradients(self.model.parameters(), settings.optimizer.max_grad_norm)
        if not torch.isfinite(grad_norm):
            raise NonFiniteLossError(f"gradient norm is {grad_norm.item()}; weights not updated")
        self.optimizer.step()
        metrics = {"loss": loss.item(), **pair_metrics(r_chosen.detach(), r_rejected.detach())}
        if self.data_parallel is not None:  # this rank's share -> the step's: pair means weighted by pair counts
            pairs = metrics["pairs"] if share else 0
            summed = self.data_parallel.sum_numbers({"loss": metrics["loss"], "pairs": pairs,
                                                     "accuracy": metrics["accuracy"] * pairs,
                                                     "mean_margin": metrics["mean_margin"] * pairs})
            metrics = {"loss": summed["loss"], "accuracy": summed["accuracy"] / summed["pairs"],
                       "mean_margin": summed["mean_margin"] / summed["pairs"], "pairs": int(summed["pairs"])}
        elapsed = time.perf_counter() - started
        return {
            **metrics,
            "grad_norm": grad_norm.item(),
            "pairs_per_s": metrics["pairs"] / elapsed,
        }
