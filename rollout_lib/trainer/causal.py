"""The causal-LM trainer of SFT and RL: one class, and the algorithm-blind optimizer step it runs.

`CausalLmTrainer` differs between SFT and RL only in where a step's micro-batches come from (`StepBatches`):
SFT plans every step's micro-batches before training (`PlannedBatches`), RL packs them step by step from fresh
rollouts (`RecordedBatches`).

One call is one optimizer step over the micro-batches of that step (wire.MICRO_BATCHES rows):

    N_c   = tokens with non-zero weight in component c over EVERY micro-batch of the step
    loss  = Σ_micro-batches Σ_c numerator_c(micro-batch) / N_c          (losses.component_loss)

Each micro-batch is collated (packed: one [1, T] row with per-sequence position ids; padded: [B, Tmax]), run
forward for per-token logprobs, and backpropagated on its own (gradient accumulation); because the
denominators are step-global, the accumulated gradient is the gradient of the mean over all loss tokens of
the step, not an average of micro-batch means. Then gradients are clipped and the optimizer steps once.

The step knows no algorithm: the per-token weight streams decide which tokens train which component (SFT ships
ce_weights, RL algorithms rl_weights / ref_kl_weights). A NaN/inf loss or gradient norm raises before the
optimizer steps, so the weights are untouched; with `skip_nonfinite` (RL) the step is skipped instead, counted by
the trainer's NonFiniteGuard (trainer/nonfinite.py), which fails the run after `loss.max_nonfinite_steps` in a row.
A micro-batch with no token in any component still runs forward and backward, on a graph-attached zero (a
zero-gradient no-op): with data parallelism every rank must issue the same collectives, whatever its micro-batches
hold. A step with no token at all does not move the optimizer.
The caller sets the learning rate and seeds the RNG (dropout) before calling.
"""

from __future__ import annotations

import functools
import time
from typing import Protocol

import pyarrow as pa
import torch

from rollout_lib import wire
from rollout_lib.losses import COMPONENTS, component_loss, count_component_tokens, count_rl_sequences, loss_tokens
from rollout_lib.model.loading import load_causal_lm
from rollout_lib.model.packed_attention import use_packed_attention
from rollout_lib.packing import check_micro_batches, collate_micro_batch, token_logprobs
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import CheckpointedTrainer, NonFiniteLossError, TrainingInputs
from rollout_lib.trainer.data_parallel import DataParallelRank
from rollout_lib.trainer.nonfinite import NonFiniteGuard, finite_metrics, first_nonfinite_gradient
from rollout_lib.trainer.optim import clip_gradients
from rollout_lib.trainer.sharding import is_sharded


