"""SFT data: conversations -> tokens with loss masks (wire.TRAINING_SAMPLES).

Masks come from the tokenizer's chat template. A template that marks assistant output with
`{% generation %}` says itself what the model generates; for one without (SmolLM2's ChatML), each assistant
turn is located by rendering prefixes of the conversation and diffing:

    before  = render(messages[:i], add_generation_prompt=True)    # ... "<|im_start|>assistant\\n"
    through = render(messages[:i+1])                              # ... "<|im_start|>assistant\\nA<|im_end|>\\n"
    span    = through[len(before):], without trailing whitespace  # "A<|im_end|>": content and end of turn

and a token is trained when it starts inside a span. Both ways train every assistant turn of a multi-turn chat,
end-of-turn token included (the model must learn to stop). A row with tools renders with `tools=` (the schemas in
the prompt) and its assistant's `tool_calls` (data/tool_messages.py): a calling turn is an assistant turn, so its
call tokens are trained like its final answer, while the tools' schemas and the tool results (their own turns) are
not. Samples ship `ce_weights` = the mask as floats and
zero rl_weights (a null rl stream would mean weight 1 on every loss_mask token), so the algorithm-blind step
(`rollout_lib.trainer.causal`) trains them with masked NLL only.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import jinja2
import pyarrow as pa
import pyarrow.compute as pc

from rollout_lib import wire
from rollout_lib.data.jsonl import DataError
from rollout_lib.data.tool_messages import template_messages, template_tools
from rollout_lib.model.chat import use_chat_template
from rollout_lib.model.loading import ModelLoadError, ResolvedModel, load_tokenizer

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


# --- conversations -> tokens and masks -------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def sft_tokenizer(resolved: ResolvedModel, chat_template: str | None = None):
    """The tokenizer, loaded once per process (from a GGUF file that takes seconds), framing conversations with
    the template at `chat_template` (`algorithm.sft.chat_template`) when given; it must have a chat template, which
    is what renders conversations and locates the assistant turns."""
    tokenizer = use_chat_template(load_tokenizer(resolved), chat_template)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"the tokenizer of {resolved.source!r} has no chat template; SFT renders every "
                             "example with it (prompt/completion rows too, as a user and an assistant turn)")
    return tokenizer


def has_generation_tags(tokenizer) -> bool:
    return bool(_GENERATION_TAG.search(tokenizer.get_chat_template()))


def assistant_mask_from_generation_tags(tokenizer, messages: list[dict],
                                        tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
    """(input_ids, mask) where the template's own `{% generation %}` blocks say what is trained."""
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(keep) for keep in out["assistant_masks"]]


def assistant_mask_from_prefixes(tokenizer, messages: list[dict],
                                 tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
    """(input_ids, mask) with each assistant turn located by rendering prefixes and diffing (module docstring).

    Raises ValueError when the template renders a prefix inconsistently with the whole conversation (e.g. it
    rewrites earlier turns), since no span could then be located honestly."""
    full = _render(tokenizer, messages, tools, add_generation_prompt=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise ValueError("the conversation opens with an assistant turn: with no message before it, its span "
                             "cannot be located by rendering prefixes (start with a system or user message)")
        before = _render(tokenizer, messages[:index], tools, add_generation_prompt=True)
        through = _render(tokenizer, messages[: index + 1], tools, add_generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError(f"the chat template does not render messages[{index}] (assistant) as a continuation "
                             "of the conversation before it, so its span cannot be located")
        spans.append((len(before), len(through.rstrip())))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(start <= offset < end for start, end in spans) for offset, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:  # e.g. a template that raise_exception()s on a prefix it does not expect
        raise ValueError(f"the chat template cannot render the first {len(messages)} message(s): {exc}") from None


def tokenize_conversation(tokenizer, messages: list[dict], loss_on: str,
                          tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
    """(input_ids, loss mask) of one conversation (messages as the template takes them), untruncated, with the
    row's `tools` shown by the template. The first token is never trained (it has no prediction); `loss_on="all"`
    trains every other token."""
    if loss_on == "all":
        ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
        return list(ids), [index > 0 for index in range(len(ids))]
    if has_generation_tags(tokenizer):
        ids, mask = assistant_mask_from_generation_tags(tokenizer, messages, tools)
    else:
        ids, mask = assistant_mask_from_prefixes(tokenizer, messages, tools)
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
    """wire.EXAMPLES -> wire.TRAINING_SAMPLES (ce_weights = loss mask, rl_weights zeros), truncated to
    `max_seq_len` tokens. Rows whose mask ends up empty are left out and listed; if that is every row, DataError.
    `source` (the dataset path) prefixes error messages."""
    records = []
    truncated, empty = [], []
    for messages, tools, line in zip(examples["messages"].to_pylist(), examples["tools"].to_pylist(),
                                     examples["source_line"].to_pylist()):
        try:
            ids, mask = tokenize_conversation(tokenizer, template_messages(messages), loss_on, template_tools(tools))
        except (ValueError, jinja2.TemplateError) as exc:
            raise DataError(f"{source}:{line}: {exc}") from None
        if len(ids) > max_seq_len:
            truncated.append(line)
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if not any(mask):
            empty.append(line)
            continue
        records.append({"sample_id": wire.sft_sample_id(line), "env": None, "input_ids": ids, "loss_mask": mask,
                        "ce_weights": [1.0 if keep else 0.0 for keep in mask], "rl_weights": [0.0] * len(ids)})
    if not records:
        raise DataError(
            f"{source}: no row has a token to train on: the loss mask ({loss_on}) of all {len(empty)} rows is empty"
            + (f" ({len(truncated)} truncated to max_seq_len={max_seq_len})" if truncated else "")
        )
    return Tokenized(pa.Table.from_pylist(records, schema=wire.TRAINING_SAMPLES), examples.num_rows, truncated,
                     empty)
