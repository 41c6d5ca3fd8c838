"""Behaviour logprobs recomputed by the trainer: the importance ratio's denominator, made bit-stable.

The rl component's importance ratio is π_θ(token) / π_behaviour(token), where π_behaviour is the policy the token
was sampled from. A sampler reports that logprob itself, but an engine's report is not bit-stable: vLLM's
logprobs of the same tokens vary by ~1e-5 with batch composition (../shared/notes/serving.md), so a step
re-sampled after a kill would train on other bits and a resumed run would end on another checkpoint. Here the
trainer recomputes them instead: one forward of every policy-sampled sample under the weights it was sampled from
(the sampling state, which the run holds or rebuilds bit-exactly from the store), in fixed chunks in row order, so
the same rollouts always give the same bits. It also makes off-policy steps exact: with `max_off_policy_steps`
> 0 the ratio is against the stale sampling state, as it should be, whatever the engine reported.

The sampler's own logprobs are kept as a diagnostic: `behaviour/sampler_diff_max` and `behaviour/sampler_kl`
(mean of r - 1 - log r, r = recomputed / reported) say how far the engine's numbers are from the trainer's; a
large value means the server did not hold the weights it claimed, or sampled with other settings (top_p), or an
engine in lower precision (bf16) whose mismatch a correction would weigh: `behaviour/sampler_ratio_max`,
`..._over_cap_fraction` and `..._outside_band_fraction` say what a correction at its defaults would cut or drop.

Only tokens the policy sampled are replaced (`loss_mask`, on rows whose `sampled_from` is the sampling state);
rollouts of frozen models keep their sampler's logprobs (those are the behaviour policy, and no trainer holds it).

On-policy (`max_off_policy_steps = 0`) the recompute is work the math does not need: the state that sampled is
the state the step trains from, so the training forward computes the very same logprobs (TRL's GRPO takes its
`old_per_token_logps` the same way at one iteration per batch). `behaviour_logprobs = "training_forward"` marks
those tokens NaN instead (`mark_training_forward`), and the loss takes its own forward's detached logprobs there
(losses.component_loss): the ratio is exactly 1, no token is outside the trust region, the KL term is 0, and the
gradient is that of the recompute path up to the float rounding between a padded no-grad batch and the packed
training batch. Bit-stable like the recompute (the training forward is deterministic), one forward a step cheaper.
What it gives up: the behaviour/sampler_* diagnostics (nothing recomputes the engine's numbers; the reload probe
still checks the engine's weights).

Off-policy (`max_off_policy_steps` > 0) and streamed, a step's sample stage computes these chunks itself as their
rows come in, beside sampling (rl/behaviour_stream.py), and the recompute here adopts each chunk it finds done: the
same rows, the same inputs, the same forward (`chunk_logprobs`), so the same bits. A chunk not found is computed
here, as before.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import blake3
import numpy as np
import pyarrow as pa
import torch

from rollout_lib import wire
from rollout_lib.algo.stamping import training_sample_sources
from rollout_lib.packing import token_logprobs
from rollout_lib.rl_losses.correction import sampler_report_diagnostics

CHUNK_ROWS = 8  # samples per forward: fixed, so the bits never depend on how many samples a step has


@dataclass(frozen=True)
class ForwardInputs:
    """What the forward reads of one sample: its tokens, which of them are read (`loss_mask`), and the
    temperature each was sampled at."""

    input_ids: list[int]
    loss_mask: list[bool]
    temperatures: list[float]

    @classmethod
    def of(cls, input_ids: list[int], loss_mask: list[bool], temperatures: list[float] | None) -> "ForwardInputs":
        """From a TRAINING_SAMPLES row's streams (null temperatures: 1.0 on every token)."""
        return cls(input_ids, loss_mask, temperatures or [1.0] * len(input_ids))

    def digest(self) -> str:
        """blake3 of the inputs as the forward sees them: a chunk computed elsewhere is adopted only on these."""
        hasher = blake3.blake3()
        for array in (np.asarray(self.input_ids, dtype=np.int64), np.asarray(self.loss_mask, dtype=bool),
                      np.asarray(self.temperatures, dtype=np.float32)):
            hasher.update(len(array).to_bytes(8, "little"))
            hasher.update(array.tobytes())
        return hasher.hexdigest()


def chunk_logprobs(model, chunk: list[ForwardInputs], pad_token_id: int = 0) -> list[list[float]]:
    """One chunk's forward (at most CHUNK_ROWS samples, in row order): each sample's per-token logprobs under
    `model`, wherever it runs (here, or while the step samples)."""
    return _forward(model, [inputs.input_ids for inputs in chunk], [inputs.temperatures for inputs in chunk],
                    [inputs.loss_mask for inputs in chunk], pad_token_id)


