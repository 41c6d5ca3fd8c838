"""Training samples -> micro-batches, and micro-batches -> model inputs and per-token logprobs.

Three steps, each with one job:

- `pack_samples` (packing on) bins TRAINING_SAMPLES rows into MICRO_BATCHES rows of at most `max_seq_len`
  tokens with best-fit-decreasing, no padding; `batch_unpacked` (packing off) groups a fixed number of
  consecutive samples per row. Both materialise null streams with TRAINING_SAMPLE_DEFAULTS and enforce the
  alignment invariant: every per-token column of every micro-batch has exactly `len(input_ids)` entries.
  A violation raises here, so a misaligned stream can never train silently; so does a sample in a component
  that lacks a stream the component's loss reads (rl tokens without advantages: wire.REQUIRED_STREAMS).
- `collate_micro_batch` turns one MICRO_BATCHES row into tensors, packed ([1, T] with per-sequence
  position ids) or padded ([B, Tmax] with an attention mask). Per-token streams come back flat, [T], in the
  same order for both layouts, so losses never need to know the layout.
- `token_logprobs` runs a causal LM on either layout and returns one logprob per real token, [T], aligned
  with those streams.

Token convention (the one fact every loss relies on): a stream value at position t refers to token
`input_ids[t]` as a prediction target, and `token_logprobs(...)[t] = log p(input_ids[t] | the tokens before t
in the same sequence)`. The first token of a sequence has no prediction: its logprob is 0.0
(`FIRST_TOKEN_LOGPROB`) and its weights (`WEIGHT_COLUMNS`) must be zero; the packer rejects a sample that
puts weight there.

Shared prefixes (`pack_samples(..., share_prefixes=True)`, RL's `algorithm.rl.share_prompt_prefix`): the first
sample of a group is stored whole and every later one without the weightless tokens it shares with it
(`shared_prefix_lengths`; its position ids start there); attention lets a sharing sequence see the stored prefix
(model/packed_attention.py), so the prompt runs once per group (measured: docs/hardware.md, "Each group's prompt").

Packed attention: with `position_ids` restarting at 0 per sequence, no attention mask and no KV cache,
transformers (>= 5, `masking_utils.find_packed_sequence_indices`) detects the sequence boundaries and builds a
block-diagonal causal mask for sdpa, eager and flex attention (flash attention derives varlen boundaries from
the same position ids). `use_cache=False` is required: the model's config default creates a cache, which
turns the detection off and lets attention cross sequence boundaries. tests/test_packing.py pins this.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import math
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rollout_lib.adapters import base_of
from rollout_lib.model.packed_attention import PACKED_SDPA, packed_sequences
from rollout_lib.wire import (MICRO_BATCHES, REQUIRED_STREAMS, SAMPLER_LOGPROBS, STREAM_COLUMNS,
                              TRAINING_SAMPLE_DEFAULTS, TRAINING_SAMPLES, conform)
from rollout_lib.hardware import autocast_for, model_device

FIRST_TOKEN_LOGPROB = 0.0
# Streams that say how much a token counts in a loss; all must be zero on a sequence's first token.
WEIGHT_COLUMNS = ("loss_mask", "rl_weights", "ce_weights", "ref_kl_weights")


# --- samples -> micro-batches --------------------------------------------------------------------------------


def pack_samples(samples: pa.Table, max_seq_len: int, *, share_prefixes: bool = False) -> pa.Table:
    """Best-fit-decreasing packing of TRAINING_SAMPLES rows into MICRO_BATCHES rows of <= max_seq_len tokens.

    Samples are placed longest first (ties: original order) into the open bin with the least room that still
    fits, else a new bin. Within a micro-batch the samples keep their original relative order; micro-batches
    are numbered in the order their bins were opened. Envs and algorithms mix freely in a bin.
    A sample longer than `max_seq_len` raises (callers truncate before packing).

    share_prefixes: the unit placed is a group (a sample stored whole and the later samples that share its
    weightless prefix, stored without it; see "Shared prefixes" above), at most `max_seq_len` stored tokens. In a
    micro-batch the groups keep the original order of their first samples, and a group's samples follow that one
    in their original order (so a sample may come before an earlier one of another group).
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    rows = _validated_rows(samples, max_seq_len, "packing")
    units = _sharing_units(rows, max_seq_len) if share_prefixes else [[(i, 0)] for i in range(len(rows))]
    stored = [sum(len(rows[i]["input_ids"]) - shared for i, shared in unit) for unit in units]

    order = sorted(range(len(units)), key=lambda u: (-stored[u], u))
    bins: list[list[int]] = []
    # (room left, bin index), sorted: the first entry with room >= length is the best fit, and among equally
    # good bins the one opened first wins, which keeps packing deterministic.
    room: list[tuple[int, int]] = []
    for unit in order:
        length = stored[unit]
        slot = bisect.bisect_left(room, (length, -1))
        if slot == len(room):
            bins.append([unit])
            bisect.insort(room, (max_seq_len - length, len(bins) - 1))
        else:
            left, bin_index = room.pop(slot)
            bins[bin_index].append(unit)
            bisect.insort(room, (left - length, bin_index))

    return _micro_batches([[(rows[i], shared) for unit in sorted(members) for i, shared in units[unit]]
                           for members in bins])


