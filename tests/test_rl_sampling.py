"""The embedded sampler: seeded reruns sample the same tokens, recorded logprobs are those of the processed
(temperature / top_p) distribution the tokens were drawn from, completions stop at the end-of-turn token."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_lib import wire
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.packing import collate_micro_batch, pack_samples, token_logprobs
from rollout_lib.sampling import SAMPLERS, SamplingParams
from rollout_lib.sampling.base import encode_prompt
from rollout_lib.sampling.hf import HfSampler, HfSamplerSettings


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    tokenizer = load_tokenizer(resolve_model(str(tiny_model_dir)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return model, tokenizer


def prompts(n: int = 2) -> pa.Table:
    rows = [{"example_id": f"e/{i}", "env": "e", "messages": [{"role": "user", "content": f"Say {i} things."}],
             "answer": str(i), "info": None, "source_line": i + 1} for i in range(n)]
    rows[-1]["messages"] = [{"role": "system", "content": "Be brief."}, *rows[-1]["messages"]]
    return pa.Table.from_pylist(rows, schema=wire.PROMPTS)


def test_rows_are_prompt_major_with_the_chat_template_as_prompt(policy):
    model, tokenizer = policy
    sampler = HfSampler(HfSamplerSettings(), model, tokenizer)
    table = sampler.sample(prompts(), SamplingParams(group_size=3, max_tokens=5), seed=0)
    assert table.schema == wire.ROLLOUTS
    assert table.column("example_id").to_pylist() == ["e/0"] * 3 + ["e/1"] * 3
    assert table.column("group_index").to_pylist() == [0, 1, 2] * 2
    assert len(set(table.column("sample_id").to_pylist())) == 6
    assert table.column("answer").to_pylist() == ["0"] * 3 + ["1"] * 3
    assert table.column("reward").null_count == 6
    expected = encode_prompt(tokenizer, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Say 1 things."}])
    assert table.column("prompt_ids")[3].as_py() == expected
    assert tokenizer.decode(expected).endswith("<|im_start|>assistant\n")
    for ids, logprobs, text in zip(*(table.column(c).to_pylist()
                                     for c in ("completion_ids", "sampling_logprobs", "completion_text"))):
        assert 1 <= len(ids) <= 5 and len(logprobs) == len(ids)
        assert all(lp <= 0 for lp in logprobs)
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_seeded_rerun_samples_the_same_tokens_and_leaves_the_callers_rng_alone(policy):
    model, tokenizer = policy
    params = SamplingParams(group_size=4, max_tokens=8, temperature=0.8, top_p=0.9)
    sampler = HfSampler(HfSamplerSettings(batch_size=3), model, tokenizer)  # chunks of 3 sequences
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = sampler.sample(prompts(), params, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    again = HfSampler(HfSamplerSettings(batch_size=3), model, tokenizer).sample(prompts(), params, seed=7)
    assert first.equals(again)
    other = sampler.sample(prompts(), params, seed=8)
    assert other.column("completion_ids").to_pylist() != first.column("completion_ids").to_pylist()
    # Samples within a group differ (the group is not one sample repeated).
    assert len({tuple(ids) for ids in first.column("completion_ids").to_pylist()[:4]}) > 1


def reference_logprobs(model, prompt_ids, completion_ids, temperature, top_p):
    """log p(token) under the processing HF applies before sampling: logits / T, then nucleus filtering."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + completion_ids])
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    sorted_logits, order = torch.sort(logits, descending=False)
    remove_sorted = sorted_logits.softmax(-1).cumsum(-1) <= (1 - top_p)
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    logits = logits.masked_fill(remove, -float("inf"))
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9)])
def test_logprobs_are_those_of_the_distribution_sampled_from(policy, temperature, top_p):
    model, tokenizer = policy
    table = HfSampler(HfSamplerSettings(), model, tokenizer).sample(
        prompts(), SamplingParams(group_size=3, max_tokens=6, temperature=temperature, top_p=top_p), seed=1)
    for row in table.to_pylist():
        expected = reference_logprobs(model, row["prompt_ids"], row["completion_ids"], temperature, top_p)
        assert torch.allclose(torch.tensor(row["sampling_logprobs"]), expected, atol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.4])
@pytest.mark.parametrize("packed", [True, False])
def test_the_sampler_and_the_trainer_agree_at_the_sampling_temperature(policy, temperature, packed):
    """On-policy identity: the trainer's logprob of a sampled token equals the sampler's (importance ratio 1),
    through the real stamping, packing and collation, at any temperature (top_p = 1)."""
    from rollout_lib.algo import build_algorithm
    from rollout_lib.algo.grpo import GrpoSettings
    from rollout_lib.algo.stamping import stamp_training_samples

    model, tokenizer = policy
    table = HfSampler(HfSamplerSettings(), model, tokenizer).sample(
        prompts(), SamplingParams(group_size=2, max_tokens=6, temperature=temperature), seed=3)
    rollouts = table.set_column(table.schema.get_field_index("reward"), wire.ROLLOUTS.field("reward"),
                                pa.array([1.0] * table.num_rows, pa.float64()))
    advantages = [[0.5] * len(ids) for ids in table.column("completion_ids").to_pylist()]
    env = table.column("env")[0].as_py()
    samples = stamp_training_samples(rollouts, advantages, {env: build_algorithm(GrpoSettings())}, 256,
                                     temperatures={env: temperature})
    batch = collate_micro_batch(pack_samples(samples, 256).to_pylist()[0], packed=packed, pad_token_id=0)
    with torch.no_grad():
        trainer_logprobs = token_logprobs(model, batch)
    mask = batch["loss_mask"]
    assert torch.allclose(trainer_logprobs[mask], batch["inference_logprobs"][mask], atol=1e-4)
    if temperature != 1.0:  # and the scaling is what makes them agree
        unscaled = token_logprobs(model, {**batch, "temperatures": torch.ones_like(batch["temperatures"])})
        assert not torch.allclose(unscaled[mask], batch["inference_logprobs"][mask], atol=1e-2)


def test_a_completion_ends_with_its_stop_token(policy):
    model, tokenizer = policy
    eos = tokenizer.eos_token_id

    def always_stop(module, inputs, output):
        output = output.clone()
        output[..., eos] += 100.0
        return output

    handle = model.lm_head.register_forward_hook(always_stop)
    try:
        table = HfSampler(HfSamplerSettings(), model, tokenizer).sample(
            prompts(1), SamplingParams(group_size=2, max_tokens=8), seed=0)
    finally:
        handle.remove()
    assert table.column("completion_ids").to_pylist() == [[eos], [eos]]
    assert table.column("completion_text").to_pylist() == ["", ""]
    assert table.column("sampling_logprobs")[0].as_py()[0] == pytest.approx(0.0, abs=1e-6)


def test_backends_register_by_type_name():
    assert SAMPLERS["hf"] is HfSampler
    assert HfSamplerSettings.samples_live_policy