def recompute_behaviour_logprobs(samples: pa.Table, rollouts: pa.Table, load_model: Callable[[], object],
                                 state_id: str, pad_token_id: int = 0,
                                 precomputed: pa.Table | None = None,
                                 keep_sampler: bool = False) -> tuple[pa.Table, dict]:
    """TRAINING_SAMPLES `samples` (one row per row of `rollouts`) with `inference_logprobs` recomputed by the policy
    at `state_id` (`load_model()`, called only if a chunk is left to compute) on every row sampled from that state;
    and the diagnostics above. `precomputed`: chunks computed while the step sampled (wire.BEHAVIOUR_LOGPROBS),
    adopted instead of computed: `behaviour/precomputed_rows` counts their rows, `behaviour/recompute_s` is the
    time the chunks computed here took. `keep_sampler`: those rows keep what they carried before (the sampler's
    report) as `sampler_logprobs`, for a mismatch correction (rl_losses/correction.py)."""
    rows = _rows_sampled_from(samples, rollouts, state_id)
    inference = samples.column("inference_logprobs").to_pylist()
    if not rows:
        return samples, {"behaviour/recomputed": 0}
    if keep_sampler:
        samples = _with_sampler_logprobs(samples, rows, inference)
    input_ids = samples.column("input_ids").to_pylist()
    loss_mask = samples.column("loss_mask").to_pylist()
    temperatures = samples.column("temperatures").to_pylist()
    sample_ids = samples.column("sample_id").to_pylist()
    ready = precomputed_chunks(precomputed) if precomputed is not None else {}

    recomputed, adopted, seconds = {}, 0, 0.0
    for index, chunk in enumerate(_chunks(rows, rollouts.num_rows)):
        inputs = [ForwardInputs.of(input_ids[row], loss_mask[row], temperatures[row]) for row in chunk]
        values = _adopted(ready.get(index), index, chunk, [sample_ids[row] for row in chunk], inputs)
        if values is None:
            started = time.perf_counter()
            values = chunk_logprobs(load_model(), inputs, pad_token_id)
            seconds += time.perf_counter() - started
        else:
            adopted += len(chunk)
        recomputed.update(zip(chunk, values))

    log_ratios = []
    for row, values in recomputed.items():
        updated = list(inference[row])
        for position, member in enumerate(loss_mask[row]):
            if member:
                reported, mine = updated[position], float(values[position])
                log_ratios.append(mine - reported)
                updated[position] = mine
        inference[row] = updated
    samples = _with_inference_logprobs(samples, inference)
    metrics = {"behaviour/recomputed": len(rows), "behaviour/precomputed_rows": adopted,
               "behaviour/recompute_s": seconds, **sampler_metrics(log_ratios)}
    return samples, metrics


def sampler_metrics(log_ratios: list[float]) -> dict[str, float]:
    """`behaviour/sampler_*` over tokens whose trainer logprob (π_old) and sampler's report are both known
    (log_ratios: π_old - report each): the largest and mean |difference|, and the correction's diagnostics
    (rl_losses/correction.py `sampler_report_diagnostics`: kl, ratio_max, what a default cap or band would cut)."""
    diffs = np.abs(np.asarray(log_ratios, dtype=np.float64))
    diagnostics = {"kl": 0.0, **sampler_report_diagnostics(log_ratios)}
    return {"behaviour/sampler_diff_max": float(diffs.max()) if len(diffs) else 0.0,
            "behaviour/sampler_diff_mean": float(diffs.mean()) if len(diffs) else 0.0,
            **{f"behaviour/sampler_{name}": value for name, value in diagnostics.items()}}


def mark_training_forward(samples: pa.Table, rollouts: pa.Table, state_id: str,
                          keep_sampler: bool = False) -> tuple[pa.Table, dict]:
    """TRAINING_SAMPLES `samples` with `inference_logprobs` NaN on every token the policy sampled (`loss_mask`) on
    rows sampled from `state_id`, the state the step trains from: the trainer takes its own forward's there.
    `keep_sampler`: as for `recompute_behaviour_logprobs`."""
    rows = set(_rows_sampled_from(samples, rollouts, state_id))
    if not rows:
        return samples, {"behaviour/training_forward": 0}
    inference = samples.column("inference_logprobs").to_pylist()
    if keep_sampler:
        samples = _with_sampler_logprobs(samples, sorted(rows), inference)
    loss_mask = samples.column("loss_mask").to_pylist()
    for row in rows:
        inference[row] = [math.nan if member else value for member, value in zip(loss_mask[row], inference[row])]
    return _with_inference_logprobs(samples, inference), {"behaviour/training_forward": len(rows)}