# A shorter common prefix is not worth a sequence's separate attention call.
MIN_SHARED_PREFIX = 8


def _sharing_units(rows: list[dict], max_seq_len: int) -> list[list[tuple[int, int]]]:
    """Rows grouped as [(root, 0), (row, shared), ...]: each row shares the longest prefix it can with an earlier
    root (tokens equal to the root's and weightless in the row, leaving at least one token of each unstored), or
    becomes a root itself; a unit stays within `max_seq_len` stored tokens. Units in the order of their roots."""
    units: list[list[tuple[int, int]]] = []
    stored: list[int] = []
    roots_by_start: dict[tuple, list[int]] = {}  # the first MIN_SHARED_PREFIX tokens -> units whose root has them
    for index, row in enumerate(rows):
        tokens = row["input_ids"]
        key = tuple(tokens[:MIN_SHARED_PREFIX])
        weightless = _weightless_prefix(row)
        best, best_shared = None, 0
        if weightless >= MIN_SHARED_PREFIX:
            for unit in roots_by_start.get(key, ()):
                root = rows[units[unit][0][0]]["input_ids"]
                shared = _common_prefix(tokens, root, min(weightless, len(root) - 1, len(tokens) - 1))
                if shared > best_shared and stored[unit] + len(tokens) - shared <= max_seq_len:
                    best, best_shared = unit, shared
        if best is not None and best_shared >= MIN_SHARED_PREFIX:
            units[best].append((index, best_shared))
            stored[best] += len(tokens) - best_shared
        else:
            units.append([(index, 0)])
            stored.append(len(tokens))
            roots_by_start.setdefault(key, []).append(len(units) - 1)
    return units


def _weightless_prefix(row: dict) -> int:
    """How many leading tokens of a row have zero weight in every component (its prompt, at least)."""
    weights = zip(*(_materialised(row, name) for name in WEIGHT_COLUMNS))
    return next((position for position, values in enumerate(weights) if any(values)), len(row["input_ids"]))


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    return next((i for i in range(limit) if a[i] != b[i]), limit)


def batch_unpacked(
    samples: pa.Table, sequences_per_micro_batch: int, *, max_seq_len: int | None = None
) -> pa.Table:
    """Packing off: consecutive groups of `sequences_per_micro_batch` samples per MICRO_BATCHES row.

    The row layout is the same as packed rows; `collate_micro_batch(..., packed=False)` pads them at collate
    time. With `max_seq_len`, a longer sample raises as in `pack_samples`.
    """
    if sequences_per_micro_batch < 1:
        raise ValueError(f"sequences_per_micro_batch must be >= 1, got {sequences_per_micro_batch}")
    rows = _validated_rows(samples, max_seq_len, "batching")
    groups = [[(row, 0) for row in rows[i : i + sequences_per_micro_batch]]
              for i in range(0, len(rows), sequences_per_micro_batch)]
    return _micro_batches(groups)


