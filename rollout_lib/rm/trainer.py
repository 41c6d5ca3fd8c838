"""The reward-model trainer: one Bradley-Terry optimizer step per planned minibatch of pairs.

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
from rollout_lib.losses import bradley_terry_batch_mean, pair_metrics
from rollout_lib.model.loading import load_reward_model, load_tokenizer, resolve_model
from rollout_lib.rm.pairs import collate_pairs, forward_pairs
from rollout_lib.trainer.base import CheckpointedTrainer, NonFiniteLossError, TrainingInputs
from rollout_lib.trainer.determinism import step_rows
from rollout_lib.trainer.hardware import hardware_of_config, place_model
from rollout_lib.trainer.optim import build_optimizer, clip_gradients


class RewardModelTrainer(CheckpointedTrainer):
    kind_of_model = "reward_model"

    @classmethod
    def build(cls, inputs: TrainingInputs):
        hardware = hardware_of_config(inputs.config)
        hardware.use_deterministic_kernels(inputs.config.run.torch_threads)
        resolved = resolve_model(inputs.settings.base_model)
        tokenizer = load_tokenizer(resolved)
        torch.manual_seed(inputs.config.run.seed)  # the new score head is initialised from the run's seed
        model = load_reward_model(resolved)
        model.config.pad_token_id = tokenizer.pad_token_id
        place_model(model, hardware, trainable=True)  # before the optimizer: it holds the placed parameters
        optimizer = build_optimizer(model.parameters(), inputs.settings.optimizer)
        return model, tokenizer, optimizer

    @functools.cached_property
    def pairs(self) -> dict[str, list]:
        """The tokenized pairs' columns as Python lists, read once."""
        return self.inputs.store.get_table(self.inputs.data_ids["tokenized"], wire.TOKENIZED_PAIRS).to_pydict()

    def run_step(self, step: int) -> dict[str, float]:
        settings = self.inputs.settings
        started = time.perf_counter()
        rows = step_rows(len(self.pairs["margin"]), settings.minibatch_size, self.inputs.config.run.seed, step)
        batch = collate_pairs(self.pairs, rows, self.tokenizer.pad_token_id)
        if not self.model.training:  # a no-op walk over every module costs ~1 ms a step on a tiny model
            self.model.train()
        r_chosen, r_rejected = forward_pairs(self.model, batch)
        margin = batch.margin.to(r_chosen.device) if batch.margin is not None else None
        loss = bradley_terry_batch_mean(r_chosen, r_rejected, margin, settings.center_rewards_coefficient)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"loss is {loss.item()} (non-finite); weights not updated")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = clip_gradients(self.model.parameters(), settings.optimizer.max_grad_norm)
        if not torch.isfinite(grad_norm):
            raise NonFiniteLossError(f"gradient norm is {grad_norm.item()}; weights not updated")
        self.optimizer.step()
        elapsed = time.perf_counter() - started
        return {
            "loss": loss.item(),
            **pair_metrics(r_chosen.detach(), r_rejected.detach()),
            "grad_norm": grad_norm.item(),
            "pairs_per_s": batch.size / elapsed,
        }
