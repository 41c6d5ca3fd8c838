"""Supervised fine-tuning: conversations -> tokens with loss masks -> micro-batches per step -> the causal step.

Masks come from the tokenizer's chat template. A template that marks assistant output with
`{% generation %}` says itself what the model generates; for one without (SmolLM2's ChatML), each assistant
turn is located by rendering prefixes of the conversation and diffing:

    before  = render(messages[:i], add_generation_prompt=True)    # ... "<|im_start|>assistant\\n"
    through = render(messages[:i+1])                              # ... "<|im_start|>assistant\\nA<|im_end|>\\n"
    span    = through[len(before):], without trailing whitespace  # "A<|im_end|>": content and end of turn

and a token is trained when it starts inside a span. Both ways train every assistant turn of a multi-turn chat,
end-of-turn token included (the model must learn to stop). Samples ship `ce_weights` = the mask as floats and
no rl/ref_kl weights, so the algorithm-blind step (`rollout_lib.trainer.causal`) trains them with masked NLL.

Deterministic on CPU like the RM trainer: the data order comes from the seed, packing is deterministic, each
step seeds its RNG from (seed, step) and the learning rate is a function of the step.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import jinja2
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rollout_lib import wire
from rollout_lib.config.sft import SftConfig, SftSettings
from rollout_lib.data.jsonl import DataError
from rollout_lib.losses import masked_nll_sum
from rollout_lib.model.loading import ModelLoadError, ResolvedModel, load_causal_lm, load_tokenizer, resolve_model
from rollout_lib.model.packed_attention import use_packed_attention
from rollout_lib.packing import batch_unpacked, collate_micro_batch, pack_samples, token_logprobs
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import CheckpointedTrainer
from rollout_lib.trainer.causal import TIMING_METRICS, train_on_micro_batches
from rollout_lib.trainer.determinism import use_deterministic_torch
from rollout_lib.trainer.optim import build_optimizer

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


# --- conversations -> tokens and masks -------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def sft_tokenizer(resolved: ResolvedModel):
    """The tokenizer, loaded once per process (from a GGUF file that takes seconds); it must have a chat
    template, which is what renders conversations and locates the assistant turns."""
    tokenizer = load_tokenizer(resolved)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"the tokenizer of {resolved.source!r} has no chat template; SFT renders every "
                             "example with it (prompt/completion rows too, as a user and an assistant turn)")
    return tokenizer


def has_generation_tags(tokenizer) -> bool:
    return bool(_GENERATION_TAG.search(tokenizer.get_chat_template()))


def assistant_mask_from_generation_tags(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """(input_ids, mask) where the template's own `{% generation %}` blocks say what is trained."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(keep) for keep in out["assistant_masks"]]