def check_micro_batches(micro_batches: pa.Table) -> None:
    """The alignment invariant of MICRO_BATCHES; raises ValueError naming the micro-batch and column.

    Every per-token column (position_ids and all streams) has len(input_ids) entries, sequence lengths sum to
    it, there is one sample id per sequence, position ids restart at 0 at every sequence start (at its shared
    prefix's length for a sequence that shares one), and a sharing sequence follows a sequence stored whole that
    is longer than the prefix it shares.
    """
    table = conform(micro_batches, MICRO_BATCHES)
    token_counts = pc.list_value_length(table["input_ids"]).to_pylist()
    for name in ("position_ids", *STREAM_COLUMNS, SAMPLER_LOGPROBS):
        lengths = pc.list_value_length(table[name]).to_pylist()
        for index, (length, expected) in enumerate(zip(lengths, token_counts)):
            if length is not None and length != expected:  # null: an optional stream no sample carries
                raise ValueError(f"micro-batch {index}: column {name!r} has {length} entries, input_ids has {expected}")
    for index, (row_lengths, shared, positions, expected) in enumerate(
        zip(table["sequence_lengths"].to_pylist(), table["shared_prefix_lengths"].to_pylist(),
            table["position_ids"].to_pylist(), token_counts)
    ):
        if len(row_lengths) != len(table["sample_ids"][index]) or len(shared) != len(row_lengths):
            raise ValueError(f"micro-batch {index}: {len(row_lengths)} sequence lengths, {len(shared)} shared "
                             f"prefix lengths and {len(table['sample_ids'][index])} sample ids")
        if sum(row_lengths) != expected or min(row_lengths, default=1) < 1:
            raise ValueError(f"micro-batch {index}: sequence_lengths {row_lengths} do not tile {expected} tokens")
        if not np.array_equal(np.asarray(positions), _restarting_positions(row_lengths, shared)):
            raise ValueError(f"micro-batch {index}: position_ids do not restart at 0 (or at the shared prefix's "
                             "length) per sequence")
        _sequence_contexts(row_lengths, shared, where=f"micro-batch {index}")


def _validated_rows(samples: pa.Table, max_seq_len: int | None, before: str) -> list[dict]:
    """Samples as Python rows, each per-token column checked against len(input_ids), none over `max_seq_len`."""
    rows = conform(samples, TRAINING_SAMPLES).to_pylist()
    seen: set[str] = set()
    for row in rows:
        sample_id = row["sample_id"]
        if sample_id in seen:
            raise ValueError(f"sample {sample_id!r} appears twice")
        seen.add(sample_id)
        input_ids = row["input_ids"]
        if not input_ids:
            raise ValueError(f"sample {sample_id!r} has no tokens")
        if max_seq_len is not None and len(input_ids) > max_seq_len:
            raise ValueError(f"sample {sample_id!r} has {len(input_ids)} tokens, more than max_seq_len={max_seq_len}; "
                             f"truncate before {before}")
        if row["loss_mask"] is None:
            raise ValueError(f"sample {sample_id!r}: column 'loss_mask' is null")
        for name in (*STREAM_COLUMNS, SAMPLER_LOGPROBS):
            values = row[name]
            if values is None:
                continue
            if len(values) != len(input_ids):
                raise ValueError(f"sample {sample_id!r}: column {name!r} has {len(values)} entries, "
                                 f"input_ids has {len(input_ids)}")
            if any(value is None for value in values):
                raise ValueError(f"sample {sample_id!r}: column {name!r} has null entries")
        # The first token has no prediction (see the module docstring), so weight there would be lost.
        for name in WEIGHT_COLUMNS:
            if row[name] is not None and row[name][0]:
                raise ValueError(
                    f"sample {sample_id!r}: column {name!r} is non-zero on the first token, which is never "
                    f"predicted"
                )
        _check_required_streams(row)
    return rows


def _check_required_streams(row: dict) -> None:
    """A sample in a component ships the streams its loss reads: a null there is a producer bug (an rl sample
    without advantages would train with A = 0, silently), never a default."""
    rl_weights = _materialised(row, "rl_weights")
    members = {
        "rl": sum(1 for keep, weight in zip(row["loss_mask"], rl_weights) if keep and weight),
        "ref_kl": sum(1 for weight in row["ref_kl_weights"] or () if weight),
    }
    for component, needed in REQUIRED_STREAMS.items():
        missing = [name for name in needed if row[name] is None]
        if members[component] and missing:
            raise ValueError(
                f"sample {row['sample_id']!r} has {members[component]} {component} token(s) but no "
                f"{' or '.join(missing)}: its producer must ship them (an absent rl_weights means weight 1 on "
                "every loss_mask token; ship zeros to keep a sample out of rl)"
            )


