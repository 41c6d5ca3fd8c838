"""The causal step (rollout_lib.trainer.causal) and the SFT trainer on the tiny Qwen2, without Prefect.

Packed per-token loss equals one-by-one; the loss mask survives packing; token-level normalisation under
gradient accumulation (every layout gives the one-big-batch update); NaN safety; empty micro-batches; replay from
a snapshot to the same checkpoint id; a checkpoint that `from_pretrained` loads and generates from.
"""

import copy
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_lib import wire
from rollout_lib.config import SftConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.data import load_examples
from rollout_lib.model import packed_attention
from rollout_lib.model.loading import ResolvedModel, load_tokenizer
from rollout_lib.model.packed_attention import PACKED_SDPA, use_packed_attention
from rollout_lib.packing import batch_unpacked, collate_micro_batch, pack_samples, token_logprobs
from rollout_lib.sft.batches import plan_micro_batches
from rollout_lib.sft.evaluate import evaluate_nll
from rollout_lib.sft.tokenize import tokenize_examples
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import NonFiniteLossError, TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer, PlannedBatches, train_on_micro_batches
from rollout_lib.checkpoint import export_hf_directory, read_manifest
from rollout_lib.determinism import plan_batches
from rollout_lib.identity.training import training_identity
from rollout_lib.trainer.segment import SnapshotSchedule, train_segment

ROOT = Path(__file__).resolve().parent.parent


def msg(role, content):
    return {"role": role, "content": content}


