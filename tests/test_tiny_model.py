"""The tiny offline Qwen2: loads through the Auto classes, ids round-trip, ChatML masks, deterministic."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rollout_lib.model.tiny import BUILD_MARKER, build_tiny_qwen2, train_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "qwen2")


ROUND_TRIP_STRINGS = [
    "Hello world",
    "What is 12 + 30? The answer is 42.",
    "digits 0123456789 and 3.14159",
    "  leading spaces, double  spaces and trailing ",
    "line one\nline two\n\n\tindented\r\n",
    "it's, they're, we'll: contractions!",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "unicode: café naïve — ü",
]


def test_auto_classes_load_offline(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.config.tie_word_embeddings
    assert 400 <= len(tokenizer) <= 520
    ids = tokenizer("Hello world", return_tensors="pt")["input_ids"]
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)


@pytest.mark.parametrize("text", ROUND_TRIP_STRINGS)
def test_ids_round_trip_through_auto_tokenizer(tiny_dir, text):
    # AutoTokenizer rebuilds a Qwen2Tokenizer from vocab+merges; its ids must equal the trained tokenizer's.
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    trained = train_tiny_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == trained.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer(special, add_special_tokens=False)["input_ids"]) == 1


def test_chat_template_renders_chatml(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\nIt is 4.<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_assistant_mask_marks_exactly_assistant_content(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": " 6, of course"},
    ]
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)

    # Expected: tokenize the pieces separately (special tokens and "\n" split cleanly in this template), and
    # mark each assistant content plus its closing <|im_end|>, nothing else.
    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    expected_ids, expected_mask = [], []
    for message in messages:
        header = encode(f"<|im_start|>{message['role']}\n")
        expected_ids += header
        expected_mask += [0] * len(header)
        body = encode(message["content"] + "<|im_end|>")
        expected_ids += body
        expected_mask += [int(message["role"] == "assistant")] * len(body)
        newline = encode("\n")
        expected_ids += newline
        expected_mask += [0] * len(newline)
    assert ids == expected_ids
    assert mask == expected_mask
    marked = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(marked) == "It is 4.<|im_end|> 6, of course<|im_end|>"


def test_build_is_deterministic_and_reused(tmp_path):
    first = build_tiny_qwen2(tmp_path / "a", seed=3)
    second = build_tiny_qwen2(tmp_path / "b", seed=3)
    other = build_tiny_qwen2(tmp_path / "c", seed=4)
    weights = (first / "model.safetensors").read_bytes()
    assert weights == (second / "model.safetensors").read_bytes()
    assert weights != (other / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()

    # A complete build is returned as is: not rewritten.
    before = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_qwen2(first, seed=3) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == before
    assert (first / BUILD_MARKER).exists()
    with pytest.raises(ValueError, match="seed"):
        build_tiny_qwen2(first, seed=5)


def test_build_does_not_disturb_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_qwen2(tmp_path / "rng", seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_sequence_classification_head_loads(tiny_dir):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    batch = tokenizer(["a short one", "a somewhat longer text here"], padding=True, return_tensors="pt")
    scores = model(**batch).logits
    assert scores.shape == (2, 1)


def test_num_labels_stored_in_config(tmp_path):
    directory = build_tiny_qwen2(tmp_path / "rm", num_labels=1)
    model = AutoModelForSequenceClassification.from_pretrained(directory)
    assert model.config.num_labels == 1
    assert model.score.out_features == 1