def _materialised(row: dict, name: str) -> list:
    """A stream with its null replaced by the documented default."""
    if row[name] is not None:
        return row[name]
    default = TRAINING_SAMPLE_DEFAULTS[name]
    if default == "loss_mask":
        return [1.0 if keep else 0.0 for keep in row["loss_mask"]]
    return [float(default)] * len(row["input_ids"])


def _micro_batches(groups: Sequence[Sequence[tuple[dict, int]]]) -> pa.Table:
    """One MICRO_BATCHES row per group of (row, shared prefix length): each row stored without its shared prefix."""
    records = []
    for index, group in enumerate(groups):
        lengths = [len(row["input_ids"]) - shared for row, shared in group]
        shared_lengths = [shared for _, shared in group]
        record = {
            "micro_batch_index": index,
            "sample_ids": [row["sample_id"] for row, _ in group],
            "sequence_lengths": lengths,
            "shared_prefix_lengths": shared_lengths,
            "position_ids": _restarting_positions(lengths, shared_lengths).tolist(),
            "input_ids": [token for row, shared in group for token in row["input_ids"][shared:]],
        }
        for name in STREAM_COLUMNS:
            record[name] = [value for row, shared in group for value in _materialised(row, name)[shared:]]
        record[SAMPLER_LOGPROBS] = _optional_stream(group, SAMPLER_LOGPROBS)
        records.append(record)
    table = pa.Table.from_pylist(records, schema=MICRO_BATCHES)
    check_micro_batches(table)
    return table


def _optional_stream(group: Sequence[tuple[dict, int]], name: str) -> list[float] | None:
    """An optional stream over a micro-batch's tokens: None when no sample of `group` carries it (the micro-batch
    is then as before the stream existed), else NaN on the tokens of the samples without it."""
    if all(row[name] is None for row, _ in group):
        return None
    return [value for row, shared in group
            for value in (row[name] if row[name] is not None else [math.nan] * len(row["input_ids"]))[shared:]]


def _restarting_positions(sequence_lengths: Sequence[int], shared: Sequence[int] | None = None) -> np.ndarray:
    if not sequence_lengths:
        return np.zeros(0, dtype=np.int64)
    starts = shared or [0] * len(sequence_lengths)
    return np.concatenate([np.arange(start, start + length, dtype=np.int64)
                           for length, start in zip(sequence_lengths, starts)])


def _sequence_contexts(lengths: Sequence[int], shared: Sequence[int], *, where: str) -> list[tuple[int, int]]:
    """Per sequence of a packed row, (start of the tokens it attends to before its own, how many): the latest
    sequence stored whole before it and its shared prefix length; (start, 0) for a sequence stored whole."""
    contexts, root, root_length, start = [], None, 0, 0
    for length, prefix in zip(lengths, shared):
        if prefix == 0:
            root, root_length = start, length
            contexts.append((start, 0))
        elif root is None or prefix >= root_length:
            raise ValueError(f"{where}: a sequence shares {prefix} tokens but follows no sequence stored whole "
                             f"that is longer")
        else:
            contexts.append((root, prefix))
        start += length
    return contexts


# --- micro-batch -> tensors ----------------------------------------------------------------------------------


