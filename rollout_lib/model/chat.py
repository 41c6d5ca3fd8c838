"""How a tokenizer frames a conversation for generation: the prompt's token ids and where a completion stops.

Facts about a model's tokenizer, shared by every sampler (sampling/), the served-model tokenizer check
(serving/tokenizers.py) and algorithms that render prompts (algo/opsd.py).
"""

from __future__ import annotations


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template with the generation prompt, as token ids (the completion's conditioning context)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        if hasattr(ids, "keys"):  # some transformers versions return a BatchEncoding regardless
            ids = ids["input_ids"]
        return [int(token) for token in ids]
    # No template: the conversation's text, one message per line (base models).
    text = "\n".join(message["content"] for message in messages) + "\n"
    return [int(token) for token in tokenizer(text)["input_ids"]]


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Where a completion ends: the tokenizer's eos (end of turn for chat models) and the model's own eos ids."""
    ids: list[int] = []
    for candidate in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        for token in candidate if isinstance(candidate, (list, tuple)) else [candidate]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    if not ids:
        raise ValueError("the tokenizer and model declare no eos token: a completion could never end")
    return ids
