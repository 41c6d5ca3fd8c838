"""Scalar rewards from a sequence-classification model, and how (prompt, response) text becomes its input."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rollout_lib.adapters import base_of
from rollout_lib.hardware import autocast_for, model_device


def is_decoder_only(model) -> bool:
    return not getattr(model.config, "is_encoder_decoder", False) and hasattr(model, "score")


def encode_prompt_response(tokenizer, prompt: str, response: str, max_seq_len: int) -> list[int]:
    """Token ids of one (prompt, response) input to a reward model.

    Encoders (BERT-like) get the tokenizer's sentence-pair encoding ([CLS] prompt [SEP] response [SEP]);
    decoders get the chat template when the tokenizer has one, else `prompt\\nresponse<eos>`. Truncation keeps
    the start of the prompt and of the response ("longest_first"), so both sides stay visible."""
    if _uses_chat_template(tokenizer):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return _chat_ids(tokenizer, messages)[:max_seq_len]
    if _is_encoder_tokenizer(tokenizer):
        return tokenizer(prompt, response, truncation="longest_first", max_length=max_seq_len)["input_ids"]
    ids = tokenizer(f"{prompt}\n{response}", truncation=True, max_length=max_seq_len - 1)["input_ids"]
    return ids + [tokenizer.eos_token_id]


class ResponseTooLongError(ValueError):
    """The response alone is longer than the reward model's input: it is never cut, so there is no score."""


@dataclass(frozen=True)
class RewardModelInput:
    input_ids: list[int]
    prompt_tokens_dropped: int  # the prompt's earliest tokens left out to fit (0: the whole input)


def encode_for_reward_model(tokenizer, prompt: list[dict], response: str, max_length: int) -> RewardModelInput:
    """A reward model's input for a prompt given as chat messages: `encode_prompt_response`'s, so the model scores
    as train-rm trained it (a prompt of one user message is exactly that input when it fits), but never cut on the
    response side. An input longer than `max_length` loses the prompt's earliest tokens (a leading BOS token
    stays); a response that does not fit alone raises ResponseTooLongError.

    Chat template: the messages, then the response as the assistant's turn. Without one, several messages are
    one prompt text, their contents joined by newlines."""
    if _uses_chat_template(tokenizer):
        whole = _chat_ids(tokenizer, [*prompt, {"role": "assistant", "content": response}])
        if len(whole) <= max_length:
            return RewardModelInput(whole, 0)
        prompt_ids = _chat_ids(tokenizer, prompt, add_generation_prompt=True)
        if whole[:len(prompt_ids)] != prompt_ids:
            raise ValueError("the chat template does not render the prompt (with the generation prompt) as the "
                             "start of prompt + response, so the prompt's tokens cannot be told apart to shorten it")
        return _prompt_cut_from_the_left(tokenizer, prompt_ids, whole[len(prompt_ids):], max_length)
    prompt_text = "\n".join(message["content"] for message in prompt)
    if _is_encoder_tokenizer(tokenizer):
        encoded = tokenizer(prompt_text, response)
        whole = list(encoded["input_ids"])
        if len(whole) <= max_length:
            return RewardModelInput(whole, 0)
        # The prompt's tokens are the pair's first sequence; the special tokens around the two sequences stay.
        sequences = encoded.sequence_ids()
        response_tokens, room = sequences.count(1), max_length - sequences.count(None)
        if response_tokens > room:
            raise _too_long(response_tokens, room, max_length)
        first, dropped = sequences.index(0), len(whole) - max_length
        return RewardModelInput(whole[:first] + whole[first + dropped:], dropped)
    # "prompt\nresponse<eos>": a token that spans the newline and the response's first characters is the response's.
    encoded = tokenizer(f"{prompt_text}\n{response}", return_offsets_mapping=True)
    whole = list(encoded["input_ids"]) + [tokenizer.eos_token_id]
    if len(whole) <= max_length:
        return RewardModelInput(whole, 0)
    response_start = len(prompt_text) + 1
    split = next((i for i, (_, end) in enumerate(encoded["offset_mapping"]) if end > response_start),
                 len(encoded["input_ids"]))
    return _prompt_cut_from_the_left(tokenizer, whole[:split], whole[split:], max_length)


def _prompt_cut_from_the_left(tokenizer, prompt_ids: list[int], response_ids: list[int],
                              max_length: int) -> RewardModelInput:
    # A model trained on inputs that start with BOS reads one without it badly: it stays, and the cut follows it.
    head = 1 if tokenizer.bos_token_id is not None and prompt_ids[:1] == [tokenizer.bos_token_id] else 0
    room = max_length - head - len(response_ids)
    if room < 0:
        raise _too_long(len(response_ids), max_length - head, max_length)
    dropped = len(prompt_ids) - head - room
    return RewardModelInput(prompt_ids[:head] + prompt_ids[head + dropped:] + response_ids, dropped)


def _too_long(response_tokens: int, room: int, max_length: int) -> ResponseTooLongError:
    limit = (f"the reward model's max_length ({max_length})" if room == max_length else
             f"the {room} that the reward model's max_length ({max_length}) leaves for it")
    return ResponseTooLongError(f"the response alone is {response_tokens} tokens, more than {limit}; a response is "
                                "never cut")


def _uses_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and not _is_encoder_tokenizer(tokenizer)


def _chat_ids(tokenizer, messages: list[dict], **options) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def _is_encoder_tokenizer(tokenizer) -> bool:
    return tokenizer.sep_token_id is not None and tokenizer.cls_token_id is not None


def pad_right(sequences: list[list[int]], pad_token_id: int,
              length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask, as long as the longest sequence or `length`."""
    longest = length or max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        attention_mask[row, : len(seq)] = 1
    return input_ids, attention_mask


def reward_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One scalar per row. Decoders: the score head read at the last non-pad token, located from the attention
    mask (right padding), never by searching for the pad id, which breaks when pad == eos and a sequence ends in
    eos. Encoders: the model's pooled ([CLS]) logits. Computed on the model's device and precision
    (hardware.py); the scores are fp32, on that device."""

    device = model_device(model)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    inner = base_of(model)  # a LoRA reward model: the classifier with the adapter's layers in it, head included
    with autocast_for(model):
        if is_decoder_only(inner):
            hidden = inner.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            last = attention_mask.sum(dim=1) - 1
            scores = inner.score(hidden[torch.arange(hidden.shape[0], device=device), last]).squeeze(-1)
        else:
            scores = model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1)
    return scores.float()
