"""Does a served model share the policy's tokenizer? Checked before a run trains on anything it serves.

Token ids cross the wire in both directions (prompts sent as ids, completions and scores returned per id), so a
teacher or sampling source with another vocabulary would not fail: it would silently train the policy on the
wrong tokens. The check asks the server itself (`/tokenize`), so it holds for servers rollout did not start:
- probe text made of a spread of the policy's whole vocabulary (every 7th token decoded, plus multilingual and
  code text) must tokenize to the same ids;
- each of the policy's special tokens must be the same single id;
- a chat conversation rendered with the generation prompt must give the same ids (the chat template).

Plan time (`--dry-run`, before a run starts anything) runs the same probes on the served model's own tokenizer,
loaded offline from its reference (`local_tokenizer_mismatch`): a teacher rollout serves is refused before vLLM
starts.
"""

from __future__ import annotations

import asyncio

from rollout_lib.model.chat import encode_prompt

_PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{} "
               "def f(x):\n    return x ** 2\n\tÜber café naïve — 東京 日本語 😀 ∑∫√")
_PROBE_CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 12 + 30?"},
               {"role": "assistant", "content": "42"}, {"role": "user", "content": "And 7 * 6?"}]
_VOCAB_STRIDE = 7


class TokenizerMismatch(ValueError):
    """The served model's tokenizer differs from the policy's; the message says where first."""


def tokenizer_probes(tokenizer) -> list[str]:
    """The texts whose ids are compared: vocabulary spread in chunks, the fixed probe text, each special token."""
    size = len(tokenizer)
    pieces = [tokenizer.decode([token_id]) for token_id in range(0, size, _VOCAB_STRIDE)]
    chunks = ["".join(pieces[start:start + 256]) for start in range(0, len(pieces), 256)]
    return [_PROBE_TEXT, *chunks]


async def find_tokenizer_mismatch(pool, tokenizer, there: str = "there", here: str = "here",
                                  chat_template: bool = True) -> str | None:
    """None when the pool's served model tokenizes like `tokenizer`, else what differs first (one line; `there` and
    `here` name the two sides). `chat_template=False` leaves the chat template out (a reward model's server is sent
    token ids encoded here: its template is never used). Texts are tokenized without special tokens on both sides:
    an encoder's server would otherwise wrap each in [CLS] ... [SEP]."""
    probes = tokenizer_probes(tokenizer)
    served = await asyncio.gather(*(pool.tokenize(text=text, add_special_tokens=False) for text in probes))
    for text, ids in zip(probes, served):
        ours = tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = len(ids) - len(ours)  # a server may prepend a BOS token to raw text: compare what follows it
        if bos not in (0, 1) or ids[bos:] != ours:
            return (f"text {text[:40]!r}... tokenizes to {len(ids)} ids {there} and {len(ours)} {here} "
                    f"(first difference at token {_first_difference(ids[max(bos, 0):], ours)})")
    specials = [token for token in tokenizer.all_special_tokens if token]
    served_specials = await asyncio.gather(*(pool.tokenize(text=token, add_special_tokens=False)
                                             for token in specials))
    for token, ids in zip(specials, served_specials):
        ours = tokenizer.convert_tokens_to_ids(token)
        if ids[-1:] != [ours]:
            return f"special token {token!r} is id {ours} {here} and {ids} {there}"
    if chat_template and getattr(tokenizer, "chat_template", None):
        ours = encode_prompt(tokenizer, _PROBE_CHAT)
        theirs = await pool.tokenize(messages=_PROBE_CHAT, add_generation_prompt=True)
        if theirs != ours:
            return (f"the chat template renders a probe conversation to {len(theirs)} ids {there} and {len(ours)} "
                    f"{here} (first difference at token {_first_difference(theirs, ours)})")
    return None


def local_tokenizer_mismatch(theirs, ours) -> str | None:
    """find_tokenizer_mismatch with `theirs` (a served model's tokenizer, loaded from its reference) in the server's
    place: what differs first, or None."""
    return asyncio.run(find_tokenizer_mismatch(_Tokenizes(theirs), ours, there="in its tokenizer",
                                               here="in the policy's"))


class _Tokenizes:
    """A tokenizer answering as a server's `/tokenize` does (raw text without special tokens; messages through the
    chat template with the generation prompt)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def tokenize(self, *, text: str | None = None, messages: list[dict] | None = None,
                       add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:
        if messages is not None:
            return encode_prompt(self.tokenizer, messages)
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
