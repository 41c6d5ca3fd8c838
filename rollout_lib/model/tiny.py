"""A tiny Qwen2 checkpoint built locally and deterministically, for tests and examples that must run offline.

`build_tiny_qwen2(dir)` writes a normal Hugging Face directory (config.json, model.safetensors, tokenizer
files, ChatML chat template) that `AutoTokenizer` / `AutoModelForCausalLM` /
`AutoModelForSequenceClassification` load with no network access. Nothing here touches the hub.

Why the tokenizer pipeline mirrors `Qwen2Tokenizer` exactly: for a directory whose model type is qwen2,
`AutoTokenizer` rebuilds a `Qwen2Tokenizer` from vocab and merges with Qwen's own normalizer and
pre-tokenizer, ignoring the ones saved in tokenizer.json. A tokenizer trained with any other pre-tokenizer
would then silently produce different ids at load time (see shared/notes/offline-models.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
VOCAB_SIZE = 512

# Written last: its presence (with matching parameters) means the directory holds a complete build.
BUILD_MARKER = "tiny_qwen2_build.json"
TINY_VERSION = 2  # part of the build marker and the cache directory name: a new version never reuses an old build

# Same regex as transformers' Qwen2Tokenizer (PRETOKENIZE_REGEX); kept literal so a build does not depend on
# a private constant, and pinned by the round-trip test.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)

# ChatML. The assistant turn's content and its closing <|im_end|> sit inside {% generation %} so that
# `return_assistant_tokens_mask=True` marks them: the model is trained to produce the end-of-turn token too.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer the question briefly.",
    "What is the sum of 12 and 30? The answer is 42.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "A train travels 60 miles per hour for 3 hours. How far does it go? It goes 180 miles.",
    "Please write a short poem about the sea and the sky.",
    "Hello! How can I help you today?",
    "I think the best answer is the one that is correct, clear and kind.",
    "Step 1: read the problem. Step 2: solve it. Step 3: check the result.",
    "She has 7 apples and gives away 2, so she has 5 apples left.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 -5 +7 = 12 * 3 / 4",
    "user assistant system",
    "The weather is nice, isn't it? Yes, it's sunny and warm.",
    "They're going to the market; we'll meet them there at 9 o'clock.",
)


def _corpus() -> list[str]:
    lines = list(_CORPUS_SENTENCES)
    lines += [f"{a} + {b} = {a + b}" for a in range(0, 30, 3) for b in range(0, 20, 4)]
    lines += ["\n".join(_CORPUS_SENTENCES[i : i + 3]) for i in range(0, len(_CORPUS_SENTENCES), 3)]
    return lines


def _train_tokenizer():
    """A byte-level BPE with Qwen2's normalizer/pre-tokenizer/decoder, so AutoTokenizer reproduces its ids."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocabulary, so no string is ever out of vocabulary.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return tokenizer


def train_tiny_tokenizer():
    """The raw `tokenizers.Tokenizer` a build saves; tests compare AutoTokenizer's ids against it."""
    return _train_tokenizer()


def _build_params(seed: int, num_labels: int | None) -> dict:
    return {"kind": "tiny-qwen2", "version": TINY_VERSION, "seed": seed, "num_labels": num_labels}


def build_tiny_qwen2(directory: str | Path, *, seed: int = 0, num_labels: int | None = None) -> Path:
    """Build (or reuse) a tiny Qwen2ForCausalLM + tokenizer in `directory` and return its path.

    Same seed -> byte-identical model.safetensors. A directory that already holds a complete build with the
    same parameters is returned as is; one built with other parameters is an error rather than a silent mix.
    `num_labels` is stored in config.json for `AutoModelForSequenceClassification` (its score head is new).
    """
    directory = Path(directory)
    params = _build_params(seed, num_labels)
    marker = directory / BUILD_MARKER
    if marker.exists():
        existing = json.loads(marker.read_text())
        if existing != params:
            raise ValueError(f"{directory} holds a tiny Qwen2 built with {existing}, not {params}")
        return directory

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    raw_tokenizer = _train_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw_tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE

    config_kwargs = {} if num_labels is None else {"num_labels": num_labels}
    config = Qwen2Config(
        vocab_size=raw_tokenizer.get_vocab_size(),
        hidden_size=64,
        num_hidden_layers=2,
        # head_dim 32: the smallest head vLLM's CPU attention kernel supports, so the tiny model can be served
        # (version 1 had 4 heads of 16 and the same parameter count).
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=raw_tokenizer.token_to_id(EOS_TOKEN),
        pad_token_id=raw_tokenizer.token_to_id(PAD_TOKEN),
        **config_kwargs,
    )
    # A private generator keeps the build deterministic without touching the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id

    # Build beside the target and rename into place, so a reader never sees a half-written directory and two
    # concurrent builders cannot interleave files.
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / BUILD_MARKER).write_text(json.dumps(params, sort_keys=True))
        if directory.exists() and not any(directory.iterdir()):
            directory.rmdir()
        try:
            os.rename(staging, directory)
        except OSError:
            # Someone else finished first (or the directory holds unrelated files): trust only a marker.
            if not marker.exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    existing = json.loads(marker.read_text())
    if existing != params:
        raise ValueError(f"{directory} holds a tiny Qwen2 built with {existing}, not {params}")
    return directory