def train_on_micro_batches(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: pa.Table,
    *,
    packed: bool,
    pad_token_id: int,
    max_grad_norm: float | None,
    loss_kwargs: dict | None = None,
    data_parallel: DataParallelRank | None = None,
    skip_nonfinite: bool = False,
) -> dict[str, float]:
    """One optimizer step over `micro_batches`; returns its metrics. `loss_kwargs`: the rl and ref_kl components'
    settings (`losses.component_loss`). `data_parallel`: this process is one rank of several; it trains its share
    of `micro_batches` (every rank is given the whole step), N_c and the gradients are summed over the ranks and
    the metrics are the step's, every rank's summed (trainer.data_parallel).

    Metrics: `loss` (the step's total) and `loss/<c>` per component, `tokens/<c>` (N_c), token-weighted
    component diagnostics (`rl/masked_fraction`, `ref_kl/kl`, ...), `grad_norm` (before clipping), `tokens`
    (real tokens run through the model), `positions` (including padding), `nonpad_fraction`, `micro_batches`
    (trained) and `tokens_per_s` (real tokens per second of forward, backward and optimizer step); a data-parallel
    filler counts in none of them.

    `skip_nonfinite`: a non-finite loss or gradient skips the optimizer step instead of raising; the metrics then
    hold `skipped_nonfinite = 1` and `nonfinite_tensor` (the first non-finite tensor's name, a str), and only their
    finite numbers. Every rank skips together (the decision is summed over the ranks).
    """
    started = time.perf_counter()
    check_micro_batches(micro_batches)
    if micro_batches.num_rows == 0:
        raise ValueError("an optimizer step needs at least one micro-batch")
    real = micro_batches.num_rows  # micro-batches of the step this process trains; after them, fillers
    if data_parallel is not None:
        real = len(data_parallel.share_rows(list(range(micro_batches.num_rows))))
        micro_batches = data_parallel.share(micro_batches)
    batches = [collate_micro_batch(row, packed=packed, pad_token_id=pad_token_id)
               for row in micro_batches.to_pylist()]
    local_counts = [count_component_tokens(batch) for batch in batches]
    counts = {c: sum(local[c] for local in local_counts) for c in COMPONENTS}
    if data_parallel is not None:
        counts = data_parallel.sum_counts(counts)
    if (loss_kwargs or {}).get("rl_normalizer") is not None:  # Dr. GRPO: N_rl = C · the step's rl sequences
        sequences = count_rl_sequences(*batches)
        if data_parallel is not None:
            sequences = int(data_parallel.sum_numbers({"rl_sequences": sequences})["rl_sequences"])
        counts = {**counts, "rl_sequences": sequences}

    metrics: dict[str, float] = {"loss": 0.0, **{f"loss/{c}": 0.0 for c in COMPONENTS},
                                 **{f"tokens/{c}": counts[c] for c in COMPONENTS}}
    weighted: dict[str, float] = {}  # component diagnostics, summed with their micro-batch's token count
    maxima: dict[str, float] = {}  # `*_max` diagnostics: the largest micro-batch's (this rank's, data-parallel)
    tokens = positions = ran = 0
    grad_norm = 0.0
    nonfinite: str | None = None  # the first non-finite tensor of this step (skip_nonfinite)
    if not model.training:  # a no-op walk over every module costs ~1 ms a step on a tiny model
        model.train()
    optimizer.zero_grad(set_to_none=True)
    try:
        for index, (batch, local) in enumerate(zip(batches, local_counts)):
            logprobs = token_logprobs(model, batch, needed=loss_tokens(batch))  # no logits for prompt tokens
            loss, parts = component_loss(logprobs, batch, counts, **(loss_kwargs or {}))
            if not torch.isfinite(loss):
                if not skip_nonfinite:
                    raise NonFiniteLossError(f"micro-batch {index}: loss is {loss.item()} (non-finite); "
                                             "weights not updated")
                # Still backward: every rank must issue the same collectives; the step is skipped below.
                nonfinite = nonfinite or f"loss of micro-batch {index} ({loss.item()})"
            loss.backward()
            if index < real:  # a filler's forward and backward are not work the step asked for
                ran += 1
                tokens += int(batch["sequence_lengths"].sum())
                positions += int(batch["input_ids"].numel())
            metrics["loss"] += parts.pop("loss/total")
            for name, value in parts.items():
                component, _, what = name.partition("/")
                if component == "loss":
                    metrics[name] += value
                elif what.endswith("_max"):  # a maximum over the step, not a token-weighted mean
                    maxima[name] = max(maxima.get(name, value), value)
                elif what != "tokens":
                    weighted[name] = weighted.get(name, 0.0) + value * local[_COUNTED_BY.get(component, component)]
        if any(counts.values()):
            if data_parallel is not None and not is_sharded(model):  # FSDP reduce-scattered them in backward
                data_parallel.sum_gradients(model.parameters())
            grad_norm = clip_gradients(model.parameters(), max_grad_norm)
            if not torch.isfinite(grad_norm) and not skip_nonfinite:
                raise NonFiniteLossError(f"gradient norm is {grad_norm.item()}; weights not updated")
            if skip_nonfinite:
                nonfinite = _skip_decision(model, nonfinite, grad_norm, data_parallel)
            grad_norm = grad_norm.item()
            if nonfinite is None:
                optimizer.step()
    finally:
        # On success the gradients are spent; on failure none may leak into the next attempt.
        optimizer.zero_grad(set_to_none=True)

    if data_parallel is not None:  # this rank's sums -> the step's (every rank has the same names)
        local = {name: value for name, value in metrics.items() if not name.startswith("tokens/")}
        summed = data_parallel.sum_numbers({**local, **{f"weighted:{n}": v for n, v in weighted.items()},
                                            "tokens": tokens, "positions": positions, "ran": ran})
        metrics.update({name: summed[name] for name in local})
        weighted = {name: summed[f"weighted:{name}"] for name in weighted}
        tokens, positions, ran = (int(summed[name]) for name in ("tokens", "positions", "ran"))
    elapsed = time.perf_counter() - started
    for name, total in weighted.items():
        component = name.partition("/")[0]
        metrics[name] = total / counts[_COUNTED_BY.get(component, component)]
    metrics.update(maxima)
    metrics.update({
        "grad_norm": grad_norm,
        "tokens": tokens,
        "positions": positions,
        "nonpad_fraction": tokens / positions if positions else 0.0,
        "micro_batches": ran,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
    })
    if nonfinite is not None:  # present only then: a finite step's metrics (in manifests) are as before the guard
        return {**finite_metrics(metrics), "skipped_nonfinite": 1, "nonfinite_tensor": nonfinite}
    return metrics


# Diagnostics that are not a component's own but are averaged over one's tokens (mismatch: the rl tokens).
_COUNTED_BY = {"mismatch": "rl"}


