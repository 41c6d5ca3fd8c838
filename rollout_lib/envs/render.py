"""The tokens of an environment's reply, rendered as the policy's own chat template renders the conversation.

The model's tokens are kept exactly as sampled (never re-tokenized from their text); only what the environment
writes is rendered, as the text the chat template puts between the model's end-of-turn token and the next
generation prompt. With ChatML, after a model turn ending in `<|im_end|>`, a tool reply renders as

    "\\n<|im_start|>tool\\n888<|im_end|>\\n<|im_start|>assistant\\n"

and each message's content ("888") is located in it, so the caller can say which tokens are the message's body
(what echo trains on) and which are framing. Without a chat template (base models) the conversation is its
messages' contents one per line, as `sampling.base.encode_prompt` renders prompts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RenderedMessage:
    """One env message's tokens within the rendered reply: [start, end) and its content's [body_start, body_end)."""

    role: str
    content: str
    start: int
    end: int
    body_start: int
    body_end: int


class TemplateMismatchError(ValueError):
    """The chat template does not render the conversation so that an env reply can be appended token-exactly."""


def render_env_reply(tokenizer, conversation: list[dict], stop_token_id: int | None, env_messages: list[dict],
                     tools: list[dict] | None = None) -> tuple[list[int], list[RenderedMessage]]:
    """Token ids of `env_messages` appended after `conversation` (whose last message is the model's turn, ended by
    `stop_token_id`; None when it has no stop token), through the next generation prompt, and where each message
    lies in them. `tools`: the env's tool schemas, rendered as the prompt was (the template may frame tool calls and
    results differently with them)."""
    if getattr(tokenizer, "chat_template", None):
        text = _templated_reply_text(tokenizer, conversation, stop_token_id, env_messages, tools)
    else:
        text = "".join(message["content"] + "\n" for message in env_messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(token) for token in encoded["input_ids"]]
    offsets = [tuple(pair) for pair in encoded["offset_mapping"]]
    return ids, _locate(text, offsets, env_messages)


def _templated_reply_text(tokenizer, conversation: list[dict], stop_token_id: int | None,
                          env_messages: list[dict], tools: list[dict] | None) -> str:
    before = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    after = tokenizer.apply_chat_template([*conversation, *env_messages], tools=tools, tokenize=False,
                                          add_generation_prompt=True)
    if not after.startswith(before):
        raise TemplateMismatchError(
            "the chat template renders the conversation differently once the environment's reply is appended (it "
            "rewrites earlier turns), so the reply cannot be appended to the sampled tokens exactly")
    # The template closes the model's turn with the stop token's text and maybe more ("\n" in ChatML): the model
    # sampled the stop token itself, so the reply starts with whatever the template writes after it.
    stop_text = tokenizer.decode([stop_token_id]) if stop_token_id is not None else ""
    closing = before.rfind(stop_text) if stop_text else -1
    if stop_text and closing < 0:
        raise TemplateMismatchError(f"the chat template does not close an assistant turn with the stop token "
                                    f"{stop_text!r}, so where the model's turn ends in its rendering is unknown")
    trailer = before[closing + len(stop_text):] if stop_text else ""
    return trailer + after[len(before):]


def _locate(text: str, offsets: list[tuple[int, int]], env_messages: list[dict]) -> list[RenderedMessage]:
    """Each message's token span: from the end of the previous message's content to the end of its own (the last
    one to the end of the reply); its body: the tokens lying wholly inside its content."""
    bodies, cursor = [], 0
    for message in env_messages:
        content = message["content"]
        found = text.find(content, cursor) if content else cursor
        if found < 0 and content.strip():
            content = content.strip()  # templates that trim message contents
            found = text.find(content, cursor)
        if found < 0:
            raise TemplateMismatchError(f"the chat template does not render the {message['role']} message's "
                                        f"content verbatim ({message['content'][:80]!r})")
        bodies.append((found, found + len(content)))
        cursor = found + len(content)

    def first_token_at(char: int) -> int:
        return next((i for i, (start, _) in enumerate(offsets) if start >= char), len(offsets))

    rendered, previous_end = [], 0
    for index, (message, (body_char_start, body_char_end)) in enumerate(zip(env_messages, bodies)):
        end = len(offsets) if index == len(env_messages) - 1 else first_token_at(body_char_end)
        inside = [i for i in range(previous_end, end)
                  if offsets[i][0] >= body_char_start and offsets[i][1] <= body_char_end and offsets[i][1] > offsets[i][0]]
        body_start, body_end = (inside[0], inside[-1] + 1) if inside else (end, end)
        rendered.append(RenderedMessage(message["role"], message["content"], previous_end, end, body_start, body_end))
        previous_end = end
    return rendered