CHATS = [
    [msg("user", "What is 12 + 30?"), msg("assistant", "The answer is 42.")],
    [msg("system", "Be brief."), msg("user", "Say hi."), msg("assistant", "Hello there, friend!")],
    [msg("user", "What is 1+1?"), msg("assistant", "2"), msg("user", "And 2+2?"),
     msg("assistant", "4, since 2 + 2 = 4. Step 1: read the problem. Step 2: solve it.")],
    [msg("user", "Please write a short poem about the sea and the sky."),
     msg("assistant", "The quick brown fox jumps over the lazy dog; the weather is nice, isn't it?")],
    [msg("user", "She has 7 apples and gives away 2."), msg("assistant", "She has 5 apples left.")],
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(ResolvedModel(str(tiny_model_dir)))


@pytest.fixture(scope="module")
def samples(tokenizer) -> pa.Table:
    examples = pa.Table.from_pylist([{"messages": m, "source_line": i + 1} for i, m in enumerate(CHATS)],
                                    schema=wire.EXAMPLES)
    return tokenize_examples(examples, tokenizer, loss_on="assistant_only", max_seq_len=512).samples


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def one_by_one_nll(model, samples: pa.Table, order: list[str]) -> torch.Tensor:
    """Reference: each sample alone through the plain model; -logp · ce_weight per token, in `order`."""
    rows = {row["sample_id"]: row for row in samples.to_pylist()}
    pieces = []
    for sample_id in order:
        ids = torch.tensor([rows[sample_id]["input_ids"]])
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        nll = torch.cat([torch.zeros(1), -logp])
        pieces.append(nll * torch.tensor(rows[sample_id]["ce_weights"]))
    return torch.cat(pieces)


def total_tokens(samples: pa.Table) -> int:
    return sum(len(ids) for ids in samples["input_ids"].to_pylist())


# --- packing -------------------------------------------------------------------------------------------------


def test_packed_per_token_loss_equals_one_by_one(model, samples, tokenizer):
    model.eval()
    [row] = pack_samples(samples, max_seq_len=total_tokens(samples)).to_pylist()
    assert len(row["sample_ids"]) == len(CHATS)
    with torch.no_grad():
        reference = one_by_one_nll(model, samples, row["sample_ids"])
        for packed in (True, False):
            batch = collate_micro_batch(row, packed=packed, pad_token_id=tokenizer.pad_token_id)
            per_token = -token_logprobs(model, batch) * batch["ce_weights"]
            torch.testing.assert_close(per_token, reference, atol=1e-5, rtol=0)
    assert (reference > 0).sum() == sum(sum(m) for m in samples["loss_mask"].to_pylist())


def tiny_llama(tokenizer):
    """SmolLM2's architecture (Llama) at test size, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", PACKED_SDPA])
def test_packed_attention_is_isolated_per_sequence(model, samples, tokenizer, architecture, attention, monkeypatch):
    """Both ways of attending over a packed row (transformers' block-diagonal sdpa mask, and our per-sequence
    SDPA) give the one-by-one per-token loss, on Qwen2 and on Llama (SmolLM2's architecture)."""
    net = model.eval() if architecture == "qwen2" else tiny_llama(tokenizer)
    calls = []
    if attention == PACKED_SDPA:
        use_packed_attention(net)
        real_sdpa = packed_attention.sdpa_attention_forward
        monkeypatch.setattr(packed_attention, "sdpa_attention_forward",
                            lambda *args, **kwargs: calls.append(args[1].shape[2]) or real_sdpa(*args, **kwargs))
    [row] = pack_samples(samples, max_seq_len=total_tokens(samples)).to_pylist()
    with torch.no_grad():
        batch = collate_micro_batch(row, packed=True, pad_token_id=tokenizer.pad_token_id)
        per_token = -token_logprobs(net, batch) * batch["ce_weights"]
        packed_calls = list(calls)
        torch.testing.assert_close(per_token, one_by_one_nll(net, samples, row["sample_ids"]), atol=1e-5, rtol=0)
    if attention == PACKED_SDPA:  # one SDPA call per sequence and layer, each as long as its sequence
        assert packed_calls == row["sequence_lengths"] * net.config.num_hidden_layers


def test_packed_attention_leaves_padded_batches_to_sdpa(model, samples, tokenizer):
    [row] = batch_unpacked(samples, samples.num_rows).to_pylist()
    batch = collate_micro_batch(row, packed=False, pad_token_id=tokenizer.pad_token_id)
    varlen = copy.deepcopy(model).eval()
    use_packed_attention(varlen)
    with torch.no_grad():
        assert torch.equal(token_logprobs(varlen, batch), token_logprobs(model.eval(), batch))


def test_assistant_only_mask_survives_packing(samples, tokenizer):
    originals = {row["sample_id"]: row for row in samples.to_pylist()}
    packed = pack_samples(samples, max_seq_len=80)  # several bins
    assert packed.num_rows > 1
    seen = set()
    for row in packed.to_pylist():
        offset = 0
        for sample_id, length in zip(row["sample_ids"], row["sequence_lengths"]):
            original = originals[sample_id]
            assert row["input_ids"][offset:offset + length] == original["input_ids"]
            assert row["loss_mask"][offset:offset + length] == original["loss_mask"]
            assert row["ce_weights"][offset:offset + length] == original["ce_weights"]
            assert row["rl_weights"][offset:offset + length] == [0.0] * length  # never in the rl term
            offset += length
            seen.add(sample_id)
        trained = [t for t, keep in zip(row["input_ids"], row["loss_mask"]) if keep]
        assert "<|im_start|>" not in tokenizer.decode(trained) and "user" not in tokenizer.decode(trained)
    assert seen == set(originals)


def test_packer_raises_on_a_misaligned_per_token_column(samples):
    rows = samples.to_pylist()
    rows[1]["ce_weights"] = rows[1]["ce_weights"][:-1]
    with pytest.raises(ValueError, match=r"'line-2': column 'ce_weights' has \d+ entries, input_ids has \d+"):
        pack_samples(pa.Table.from_pylist(rows, schema=wire.TRAINING_SAMPLES), max_seq_len=512)


# --- the optimizer step ------------------------------------------------------------------------------------------


def reference_update(model, samples: pa.Table, lr: float, *, per_group: list[list[str]] | None = None):
    """SGD by hand: the mean NLL over all loss tokens of the step; with `per_group`, the sum of each group's own
    mean instead (what normalising every micro-batch by its own token count would accumulate)."""
    model = copy.deepcopy(model)
    model.train()
    ids = samples["sample_id"].to_pylist()
    groups = per_group or [ids]
    loss = 0.0
    for group in groups:
        nll = one_by_one_nll(model, samples, group)
        count = sum(sum(m) for sid, m in zip(ids, samples["loss_mask"].to_pylist()) if sid in group)
        loss = loss + nll.sum() / count
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return model, loss.item()


def step(model, micro_batches, packed, tokenizer, lr=0.5, optimizer_kind="sgd", max_grad_norm=None):
    model = copy.deepcopy(model)
    optimizer = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer_kind == "sgd"
                 else torch.optim.AdamW(model.parameters(), lr=lr))
    metrics = train_on_micro_batches(model, optimizer, micro_batches, packed=packed,
                                     pad_token_id=tokenizer.pad_token_id, max_grad_norm=max_grad_norm)
    return model, optimizer, metrics


def assert_same_weights(a, b, atol=1e-6):
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(x, y, atol=atol, rtol=1e-5, msg=name)


@pytest.mark.parametrize("attention", ["sdpa", PACKED_SDPA])
def test_every_layout_gives_the_one_big_batch_update(model, samples, tokenizer, attention):
    expected, expected_loss = reference_update(model, samples, lr=0.5)
    if attention == PACKED_SDPA:
        use_packed_attention(model)
    longest = max(len(ids) for ids in samples["input_ids"].to_pylist())
    layouts = {
        "packed, one micro-batch": (pack_samples(samples, total_tokens(samples)), True),
        "packed, bins of the longest sample": (pack_samples(samples, longest), True),
        "padded, 1 sequence per micro-batch": (batch_unpacked(samples, 1), False),
        "padded, 2 sequences per micro-batch": (batch_unpacked(samples, 2), False),
    }
    assert layouts["packed, bins of the longest sample"][0].num_rows > 1
    for name, (micro_batches, packed) in layouts.items():
        trained, _, metrics = step(model, micro_batches, packed, tokenizer)
        assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-5), name
        assert metrics["loss/ce"] == pytest.approx(expected_loss, abs=1e-5), name
        assert metrics["micro_batches"] == micro_batches.num_rows, name
        assert_same_weights(trained, expected)

    # The test can tell: normalising each micro-batch by its own token count (a mean of means) moves elsewhere.
    groups = [row["sample_ids"] for row in batch_unpacked(samples, 2).to_pylist()]
    mean_of_means, _ = reference_update(model, samples, lr=0.5, per_group=groups)
    with pytest.raises(AssertionError):
        assert_same_weights(mean_of_means, expected)