def collate_micro_batch(row: dict, *, packed: bool, pad_token_id: int) -> dict[str, torch.Tensor]:
    """One MICRO_BATCHES row (e.g. from `table.to_pylist()`) as model inputs plus flat per-token streams.

    packed=True:  input_ids [1, T], position_ids [1, T] restarting per sequence; no attention_mask (its absence
                  is what lets transformers detect the packed sequences); sequence_contexts [B, 2] (what each
                  sequence attends to before its own tokens: `_sequence_contexts`).
    packed=False: input_ids [B, Tmax] right-padded with pad_token_id, attention_mask [B, Tmax], position_ids
                  [B, Tmax] (0 on padding).
    Both: sequence_lengths [B], and every stream in STREAM_COLUMNS as [T] over real tokens in packed order
    (loss_mask bool, the rest float32).
    """
    lengths = [int(length) for length in row["sequence_lengths"]]
    input_ids = torch.as_tensor(np.asarray(row["input_ids"], dtype=np.int64))
    position_ids = torch.as_tensor(np.asarray(row["position_ids"], dtype=np.int64))
    total = int(input_ids.numel())
    if sum(lengths) != total or position_ids.numel() != total:
        raise ValueError(f"micro-batch {row.get('micro_batch_index')}: sequence_lengths/position_ids misaligned")

    shared = [int(length) for length in row.get("shared_prefix_lengths") or [0] * len(lengths)]
    batch: dict[str, torch.Tensor] = {"sequence_lengths": torch.tensor(lengths, dtype=torch.long)}
    if packed:
        batch["input_ids"] = input_ids.unsqueeze(0)
        batch["position_ids"] = position_ids.unsqueeze(0)
        if any(shared):
            where = f"micro-batch {row.get('micro_batch_index')}"
            batch["sequence_contexts"] = torch.tensor(_sequence_contexts(lengths, shared, where=where),
                                                      dtype=torch.long)
    elif any(shared):
        raise ValueError(f"micro-batch {row.get('micro_batch_index')}: shared prefixes need the packed layout")
    else:
        width = max(lengths)
        padded_ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
        padded_positions = torch.zeros((len(lengths), width), dtype=torch.long)
        for sequence, chunk in enumerate(torch.split(input_ids, lengths)):
            padded_ids[sequence, : chunk.numel()] = chunk
            attention_mask[sequence, : chunk.numel()] = 1
            padded_positions[sequence, : chunk.numel()] = torch.arange(chunk.numel())
        batch["input_ids"] = padded_ids
        batch["attention_mask"] = attention_mask
        batch["position_ids"] = padded_positions

    for name in STREAM_COLUMNS:
        values = row[name]
        if len(values) != total:
            raise ValueError(f"micro-batch {row.get('micro_batch_index')}: column {name!r} has {len(values)} entries, "
                             f"input_ids has {total}")
        dtype = np.bool_ if name == "loss_mask" else np.float32
        batch[name] = torch.as_tensor(np.asarray(values, dtype=dtype))
    if row.get(SAMPLER_LOGPROBS) is not None:  # only where a correction reweights against the sampler
        batch[SAMPLER_LOGPROBS] = torch.as_tensor(np.asarray(row[SAMPLER_LOGPROBS], dtype=np.float32))
    return batch


def token_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                   needed: torch.Tensor | None = None) -> torch.Tensor:
    """log p(input_ids[t] | earlier tokens of the same sequence) per real token, [T], in packed order.

    Works on either layout from `collate_micro_batch` and gives the same values for both. The first token of
    each sequence gets FIRST_TOKEN_LOGPROB (0.0). Differentiable: use it inside the training step. With a
    `temperatures` stream, each token's logprob is of the distribution softmax(logits / its temperature).

    `needed` ([T] bool, packed order): the tokens whose logprob the caller reads; the others get
    FIRST_TOKEN_LOGPROB. The output head and the softmax then run only at the positions that predict a needed
    token (transformers' `logits_to_keep`; why: docs/hardware.md), equal to the full computation up to rounding.
    """

    if "sequence_contexts" in batch:
        return _shared_prefix_logprobs(model, batch, needed)
    device = model_device(model)  # the model's device (hardware.py); the result lives there too
    padded = "attention_mask" in batch
    input_ids = batch["input_ids"].to(device)
    position_ids = batch["position_ids"].to(device)
    if padded:
        real = batch["attention_mask"].to(device).bool()
        inputs = {"attention_mask": batch["attention_mask"].to(device)}
    else:
        if input_ids.shape[0] != 1:
            raise ValueError(f"a packed batch has exactly one row, got input_ids of shape {tuple(input_ids.shape)}")
        real = torch.ones_like(input_ids, dtype=torch.bool)
        # No attention_mask and no cache: transformers then reads sequence boundaries from position_ids and
        # builds a block-diagonal causal mask (see the module docstring).
        inputs = {}
    # Prediction positions: logits at t - 1 predict token t (t >= 1).
    kept = None
    if needed is not None and _accepts_logits_to_keep(model):
        wanted = torch.zeros(input_ids.shape, dtype=torch.bool, device=device)
        wanted[real] = needed.to(device=device, dtype=torch.bool)
        kept = wanted[:, 1:].any(dim=0).nonzero().squeeze(-1)  # one index set for every row of a padded batch
        inputs["logits_to_keep"] = kept
    with autocast_for(model):
        outputs = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **inputs)

    logits = outputs.logits.float() if kept is not None else outputs.logits[:, :-1].float()
    targets = input_ids[:, 1:] if kept is None else input_ids[:, 1:][:, kept]
    temperatures = batch.get("temperatures")
    if temperatures is not None and bool((temperatures != 1.0).any()):
        # Token t is predicted by the logits at t - 1: scale those by the temperature token t was sampled at.
        scale = torch.ones(input_ids.shape, dtype=logits.dtype, device=device)
        scale[real] = temperatures.to(device=device, dtype=logits.dtype)
        scale = scale[:, 1:] if kept is None else scale[:, 1:][:, kept]
        logits = logits / scale.unsqueeze(-1)
    chosen = _chosen_logprobs(logits, targets)
    if kept is None:
        predicted = chosen
    else:
        predicted = torch.full(targets.shape[:1] + (input_ids.shape[1] - 1,), FIRST_TOKEN_LOGPROB,
                               dtype=chosen.dtype, device=device)
        predicted = predicted.index_copy(1, kept, chosen)
    # Position 0 of a row is never predicted; pad it so position t holds the logprob of token t.
    predicted = torch.nn.functional.pad(predicted, (1, 0), value=FIRST_TOKEN_LOGPROB)

    flat = predicted[real]
    # In the packed layout the logit before a sequence start belongs to the previous sequence: discard it.
    sequence_starts = position_ids[real] == 0
    flat = flat.masked_fill(sequence_starts, FIRST_TOKEN_LOGPROB)
    return flat if needed is None else flat.masked_fill(~needed.to(device=device, dtype=torch.bool),
                                                        FIRST_TOKEN_LOGPROB)