def precomputed_chunks(table: pa.Table) -> dict[int, list[dict]]:
    """BEHAVIOUR_LOGPROBS rows by chunk index, each chunk's rows in row order."""
    chunks: dict[int, list[dict]] = {}
    for record in table.to_pylist():
        chunks.setdefault(record["chunk"], []).append(record)
    return {index: sorted(records, key=lambda record: record["row"]) for index, records in chunks.items()}


def _adopted(found: list[dict] | None, index: int, chunk: list[int], sample_ids: list[str],
             inputs: list[ForwardInputs]) -> list[list[float]] | None:
    """A precomputed chunk's values, if it was computed; one computed over other rows or inputs than the recompute
    would run is a bug in how a streamed step maps rollouts to rows, and fails loudly."""
    if found is None:
        return None
    expected = [(row, sample_id, item.digest()) for row, sample_id, item in zip(chunk, sample_ids, inputs)]
    if [(record["row"], record["sample_id"], record["inputs_digest"]) for record in found] != expected:
        raise AssertionError(f"behaviour logprobs computed while sampling: chunk {index} was computed over rows "
                             f"{[(record['row'], record['sample_id']) for record in found]}, the recompute's are "
                             f"{list(zip(chunk, sample_ids))} (or over other tokens)")
    return [record["logprobs"] for record in found]


def _rows_sampled_from(samples: pa.Table, rollouts: pa.Table, state_id: str) -> list[int]:
    """The training samples' rows whose rollout was sampled from `state_id` (a split agent episode's earlier
    sequences after every rollout's row: algo.stamping.training_sample_sources)."""
    sampled_from = rollouts.column("sampled_from").to_pylist()
    sources = training_sample_sources(rollouts)
    if len(sources) != samples.num_rows:
        raise ValueError(f"{samples.num_rows} training samples for {len(sources)} sequences of "
                         f"{len(sampled_from)} rollouts")
    return [row for row, source in enumerate(sources) if sampled_from[source] == state_id]


def _chunks(rows: list[int], rollout_rows: int) -> list[list[int]]:
    """`rows` in chunks of CHUNK_ROWS in row order, the rollouts' own rows apart from earlier sequences' (those
    after them), so a chunk the sample stage computed over rollouts (behaviour_stream.py) is met as it was."""
    own = [row for row in rows if row < rollout_rows]
    earlier = [row for row in rows if row >= rollout_rows]
    return [part[start:start + CHUNK_ROWS] for part in (own, earlier) for start in range(0, len(part), CHUNK_ROWS)]


def _with_sampler_logprobs(samples: pa.Table, rows: list[int], reported: list) -> pa.Table:
    """`samples` whose `rows` carry `reported` (the behaviour stream as the sampler gave it, before it is
    replaced) as their `sampler_logprobs`; the other rows keep theirs."""
    index = samples.schema.get_field_index(wire.SAMPLER_LOGPROBS)
    kept = samples.column(index).to_pylist()
    for row in rows:
        kept[row] = list(reported[row])
    return samples.set_column(index, samples.schema.field(index), pa.array(kept, type=samples.schema.field(index).type))


def _with_inference_logprobs(samples: pa.Table, inference: list) -> pa.Table:
    index = samples.schema.get_field_index("inference_logprobs")
    return samples.set_column(index, samples.schema.field(index),
                              pa.array(inference, type=samples.schema.field(index).type))


@torch.no_grad()
def _forward(model, sequences: list[list[int]], temperatures: list[list[float]], masks: list[list[bool]],
             pad_token_id: int) -> list[list]:
    """Per-token logprobs of each sequence (position t: log p(token t | tokens before it); 0.0 at t = 0 and where
    `masks` is false: only those are read) under `model` in eval mode, as a right-padded batch."""
    device = next(model.parameters()).device
    lengths = [len(ids) for ids in sequences]
    width = max(lengths)
    batch = {
        "input_ids": torch.full((len(sequences), width), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(sequences), width), dtype=torch.long),
        "position_ids": torch.zeros((len(sequences), width), dtype=torch.long),
    }
    for row, ids in enumerate(sequences):
        batch["input_ids"][row, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        batch["attention_mask"][row, :len(ids)] = 1
        batch["position_ids"][row, :len(ids)] = torch.arange(len(ids))
    batch = {name: tensor.to(device) for name, tensor in batch.items()}
    batch["temperatures"] = torch.as_tensor(np.concatenate([np.asarray(t, dtype=np.float32) for t in temperatures]),
                                            device=device)
    was_training = model.training
    model.eval()
    try:
        needed = torch.as_tensor(np.concatenate([np.asarray(mask, dtype=bool) for mask in masks]), device=device)
        flat = token_logprobs(model, batch, needed=needed).float().cpu()
    finally:
        model.train(was_training)
    return [part.tolist() for part in torch.split(flat, lengths)]