def test_metrics_count_tokens_padding_and_components(model, samples, tokenizer):
    loss_tokens = sum(sum(m) for m in samples["loss_mask"].to_pylist())
    _, _, packed = step(model, pack_samples(samples, 512), True, tokenizer, max_grad_norm=1.0)
    _, _, padded = step(model, batch_unpacked(samples, 5), False, tokenizer, max_grad_norm=1.0)
    for metrics in (packed, padded):
        assert metrics["tokens/ce"] == loss_tokens and metrics["tokens/rl"] == metrics["tokens/ref_kl"] == 0
        assert metrics["loss/rl"] == metrics["loss/ref_kl"] == 0.0
        assert metrics["tokens"] == total_tokens(samples)
        assert metrics["grad_norm"] > 0 and metrics["tokens_per_s"] > 0
    assert packed["nonpad_fraction"] == 1.0 and packed["positions"] == total_tokens(samples)
    longest = max(len(ids) for ids in samples["input_ids"].to_pylist())
    assert padded["positions"] == 5 * longest and padded["nonpad_fraction"] < 1.0
    assert packed["loss"] == pytest.approx(padded["loss"], abs=1e-5)


def test_gradient_clipping_caps_the_update(model, samples, tokenizer):
    micro_batches = pack_samples(samples, 512)
    unclipped, _, metrics = step(model, micro_batches, True, tokenizer, lr=1.0)
    clipped, _, clipped_metrics = step(model, micro_batches, True, tokenizer, lr=1.0, max_grad_norm=0.01)
    assert clipped_metrics["grad_norm"] == pytest.approx(metrics["grad_norm"])  # reported before clipping
    moved = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(clipped.parameters(), model.parameters())))
    assert moved.item() == pytest.approx(0.01, rel=1e-3)


