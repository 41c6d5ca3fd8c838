"""Scalar rewards from a sequence-classification model, and how (prompt, response) text becomes its input."""

from __future__ import annotations

import torch


def is_decoder_only(model) -> bool:
    return not getattr(model.config, "is_encoder_decoder", False) and hasattr(model, "score")


def encode_prompt_response(tokenizer, prompt: str, response: str, max_seq_len: int) -> list[int]:
    """Token ids of one (prompt, response) input to a reward model.

    Encoders (BERT-like) get the tokenizer's sentence-pair encoding ([CLS] prompt [SEP] response [SEP]);
    decoders get the chat template when the tokenizer has one, else `prompt\\nresponse<eos>`. Truncation keeps
    the start of the prompt and of the response ("longest_first"), so both sides stay visible."""
    if getattr(tokenizer, "chat_template", None) and not _is_encoder_tokenizer(tokenizer):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids[:max_seq_len])
    if _is_encoder_tokenizer(tokenizer):
        return tokenizer(prompt, response, truncation="longest_first", max_length=max_seq_len)["input_ids"]
    ids = tokenizer(f"{prompt}\n{response}", truncation=True, max_length=max_seq_len - 1)["input_ids"]
    return ids + [tokenizer.eos_token_id]


def _is_encoder_tokenizer(tokenizer) -> bool:
    return tokenizer.sep_token_id is not None and tokenizer.cls_token_id is not None


def pad_right(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        attention_mask[row, : len(seq)] = 1
    return input_ids, attention_mask


def reward_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One scalar per row. Decoders: the score head read at the last non-pad token, located from the attention
    mask (right padding), never by searching for the pad id, which breaks when pad == eos and a sequence ends in
    eos. Encoders: the model's pooled ([CLS]) logits."""
    if is_decoder_only(model):
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(dim=1) - 1
        return model.score(hidden[torch.arange(hidden.shape[0]), last]).squeeze(-1)
    return model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1)