def assistant_mask_from_prefixes(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """(input_ids, mask) with each assistant turn located by rendering prefixes and diffing (module docstring).

    Raises ValueError when the template renders a prefix inconsistently with the whole conversation (e.g. it
    rewrites earlier turns), since no span could then be located honestly."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise ValueError("the conversation opens with an assistant turn: with no message before it, its span "
                             "cannot be located by rendering prefixes (start with a system or user message)")
        before = _render(tokenizer, messages[:index], add_generation_prompt=True)
        through = _render(tokenizer, messages[: index + 1], add_generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError(f"the chat template does not render messages[{index}] (assistant) as a continuation "
                             "of the conversation before it, so its span cannot be located")
        spans.append((len(before), len(through.rstrip())))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(start <= offset < end for start, end in spans) for offset, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def _render(tokenizer, messages: list[dict], *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:  # e.g. a template that raise_exception()s on a prefix it does not expect
        raise ValueError(f"the chat template cannot render the first {len(messages)} message(s): {exc}") from None


def tokenize_conversation(tokenizer, messages: list[dict], loss_on: str) -> tuple[list[int], list[bool]]:
    """(input_ids, loss mask) of one conversation, untruncated. The first token is never trained (it has no
    prediction); `loss_on="all"` trains every other token."""
    if loss_on == "all":
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        return list(ids), [index > 0 for index in range(len(ids))]
    if has_generation_tags(tokenizer):
        ids, mask = assistant_mask_from_generation_tags(tokenizer, messages)
    else:
        ids, mask = assistant_mask_from_prefixes(tokenizer, messages)
    return ids, ([False, *mask[1:]] if mask else mask)


@dataclass
class Tokenized:
    samples: pa.Table  # wire.TRAINING_SAMPLES, rows with an empty loss mask left out
    rows: int
    truncated_lines: list[int]
    empty_mask_lines: list[int]  # rows left out: nothing to train on (after truncation, or `loss_on` finds none)

    def report(self) -> dict:
        lengths = pc.list_value_length(self.samples["input_ids"])
        return {
            "rows": self.rows,
            "kept": self.samples.num_rows,
            "truncated": len(self.truncated_lines),
            "empty_mask_lines": self.empty_mask_lines,
            "tokens": pc.sum(lengths).as_py(),
            "loss_tokens": pc.sum(pc.list_flatten(self.samples["loss_mask"]).cast(pa.int64())).as_py(),
        }


def tokenize_examples(examples: pa.Table, tokenizer, *, loss_on: str, max_seq_len: int,
                      source: str = "examples") -> Tokenized:
    """wire.EXAMPLES -> wire.TRAINING_SAMPLES (ce_weights = loss mask, rl/ref_kl weights null), truncated to
    `max_seq_len` tokens. Rows whose mask ends up empty are left out and listed; if that is every row, DataError.
    `source` (the dataset path) prefixes error messages."""
    records = []
    truncated, empty = [], []
    for messages, line in zip(examples["messages"].to_pylist(), examples["source_line"].to_pylist()):
        try:
            ids, mask = tokenize_conversation(tokenizer, messages, loss_on)
        except (ValueError, jinja2.TemplateError) as exc:
            raise DataError(f"{source}:{line}: {exc}") from None
        if len(ids) > max_seq_len:
            truncated.append(line)
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if not any(mask):
            empty.append(line)
            continue
        records.append({"sample_id": f"line-{line}", "env": None, "input_ids": ids, "loss_mask": mask,
                        "ce_weights": [1.0 if keep else 0.0 for keep in mask]})
    if not records:
        raise DataError(
            f"{source}: no row has a token to train on: the loss mask ({loss_on}) of all {len(empty)} rows is empty"
            + (f" ({len(truncated)} truncated to max_seq_len={max_seq_len})" if truncated else "")
        )
    return Tokenized(pa.Table.from_pylist(records, schema=wire.TRAINING_SAMPLES), examples.num_rows, truncated,
                     empty)


# --- samples -> micro-batches --------------------------------------------------------------------------------


def micro_batches_of(samples: pa.Table, settings: SftSettings) -> pa.Table:
    """One step's samples as wire.MICRO_BATCHES: packed into <= max_seq_len tokens, or padded groups."""
    if settings.packed:
        return pack_samples(samples, settings.packing.max_seq_len)
    return batch_unpacked(samples, settings.sequences_per_micro_batch, max_seq_len=settings.packing.max_seq_len)


def plan_micro_batches(samples: pa.Table, plan: pa.Table, settings: SftSettings) -> tuple[pa.Table, pa.Table]:
    """Every step's micro-batches, from a wire.BATCH_PLAN over sample rows (`determinism.plan_batches`).

    Returns (MICRO_BATCHES of all steps, one after another; BATCH_PLAN whose row_indices index that table).
    A sample drawn twice into one step (a step spanning two epochs) gets `#2` appended to its id there."""
    tables, plan_rows, offset = [], [], 0
    for step, rows in zip(plan["step"].to_pylist(), plan["row_indices"].to_pylist()):
        step_samples = samples.take(rows)
        ids = step_samples["sample_id"].to_pylist()
        if len(set(ids)) != len(ids):
            seen: dict[str, int] = {}
            for index, sample_id in enumerate(ids):
                seen[sample_id] = seen.get(sample_id, 0) + 1
                ids[index] = sample_id if seen[sample_id] == 1 else f"{sample_id}#{seen[sample_id]}"
            column = step_samples.schema.get_field_index("sample_id")
            step_samples = step_samples.set_column(column, "sample_id", pa.array(ids, pa.string()))
        table = micro_batches_of(step_samples, settings)
        tables.append(table)
        plan_rows.append({"step": step, "row_indices": list(range(offset, offset + table.num_rows))})
        offset += table.num_rows
    return (pa.concat_tables(tables).combine_chunks(), pa.Table.from_pylist(plan_rows, schema=wire.BATCH_PLAN))


def padding_stats(micro_batches: pa.Table, *, packed: bool) -> dict:
    """Tokens, positions a forward pass processes (padding included) and their ratio, without running a model."""
    lengths = micro_batches["sequence_lengths"].to_pylist()
    tokens = sum(sum(row) for row in lengths)
    positions = tokens if packed else sum(len(row) * max(row) for row in lengths)
    return {"micro_batches": len(lengths), "tokens": tokens, "positions": positions,
            "nonpad_fraction": tokens / positions if positions else 0.0}


# --- training ------------------------------------------------------------------------------------------------


@dataclass
class SftRun:
    """Content ids and settings that define a run; everything a trainer needs to (re)build itself."""

    store: ObjectStore
    config: SftConfig
    settings_hash: str
    micro_batches_id: str
    plan_id: str


class SftTrainer(CheckpointedTrainer):
    kind_of_model = "causal_lm"
    timing_metrics = TIMING_METRICS

    @classmethod
    def build(cls, run: SftRun):
        use_deterministic_torch()
        resolved = resolve_model(run.config.settings.base_model)
        tokenizer = sft_tokenizer(resolved)
        torch.manual_seed(run.config.run.seed)
        model = load_causal_lm(resolved)
        if run.config.settings.packed:
            use_packed_attention(model)  # attention per packed sequence, without the masked-out blocks
        optimizer = build_optimizer(model.parameters(), run.config.settings.optimizer)
        return model, tokenizer, optimizer

    def data_ids(self) -> dict[str, str]:
        return {"micro_batches": self.run.micro_batches_id, "plan": self.run.plan_id}

    @property
    def micro_batches(self) -> pa.Table:
        return self.table(self.run.micro_batches_id, wire.MICRO_BATCHES)

    @property
    def plan(self) -> pa.Table:
        return self.table(self.run.plan_id, wire.BATCH_PLAN)

    def run_step(self, step: int) -> dict[str, float]:
        settings = self.run.config.settings
        rows = self.plan.column("row_indices")[step - 1].as_py()
        return train_on_micro_batches(
            self.model, self.optimizer, self.micro_batches.take(rows), packed=settings.packed,
            pad_token_id=self.tokenizer.pad_token_id, max_grad_norm=settings.optimizer.max_grad_norm,
        )


@torch.no_grad()
def evaluate_nll(model, micro_batches: pa.Table, *, packed: bool, pad_token_id: int) -> dict[str, float]:
    """Held-out loss: mean NLL per trained token (ce weights), its perplexity, and the token count."""
    model.eval()
    nll, tokens = 0.0, 0
    for row in micro_batches.to_pylist():
        batch = collate_micro_batch(row, packed=packed, pad_token_id=pad_token_id)
        nll += masked_nll_sum(token_logprobs(model, batch), batch["ce_weights"]).item()
        tokens += int((batch["ce_weights"] != 0).sum())
    loss = nll / tokens if tokens else float("nan")
    return {"loss": loss, "perplexity": math.exp(loss) if tokens else float("nan"), "tokens": tokens}
