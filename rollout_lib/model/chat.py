"""How a tokenizer frames a conversation for generation: the prompt's token ids and where a completion stops.

Facts about a model's tokenizer, shared by every sampler (sampling/), the served-model tokenizer check
(serving/tokenizers.py) and algorithms that render prompts (algo/opsd.py).
"""

from __future__ import annotations


def encode_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The chat template with the generation prompt, as token ids (the completion's conditioning context); `tools`:
    an env's tool schemas, which the template shows the model."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                            return_dict=False)
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


def use_chat_template(tokenizer, path: str | None):
    """The tokenizer framing conversations with the template at `path` (a .jinja file: the policy's
    `chat_template` override) instead of its own; unchanged when `path` is None. Changes `tokenizer` in place, so
    prompts, env replies and the checkpoints it is saved with all use the one template."""
    if path is not None:
        with open(path, encoding="utf-8") as file:
            tokenizer.chat_template = file.read()
    return tokenizer


# A conversation through one tool call, with values that appear nowhere else, as TRL's supports_tool_calling.
_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool_name", "description": "probe_tool_description",
    "parameters": {"type": "object", "properties": {"probe_argument": {"type": "string", "description": "x"}},
                   "required": ["probe_argument"]}}}
_PROBE_CALL = [{"role": "user", "content": "probe_user_content"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1_0", "type": "function", "function": {
                   "name": "probe_tool_name", "arguments": {"probe_argument": "probe_argument_value"}}}]}]
_PROBE_RESULT = {"role": "tool", "tool_call_id": "call_1_0", "name": "probe_tool_name",
                 "content": "probe_tool_result"}


def tool_template_problem(tokenizer) -> str | None:
    """Why the tokenizer's chat template cannot frame tool calls token-exactly, or None: it must show the tools,
    render an assistant's tool call (its name and arguments) and the tool's result, and render the result as an
    extension of the call (env replies are appended to the sampled tokens)."""
    if not getattr(tokenizer, "chat_template", None):
        return "there is no chat template"
    try:
        call = tokenizer.apply_chat_template(_PROBE_CALL, tools=[_PROBE_TOOL], tokenize=False)
        result = tokenizer.apply_chat_template([*_PROBE_CALL, _PROBE_RESULT], tools=[_PROBE_TOOL], tokenize=False,
                                               add_generation_prompt=True)
    except Exception as exc:  # a template's own error (e.g. SmolLM2's on content=None) is the answer here
        return f"it fails on a tool call ({type(exc).__name__}: {exc})"
    after_user = call.split("probe_user_content")[-1]  # the name is in the tools' schemas too: look after them
    missing = [what for what, text, where in (("the tools", "probe_tool_description", call),
                                              ("the call's name", "probe_tool_name", after_user),
                                              ("the call's arguments", "probe_argument_value", call),
                                              ("the tool's result", "probe_tool_result", result)) if text not in where]
    if missing:
        return "it does not render " + ", ".join(missing)
    if not result.startswith(call):
        return "it renders the call differently once its result follows (not prefix-preserving)"
    return None