def test_nan_loss_raises_and_leaves_weights_and_optimizer_untouched(model, samples, tokenizer):
    micro_batches = pack_samples(samples, 80)
    assert micro_batches.num_rows >= 2
    calls = []

    def poison_second_forward(module, inputs, output):
        calls.append(1)
        return output * float("nan") if len(calls) == 2 else output

    trained = copy.deepcopy(model)
    before = {k: v.clone() for k, v in trained.state_dict().items()}
    optimizer = torch.optim.AdamW(trained.parameters(), lr=0.1)
    trained.lm_head.register_forward_hook(poison_second_forward)
    with pytest.raises(NonFiniteLossError, match="micro-batch 1: loss is nan"):
        train_on_micro_batches(trained, optimizer, micro_batches, packed=True, pad_token_id=tokenizer.pad_token_id,
                               max_grad_norm=1.0)
    assert all(torch.equal(before[k], v) for k, v in trained.state_dict().items())
    assert all(p.grad is None for p in trained.parameters()) and not optimizer.state


def test_empty_micro_batches_are_no_ops(model, samples, tokenizer):
    real = pack_samples(samples, 512)
    rows = samples.to_pylist()
    for row in rows:  # the same samples with nothing to train on
        row["sample_id"] += "-empty"
        row["loss_mask"] = [False] * len(row["input_ids"])
        row["ce_weights"] = [0.0] * len(row["input_ids"])
    empty = pack_samples(pa.Table.from_pylist(rows, schema=wire.TRAINING_SAMPLES), 512)
    with_empty = pa.concat_tables([empty, real, empty])

    expected, _, expected_metrics = step(model, real, True, tokenizer)
    trained, _, metrics = step(model, with_empty, True, tokenizer)
    assert_same_weights(trained, expected, atol=0)
    # The empty ones still run forward and backward (zero gradients), so data-parallel ranks stay in step.
    assert metrics["micro_batches"] == 3 and metrics["loss"] == expected_metrics["loss"]

    # A step with nothing at all to train on does not move the weights or the optimizer (no AdamW decay/momentum).
    untouched, optimizer, metrics = step(model, empty, True, tokenizer, optimizer_kind="adamw")
    assert_same_weights(untouched, model, atol=0)
    assert not optimizer.state and metrics["micro_batches"] == 1 and metrics["grad_norm"] == 0.0


# --- planning and the trainer -------------------------------------------------------------------------------


def chat_file(tmp_path) -> Path:
    import json

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    return path


def make_run(tmp_path, tiny_model_dir, *overrides) -> TrainingInputs:
    config = load_config(SftConfig, ROOT / "configs/sft-tiny.toml", [
        f"run.store=memory://sft-{uuid.uuid4().hex}", f"algorithm.sft.base_model.uri={tiny_model_dir}",
        f"algorithm.sft.dataset.path={chat_file(tmp_path)}", "algorithm.sft.budget.max_steps=6",
        "algorithm.sft.minibatch_size=3", "algorithm.sft.optimizer.kind=adamw", "algorithm.sft.optimizer.lr=1e-2",
        *overrides])
    store = ObjectStore(config.run.store)
    tokenizer = load_tokenizer(ResolvedModel(str(tiny_model_dir)))
    settings = config.settings
    samples = tokenize_examples(load_examples(settings.dataset.path), tokenizer, loss_on=settings.loss_on.kind,
                                max_seq_len=settings.packing.max_seq_len).samples
    plan = plan_batches(samples.num_rows, settings.minibatch_size, settings.budget.max_steps, config.run.seed)
    micro_batches, micro_plan = plan_micro_batches(samples, plan, settings)
    return TrainingInputs(store, config, training_identity(config),
                          {"micro_batches": store.put_table(micro_batches), "plan": store.put_table(micro_plan)})


def open_trainer(run: TrainingInputs, checkpoint_id: str | None = None) -> CausalLmTrainer:
    """The SFT trainer at `checkpoint_id` (at step 0 when None), reading the run's planned micro-batches."""
    batches = PlannedBatches(run.store, run.data_ids["micro_batches"], run.data_ids["plan"])
    if checkpoint_id is None:
        return CausalLmTrainer.initial(run, batches=batches)
    return CausalLmTrainer.from_checkpoint(run, checkpoint_id, batches=batches)