def _skip_decision(model: torch.nn.Module, nonfinite: str | None, grad_norm: torch.Tensor,
                   data_parallel: DataParallelRank | None) -> str | None:
    """What makes this step skip (the first non-finite tensor's name), or None to step. Ranks decide together: a
    rank whose own loss was non-finite skips every rank's step, even should its summed gradient look finite."""
    if nonfinite is None and not torch.isfinite(grad_norm):
        nonfinite = first_nonfinite_gradient(model.named_parameters()) or f"gradient norm ({grad_norm.item()})"
    if data_parallel is not None:
        skipping = data_parallel.sum_numbers({"nonfinite": float(nonfinite is not None)})["nonfinite"]
        if skipping and nonfinite is None:
            nonfinite = "another rank's loss or gradient"
    return nonfinite


# --- where a step's micro-batches come from ---------------------------------------------------------------------


class StepBatches(Protocol):
    def for_step(self, step: int) -> pa.Table:
        """wire.MICRO_BATCHES of optimizer step `step`."""
        ...


class PlannedBatches:
    """SFT: every step's micro-batches in one table, and a plan of which rows each step trains on."""

    def __init__(self, store: ObjectStore, micro_batches_id: str, plan_id: str):
        self.ids = (store, micro_batches_id, plan_id)

    @functools.cached_property
    def micro_batches(self) -> pa.Table:  # read on first use: a data-parallel segment reads it in its workers only
        store, micro_batches_id, _ = self.ids
        return store.get_table(micro_batches_id, wire.MICRO_BATCHES)

    @functools.cached_property
    def plan(self) -> pa.Table:
        store, _, plan_id = self.ids
        return store.get_table(plan_id, wire.BATCH_PLAN)

    def __reduce__(self):  # pickled as its ids (a data-parallel worker reloads the tables), never the tables
        return PlannedBatches, self.ids

    def for_step(self, step: int) -> pa.Table:
        return self.micro_batches.take(self.plan.column("row_indices")[step - 1].as_py())


class RecordedBatches:
    """RL: the micro-batches table id each step trains on, recorded as the pack stage produces them."""

    def __init__(self, store: ObjectStore, by_step: dict[int, str] | None = None):
        self.store = store
        self.by_step = dict(by_step or {})

    def record(self, step: int, micro_batches_id: str) -> None:
        self.by_step[step] = micro_batches_id

    def for_step(self, step: int) -> pa.Table:
        if step not in self.by_step:
            raise RuntimeError(f"no micro-batches recorded for step {step}")
        return self.store.get_table(self.by_step[step], wire.MICRO_BATCHES)


# --- the trainer ----------------------------------------------------------------------------------------------


class CausalLmTrainer(CheckpointedTrainer):
    """A causal LM trained one optimizer step at a time on `batches.for_step(step)`.

    Its settings (SftSettings or RlSettings) give `base_model`, `optimizer`, `budget`, `packed` and
    `loss_kwargs()` (the rl/ref_kl loss settings; none for SFT). Packed micro-batches run per-sequence attention
    (`model.packed_attention`). The model computes on the settings' `hardware` (hardware.py)."""

    kind_of_model = "causal_lm"

    def __init__(self, *args, batches: StepBatches | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches = batches
        loss = getattr(self.inputs.settings, "loss", None)  # RL's; SFT has none and raises on a non-finite step
        self.nonfinite_guard = NonFiniteGuard(loss.max_nonfinite_steps) if loss is not None else None

    @classmethod
    def load_model(cls, resolved, inputs: TrainingInputs, hardware):
        model = load_causal_lm(resolved)
        if inputs.settings.packed and hardware.device.type == "cpu":
            # Attention per packed sequence, without the masked-out blocks: a CPU's win (one small SDPA per
            # sequence). On a GPU those many small kernels are launch-bound: transformers' sdpa over the row's
            # block-diagonal mask ran the rl-smollm2 step 3.9x faster on an H200 (docs/hardware.md, "On a GPU").
            use_packed_attention(model)
        return model

    def run_step(self, step: int) -> dict[str, float]:
        if self.batches is None:
            raise RuntimeError("this trainer was given no micro-batches to train on")
        settings = self.inputs.settings
        metrics = train_on_micro_batches(
            self.model, self.optimizer, self.batches.for_step(step), packed=settings.packed,
            pad_token_id=self.tokenizer.pad_token_id, max_grad_norm=settings.optimizer.max_grad_norm,
            loss_kwargs=settings.loss_kwargs(), data_parallel=self.data_parallel,
            skip_nonfinite=self.nonfinite_guard is not None,
        )
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.after_step(step, metrics.pop("nonfinite_tensor", None))
        return metrics