def _shared_prefix_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                            needed: torch.Tensor | None) -> torch.Tensor:
    """`token_logprobs` of a packed row whose sequences share prefixes: each token is predicted by the logits at
    the position before it in its own sequence, which for a sharing sequence's first stored token is the shared
    prefix's last position (in the sequence stored whole)."""
    if getattr(base_of(model).config, "_attn_implementation", None) != PACKED_SDPA:
        raise ValueError("shared prefixes need the packed attention (model/packed_attention.py: "
                         "use_packed_attention), which lets a sequence attend to the prefix it shares")
    device = model_device(model)
    input_ids = batch["input_ids"].to(device)
    position_ids = batch["position_ids"].to(device)
    total = input_ids.shape[1]
    lengths = batch["sequence_lengths"].tolist()
    contexts = [tuple(pair) for pair in batch["sequence_contexts"].tolist()]
    predictor = torch.arange(-1, total - 1, device=device)
    predicted = torch.ones(total, dtype=torch.bool, device=device)
    start = 0
    for length, (context_start, shared) in zip(lengths, contexts):
        if shared:
            predictor[start] = context_start + shared - 1
        else:
            predicted[start] = False  # a sequence's first token has no prediction
        start += length
    if needed is not None:
        predicted &= needed.to(device=device, dtype=torch.bool)
    targets = predicted.nonzero().squeeze(-1)
    layout = packed_sequences(lengths, contexts)
    with autocast_for(model):
        if _accepts_logits_to_keep(model):
            logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                           logits_to_keep=predictor[targets], packed_sequences=layout).logits[0]
        else:
            logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                           packed_sequences=layout).logits[0, predictor[targets]]
    logits = logits.float()
    temperatures = batch.get("temperatures")
    if temperatures is not None and bool((temperatures != 1.0).any()):
        logits = logits / temperatures.to(device=device, dtype=logits.dtype)[targets].unsqueeze(-1)
    chosen = _chosen_logprobs(logits, input_ids[0, targets])
    flat = torch.full((total,), FIRST_TOKEN_LOGPROB, dtype=chosen.dtype, device=device)
    return flat.index_copy(0, targets, chosen)


def _chosen_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per position; gather - logsumexp avoids materialising a second [.., V] tensor."""
    return torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes `logits_to_keep` (every causal LM of transformers 5 we load does)."""
    return _forward_takes_logits_to_keep(type(base_of(model)))  # a peft wrapper passes it on to its base


@functools.cache
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False