def test_plan_micro_batches_follows_the_seeded_plan(samples):
    config = load_config(SftConfig, ROOT / "configs/sft-tiny.toml", ["algorithm.sft.packing.kind=on",
                                                                      "algorithm.sft.packing.max_seq_len=80",
                                                                      "algorithm.sft.minibatch_size=4"])
    plan = plan_batches(samples.num_rows, 4, 3, seed=1)  # 12 draws over 5 rows: steps span epochs
    micro_batches, micro_plan = plan_micro_batches(samples, plan, config.settings)
    ids = samples["sample_id"].to_pylist()
    for rows, micro_rows in zip(plan["row_indices"].to_pylist(), micro_plan["row_indices"].to_pylist()):
        step_ids = sorted(i for r in micro_rows for i in micro_batches["sample_ids"][r].as_py())
        assert [i.split("#")[0] for i in step_ids] == sorted(ids[r] for r in rows)
        assert all(sum(micro_batches["sequence_lengths"][r].as_py()) <= 80 for r in micro_rows)
    assert [r for rows in micro_plan["row_indices"].to_pylist() for r in rows] == list(range(micro_batches.num_rows))

    # A sample drawn twice into one step packs twice, under two ids.
    twice = pa.Table.from_pylist([{"step": 1, "row_indices": [0, 0, 1]}], schema=wire.BATCH_PLAN)
    micro_batches, _ = plan_micro_batches(samples, twice, config.settings)
    assert sorted(i for row in micro_batches["sample_ids"].to_pylist() for i in row) == ["line-1", "line-1#2",
                                                                                          "line-2"]


def run_segments(run, checkpoint, steps, interval, *, lose_process_after_segment=None):
    """Segments of `interval` steps from `checkpoint`; the trainer is kept between segments unless the process
    is 'lost' after segment number `lose_process_after_segment` (then the next segment reopens its checkpoint)."""
    trainer = open_trainer(run, checkpoint)
    for number, segment in enumerate(SnapshotSchedule(interval, steps).segments(), start=1):
        checkpoint, _ = train_segment(trainer, segment)
        if number == lose_process_after_segment:
            trainer = open_trainer(run, checkpoint)
    return checkpoint


@pytest.mark.parametrize("packing", ["off", "on"])
def test_resuming_from_a_snapshot_reaches_the_same_checkpoint_id(tmp_path, tiny_model_dir, packing):
    run = make_run(tmp_path, tiny_model_dir, f"algorithm.sft.packing.kind={packing}",
                   "algorithm.sft.packing.max_seq_len=96")
    start = open_trainer(run).checkpoint_id
    uninterrupted = run_segments(run, start, 6, interval=2)
    interrupted = run_segments(run, start, 6, interval=2, lose_process_after_segment=1)
    assert interrupted == uninterrupted
    manifest = read_manifest(run.store, uninterrupted)
    assert manifest["kind_of_model"] == "causal_lm" and manifest["step"] == 6
    assert "tokens_per_s" not in manifest["metrics"] and manifest["metrics"]["tokens/ce"] > 0
    assert manifest["data"] == {**run.data_ids, "cursor": 6}


def test_training_lowers_the_loss_and_the_checkpoint_loads_and_generates(tmp_path, tiny_model_dir):
    run = make_run(tmp_path, tiny_model_dir, "algorithm.sft.packing.kind=on", "algorithm.sft.budget.max_steps=8")
    trainer = open_trainer(run)
    pad = trainer.tokenizer.pad_token_id
    every_step = trainer.batches.micro_batches
    before = evaluate_nll(trainer.model, every_step, packed=True, pad_token_id=pad)
    for step_number in range(1, 9):
        metrics = trainer.train_step(step_number)
    checkpoint = trainer.snapshot(metrics)
    after = evaluate_nll(trainer.model, every_step, packed=True, pad_token_id=pad)
    assert after["loss"] < before["loss"] and after["tokens"] == before["tokens"] > 0

    directory = export_hf_directory(run.store, checkpoint, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    for (name, tensor), trained in zip(loaded.state_dict().items(), trainer.model.state_dict().values()):
        assert torch.equal(tensor, trained), name
    prompt = tokenizer.apply_chat_template(CHATS[0][:1], add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    generated = loaded.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
