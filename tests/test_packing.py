"""Packing: best-fit-decreasing bins, the alignment invariant, and packed attention that never crosses sequences."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_lib.model.tiny import build_tiny_qwen2
from rollout_lib.packing import (
    STREAM_COLUMNS,
    batch_unpacked,
    check_micro_batches,
    collate_micro_batch,
    pack_samples,
    token_logprobs,
)
from rollout_lib.wire import MICRO_BATCHES, TRAINING_SAMPLE_DEFAULTS, TRAINING_SAMPLES

PAD = 0


def sample(sample_id, input_ids, loss_mask=None, env="env-a", **streams):
    """An rl sample unless told otherwise: loss_mask past the first token, null rl_weights (weight 1 there), and
    the advantages and sampler logprobs packing requires of rl tokens (zeros); pass a stream as None for null."""
    if loss_mask is None:
        loss_mask = [False] + [True] * (len(input_ids) - 1)
    row = {"sample_id": sample_id, "env": env, "input_ids": list(input_ids), "loss_mask": list(loss_mask)}
    for name in STREAM_COLUMNS[1:]:
        row[name] = streams.get(name, [0.0] * len(row["input_ids"]) if name in ("advantages", "inference_logprobs")
                                else None)
    return row


def samples_table(rows):
    return pa.Table.from_pylist(rows, schema=TRAINING_SAMPLES)


def of_lengths(*lengths):
    return samples_table([sample(f"s{i}", range(10 * i + 1, 10 * i + 1 + n)) for i, n in enumerate(lengths)])


# --- bin packing ---------------------------------------------------------------------------------------------


def test_best_fit_decreasing_pairs_complements():
    # 9, 8, 7 open three bins; 3 fits 7's bin exactly, 2 fits 8's, 1 fits 9's: three full bins.
    packed = pack_samples(of_lengths(9, 1, 8, 2, 7, 3), max_seq_len=10)
    assert packed.schema == MICRO_BATCHES
    assert packed["sample_ids"].to_pylist() == [["s0", "s1"], ["s2", "s3"], ["s4", "s5"]]
    assert packed["sequence_lengths"].to_pylist() == [[9, 1], [8, 2], [7, 3]]
    assert packed["micro_batch_index"].to_pylist() == [0, 1, 2]


def test_best_fit_prefers_the_tightest_bin():
    # 6 -> bin0 (room 4); 5 -> bin1 (room 5); 4 -> bin0, exact fit; 3 -> bin1 (room 2); 2 -> bin1 (room 0).
    packed = pack_samples(of_lengths(6, 5, 4, 3, 2), max_seq_len=10)
    assert packed["sample_ids"].to_pylist() == [["s0", "s2"], ["s1", "s3", "s4"]]

    # 8 -> bin0 (room 2); 6 -> bin1 (room 4); 3 -> bin1 (room 1). The 1 fits both: best fit takes bin1, the
    # tightest, where first fit would take bin0.
    packed = pack_samples(of_lengths(8, 6, 3, 1), max_seq_len=10)
    assert packed["sample_ids"].to_pylist() == [["s0"], ["s1", "s2", "s3"]]
    assert packed["sequence_lengths"].to_pylist() == [[8], [6, 3, 1]]


def test_ties_break_by_original_order():
    packed = pack_samples(of_lengths(3, 3, 3, 3, 3), max_seq_len=6)
    assert packed["sample_ids"].to_pylist() == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert pack_samples(of_lengths(3, 3, 3, 3, 3), max_seq_len=6).equals(packed)


def test_no_bin_exceeds_max_and_no_token_is_lost():
    lengths = [5, 17, 3, 9, 12, 1, 16, 8, 8, 2, 11, 4]
    packed = pack_samples(of_lengths(*lengths), max_seq_len=20)
    sizes = [sum(row) for row in packed["sequence_lengths"].to_pylist()]
    assert max(sizes) <= 20
    assert sum(sizes) == 96  # every token of the input
    assert len(sizes) == 5  # this input packs perfectly: 96 tokens in the fewest bins of 20
    assert sorted(i for ids in packed["sample_ids"].to_pylist() for i in ids) == sorted(
        f"s{i}" for i in range(len(lengths))
    )


def test_sample_at_exactly_max_len_fits_and_longer_raises():
    assert pack_samples(of_lengths(4), max_seq_len=4)["sequence_lengths"].to_pylist() == [[4]]
    with pytest.raises(ValueError, match="'s1'.*5 tokens.*max_seq_len=4"):
        pack_samples(of_lengths(4, 5), max_seq_len=4)


def test_envs_mix_in_a_bin():
    rows = [sample("a", [1, 2, 3], env="math"), sample("b", [4, 5], env="chat")]
    packed = pack_samples(samples_table(rows), max_seq_len=8)
    assert packed["sample_ids"].to_pylist() == [["a", "b"]]


# --- streams and the alignment invariant ---------------------------------------------------------------------


def test_positions_restart_and_streams_concatenate_across_the_boundary():
    rows = [
        sample("long", [11, 12, 13, 14], [False, False, True, True], advantages=[0.0, 0.0, 0.5, 0.5]),
        sample("short", [21, 22, 23], [False, True, False], ce_weights=[0.0, 1.0, 0.0], rl_weights=[0.0] * 3,
               advantages=None, inference_logprobs=None),  # a ce-only sample: zero rl weights, null rl streams
    ]
    [mb] = pack_samples(samples_table(rows), max_seq_len=7).to_pylist()
    assert mb["sample_ids"] == ["long", "short"]
    assert mb["input_ids"] == [11, 12, 13, 14, 21, 22, 23]
    assert mb["position_ids"] == [0, 1, 2, 3, 0, 1, 2]
    assert mb["loss_mask"] == [False, False, True, True, False, True, False]
    assert mb["advantages"] == [0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0]  # null -> 0.0
    assert mb["ce_weights"] == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    # Null rl_weights: 1 on the sample's loss_mask tokens; the ce sample's zeros keep its loss_mask token out.
    assert mb["rl_weights"] == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    # Other null streams become wire.py's documented defaults: no weight in any loss term, and temperature 1.
    for name in ("ref_kl_weights", "ref_logprobs", "inference_logprobs"):
        assert mb[name] == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], name
    assert mb["temperatures"] == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_null_rl_weights_mean_weight_one_on_every_loss_mask_token():
    assert TRAINING_SAMPLE_DEFAULTS["rl_weights"] == "loss_mask"
    rows = [sample("a", [1, 2, 3], [False, True, True]), sample("b", [4, 5], [False, True], rl_weights=[0.0, 0.5])]
    [mb] = pack_samples(samples_table(rows), max_seq_len=8).to_pylist()
    assert mb["rl_weights"] == [0.0, 1.0, 1.0, 0.0, 0.5]
    assert mb["ref_kl_weights"] == [0.0] * 5


def test_a_component_token_without_the_streams_its_loss_reads_raises():
    # A producer bug, never a default: rl tokens with null advantages would train with A = 0.
    with pytest.raises(ValueError, match=r"sample 'rl' has 2 rl token\(s\) but no advantages"):
        pack_samples(samples_table([sample("rl", [1, 2, 3], advantages=None)]), max_seq_len=8)
    with pytest.raises(ValueError, match="sample 'rl' has 2 rl token.*no inference_logprobs"):
        batch_unpacked(samples_table([sample("rl", [1, 2, 3], inference_logprobs=None)]), 2)
    with pytest.raises(ValueError, match="sample 'kl' has 1 ref_kl token.*no ref_logprobs"):
        pack_samples(samples_table([sample("kl", [1, 2, 3], rl_weights=[0.0] * 3, advantages=None,
                                           ref_kl_weights=[0.0, 0.0, 1.0])]), max_seq_len=8)
    # Kept out of rl by zero weights, a sample needs no advantages; ref_kl with its logprobs packs.
    pack_samples(samples_table([sample("out", [1, 2, 3], rl_weights=[0.0] * 3, advantages=None),
                                sample("kl", [4, 5], rl_weights=[0.0] * 2, advantages=None,
                                       ref_kl_weights=[0.0, 1.0], ref_logprobs=[0.0, -1.0])]), max_seq_len=8)


# A grpo sample and an opd sample as the advantages stage ships them (rollout_lib/algo/stamping.py): grpo ships
# advantages and the sampler's logprobs and leaves rl_weights null (weight 1 on its loss_mask tokens); opd ships
# zero rl_weights, ref_kl_weights on its completion, the teacher's logprobs on every position (prompt included:
# the teacher scores the whole sequence) and no advantages. Values are exact in float32.
GRPO = sample("grpo", [11, 12, 13, 14, 15], [False, False, True, True, True], env="words",
              advantages=[0.0, 0.0, 0.5, 0.5, -0.25], inference_logprobs=[0.0, 0.0, -0.5, -0.25, -1.0])
OPD = sample("opd", [21, 22, 23, 24], [False, False, True, True], env="distill", advantages=None,
             rl_weights=[0.0] * 4, ref_kl_weights=[0.0, 0.0, 1.0, 1.0], ref_logprobs=[0.0, -2.0, -1.5, -0.75],
             inference_logprobs=[0.0, 0.0, -0.5, -1.25])
# What each sample's positions hold after packing: its own values, and the documented default where it shipped
# null (wire.TRAINING_SAMPLE_DEFAULTS).
PACKED_AS = {
    "grpo": {"loss_mask": [False, False, True, True, True], "advantages": [0.0, 0.0, 0.5, 0.5, -0.25],
             "rl_weights": [0.0, 0.0, 1.0, 1.0, 1.0], "ce_weights": [0.0] * 5, "ref_kl_weights": [0.0] * 5,
             "ref_logprobs": [0.0] * 5, "inference_logprobs": [0.0, 0.0, -0.5, -0.25, -1.0],
             "temperatures": [1.0] * 5},
    "opd": {"loss_mask": [False, False, True, True], "advantages": [0.0] * 4, "rl_weights": [0.0] * 4,
            "ce_weights": [0.0] * 4, "ref_kl_weights": [0.0, 0.0, 1.0, 1.0], "ref_logprobs": [0.0, -2.0, -1.5, -0.75],
            "inference_logprobs": [0.0, 0.0, -0.5, -1.25], "temperatures": [1.0] * 4},
}


@pytest.mark.parametrize("order", [("grpo", "opd"), ("opd", "grpo")])
def test_a_grpo_and_an_opd_sample_in_one_bin_keep_every_stream_at_its_position(order):
    """The alignment invariant across the boundary of two algorithms: every per-token stream of the micro-batch
    holds each sample's values at exactly its positions, in either order, packed or padded."""
    from rollout_lib.losses import component_loss, count_component_tokens

    rows = {"grpo": GRPO, "opd": OPD}
    table = samples_table([rows[name] for name in order])
    [mb] = pack_samples(table, max_seq_len=9).to_pylist()
    assert mb["sample_ids"] == list(order)
    assert mb["sequence_lengths"] == [len(rows[name]["input_ids"]) for name in order]
    assert mb["input_ids"] == [token for name in order for token in rows[name]["input_ids"]]
    assert mb["position_ids"] == [p for name in order for p in range(len(rows[name]["input_ids"]))]
    for column in STREAM_COLUMNS:
        assert len(mb[column]) == len(mb["input_ids"]) == 9, column
        assert mb[column] == [value for name in order for value in PACKED_AS[name][column]], column
    # Packing off groups the same two samples into a row of the same layout.
    [unpacked] = batch_unpacked(table, 2, max_seq_len=9).to_pylist()
    assert all(unpacked[column] == mb[column] for column in ("input_ids", "position_ids", *STREAM_COLUMNS))

    # What the trainer reads at those positions: on-policy (logprobs = the sampler's), d loss / d logp_t is
    # -A_t / N_rl on grpo's completion tokens, -(logp_ref_t - logp_t) / N_ref_kl on opd's, and 0 everywhere else.
    batch = collate_micro_batch(mb, packed=True, pad_token_id=PAD)
    counts = count_component_tokens(batch)
    assert counts == {"rl": 3, "ce": 0, "ref_kl": 2}
    logprobs = batch["inference_logprobs"].clone().requires_grad_(True)
    loss, metrics = component_loss(logprobs, batch, counts)
    loss.backward()
    expected_grad = {"grpo": [0.0, 0.0, -0.5 / 3, -0.5 / 3, 0.25 / 3],
                     "opd": [0.0, 0.0, -(-1.5 + 0.5) / 2, -(-0.75 + 1.25) / 2]}
    assert logprobs.grad.tolist() == pytest.approx([g for name in order for g in expected_grad[name]], abs=1e-7)
    assert metrics["loss/rl"] == pytest.approx(-(0.5 + 0.5 - 0.25) / 3)
    assert metrics["loss/ref_kl"] == pytest.approx(-((-1.5 + 0.5) + (-0.75 + 1.25)) / 2)
    assert metrics["ref_kl/kl"] == pytest.approx(((-0.5 + 1.5) + (-1.25 + 0.75)) / 2)


def test_the_grpo_and_opd_producers_ship_streams_that_pack_at_their_positions():
    """The same boundary from the real producers: grpo's `assign` and opd's ship-time `score` (a teacher pool whose
    logprob of token t is -token/64, so a shift by one position would show), stamped and packed into one bin."""
    import asyncio

    from rollout_lib import wire
    from rollout_lib.algo import AlgorithmResources
    from rollout_lib.algo.grpo import Grpo, GrpoSettings
    from rollout_lib.algo.opd import OnPolicyDistillation, OpdSettings
    from rollout_lib.algo.stamping import assign_advantages, score_for_shipping, stamp_training_samples

    class Teacher:  # the run's ServedModels and the teacher's pool, as far as opd uses them
        def pool(self, settings, *, tokenizer, where):
            assert where == "algorithm.rl.envs[1].algo.teacher"
            return self

        async def score(self, ids):  # prefill logprobs of tokens 1.. (the first token has no context)
            return [-token / 64 for token in ids[1:]]

    algorithms = {
        "words": Grpo(GrpoSettings(), where="algorithm.rl.envs[0].algo"),
        "distill": OnPolicyDistillation(OpdSettings(teacher={"base_url": "http://127.0.0.1:9/v1", "name": "t"}),
                                        AlgorithmResources(tokenizer=object(), served_models=Teacher()),
                                        where="algorithm.rl.envs[1].algo"),
    }
    rollouts = pa.Table.from_pylist([
        {"sample_id": "w#0", "example_id": "w", "env": "words", "group_index": 0, "prompt_ids": [11, 12],
         "completion_ids": [13, 14, 15], "sampling_logprobs": [-0.5, -0.25, -1.0], "completion_text": "",
         "answer": None, "info": None, "reward": 1.0, "reward_error": None},
        {"sample_id": "w#1", "example_id": "w", "env": "words", "group_index": 1, "prompt_ids": [11, 12],
         "completion_ids": [16], "sampling_logprobs": [-0.75], "completion_text": "", "answer": None, "info": None,
         "reward": 0.0, "reward_error": None},
        {"sample_id": "d#0", "example_id": "d", "env": "distill", "group_index": 0, "prompt_ids": [21, 22],
         "completion_ids": [23, 24], "sampling_logprobs": [-0.5, -1.25], "completion_text": "", "answer": None,
         "info": None, "reward": None, "reward_error": "no reward needed"},
    ], schema=wire.ROLLOUTS)
    samples = stamp_training_samples(rollouts, assign_advantages(rollouts, algorithms), algorithms, max_seq_len=16)
    samples = asyncio.run(score_for_shipping(samples, algorithms))
    [mb] = pack_samples(samples, max_seq_len=16).to_pylist()
    assert mb["sample_ids"] == ["w#0", "w#1", "d#0"] and mb["sequence_lengths"] == [5, 3, 4]
    assert mb["input_ids"] == [11, 12, 13, 14, 15, 11, 12, 16, 21, 22, 23, 24]
    assert mb["loss_mask"] == [False, False, True, True, True, False, False, True, False, False, True, True]
    assert mb["advantages"] == [0.0, 0.0, 0.5, 0.5, 0.5, 0.0, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0]
    assert mb["rl_weights"] == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert mb["ref_kl_weights"] == [0.0] * 8 + [0.0, 0.0, 1.0, 1.0]
    assert mb["ref_logprobs"] == [0.0] * 8 + [0.0, -22 / 64, -23 / 64, -24 / 64]
    assert mb["inference_logprobs"] == [0.0, 0.0, -0.5, -0.25, -1.0, 0.0, 0.0, -0.75, 0.0, 0.0, -0.5, -1.25]
    assert mb["ce_weights"] == [0.0] * 12 and mb["temperatures"] == [1.0] * 12


def test_assistant_loss_mask_survives_packing(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_qwen2(tmp_path / "tiny"))
    conversations = [
        [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hello there, friend!"},
        ],
        [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}],
    ]
    rows, originals = [], {}
    for index, messages in enumerate(conversations):
        out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        mask = [bool(m) for m in out["assistant_masks"]]
        rows.append(sample(f"chat{index}", out["input_ids"], mask))
        originals[f"chat{index}"] = (out["input_ids"], mask)

    total = sum(len(ids) for ids, _ in originals.values())
    [mb] = pack_samples(samples_table(rows), max_seq_len=total).to_pylist()
    assert mb["sequence_lengths"] == [len(originals[s][0]) for s in mb["sample_ids"]]
    offset = 0
    for sample_id, length in zip(mb["sample_ids"], mb["sequence_lengths"]):
        ids, mask = originals[sample_id]
        assert mb["input_ids"][offset : offset + length] == ids
        assert mb["loss_mask"][offset : offset + length] == mask
        # The assistant tokens sit at the same offsets within the sequence, shifted by where it starts.
        expected = [offset + i for i, keep in enumerate(mask) if keep]
        assert [t for t in range(offset, offset + length) if mb["loss_mask"][t]] == expected
        assert tokenizer.decode([mb["input_ids"][t] for t in expected]).endswith("<|im_end|>")
        offset += length
    # Across the first boundary: the last token of sequence 1 (newline after <|im_end|>) is not trained, and the
    # first token of sequence 2 (<|im_start|>) is not trained and starts at position 0.
    boundary = mb["sequence_lengths"][0]
    assert mb["loss_mask"][boundary - 2 : boundary + 1] == [True, False, False]
    assert mb["position_ids"][boundary - 1 : boundary + 1] == [mb["sequence_lengths"][0] - 1, 0]
    assert tokenizer.decode(mb["input_ids"][boundary - 2 : boundary + 1]) == "<|im_end|>\n<|im_start|>"


@pytest.mark.parametrize("column", ["loss_mask", "advantages", "inference_logprobs", "ref_logprobs"])
def test_misaligned_column_raises_naming_sample_and_column(column):
    good = sample("ok", [1, 2, 3])
    bad = sample("broken", [4, 5, 6])
    bad[column] = [False, True] if column == "loss_mask" else [0.0, 0.0]
    with pytest.raises(ValueError, match=f"'broken'.*'{column}'.*2 entries.*3"):
        pack_samples(samples_table([good, bad]), max_seq_len=16)
    with pytest.raises(ValueError, match="'broken'"):
        batch_unpacked(samples_table([good, bad]), 2)


def test_weight_on_first_token_raises():
    with pytest.raises(ValueError, match="'first'.*'loss_mask'.*first token"):
        pack_samples(samples_table([sample("first", [1, 2], [True, True])]), max_seq_len=4)
    with pytest.raises(ValueError, match="'first'.*'ce_weights'"):
        pack_samples(samples_table([sample("first", [1, 2], ce_weights=[1.0, 1.0])]), max_seq_len=4)


def test_empty_and_duplicate_samples_raise():
    with pytest.raises(ValueError, match="'empty' has no tokens"):
        pack_samples(samples_table([sample("empty", [], [])]), max_seq_len=4)
    with pytest.raises(ValueError, match="'twice' appears twice"):
        pack_samples(samples_table([sample("twice", [1, 2]), sample("twice", [3, 4])]), max_seq_len=4)


def test_check_micro_batches_catches_a_tampered_row():
    packed = pack_samples(of_lengths(3, 2), max_seq_len=5).to_pylist()
    packed[0]["ref_logprobs"] = packed[0]["ref_logprobs"][:-1]
    with pytest.raises(ValueError, match="micro-batch 0: column 'ref_logprobs' has 4 entries, input_ids has 5"):
        check_micro_batches(pa.Table.from_pylist(packed, schema=MICRO_BATCHES))
    packed = pack_samples(of_lengths(3, 2), max_seq_len=5).to_pylist()
    packed[0]["position_ids"] = [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="restart"):
        check_micro_batches(pa.Table.from_pylist(packed, schema=MICRO_BATCHES))


def test_batch_unpacked_groups_in_order():
    table = batch_unpacked(of_lengths(3, 5, 2, 4, 1), 2)
    assert table["sample_ids"].to_pylist() == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert table["position_ids"].to_pylist()[0] == [0, 1, 2, 0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="'s1'"):
        batch_unpacked(of_lengths(3, 5), 2, max_seq_len=4)


# --- collate -------------------------------------------------------------------------------------------------


def test_collate_layouts_share_stream_order():
    rows = [sample("a", [5, 6, 7], [False, True, True]), sample("b", [8, 9], [False, True], advantages=[0.0, 2.0])]
    [row] = pack_samples(samples_table(rows), max_seq_len=8).to_pylist()
    packed = collate_micro_batch(row, packed=True, pad_token_id=PAD)
    padded = collate_micro_batch(row, packed=False, pad_token_id=PAD)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert "attention_mask" not in packed
    assert padded["input_ids"].tolist() == [[5, 6, 7], [8, 9, PAD]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert padded["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    for name in STREAM_COLUMNS:
        assert torch.equal(packed[name], padded[name]), name
    assert packed["loss_mask"].dtype == torch.bool
    assert packed["advantages"].tolist() == [0.0, 0.0, 0.0, 0.0, 2.0]
    assert packed["sequence_lengths"].tolist() == [3, 2]


# --- packed attention on the tiny Qwen2 ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "qwen2")


def _three_sequence_bin():
    generator = torch.Generator().manual_seed(0)
    lengths = [9, 4, 6]
    rows = [
        sample(f"seq{i}", torch.randint(3, 500, (n,), generator=generator).tolist()) for i, n in enumerate(lengths)
    ]
    [row] = pack_samples(samples_table(rows), max_seq_len=sum(lengths)).to_pylist()
    assert row["sequence_lengths"] == lengths
    return row


def _one_by_one(model, row):
    """Reference: each sequence alone, no packing, no padding."""
    pieces, offset = [], 0
    for length in row["sequence_lengths"]:
        ids = torch.tensor([row["input_ids"][offset : offset + length]])
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        pieces.append(torch.cat([torch.tensor([0.0]), logprobs]))  # the first token: nothing predicts it
        offset += length
    return torch.cat(pieces)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_logprobs_equal_one_by_one(tiny_dir, attn_implementation):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation=attn_implementation).eval()
    row = _three_sequence_bin()
    with torch.no_grad():
        reference = _one_by_one(model, row)
        packed = token_logprobs(model, collate_micro_batch(row, packed=True, pad_token_id=PAD))
        padded = token_logprobs(model, collate_micro_batch(row, packed=False, pad_token_id=PAD))
    assert packed.shape == padded.shape == (sum(row["sequence_lengths"]),)
    torch.testing.assert_close(packed, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded, reference, atol=1e-5, rtol=0)
    starts = [0, 9, 13]
    assert packed[starts].tolist() == [0.0, 0.0, 0.0]  # a first token has no prediction: logprob 0 by convention
    assert (packed[[t for t in range(19) if t not in starts]] < 0).all()


def test_logprobs_of_needed_tokens_only_equal_the_full_computation_and_their_gradient(tiny_dir):
    """`needed`: the output head runs only at positions predicting a needed token (logits_to_keep); those values and
    the gradient of a loss over them match the full computation within float rounding, in both layouts and with
    per-token temperatures; every other token reads FIRST_TOKEN_LOGPROB."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    row = _three_sequence_bin()
    total = sum(row["sequence_lengths"])
    row["temperatures"] = [0.7] * total
    needed = torch.zeros(total, dtype=torch.bool)
    needed[[2, 3, 4, 7, 8, 11, 12, 16, 17, 18]] = True  # some tokens of each sequence, none of their first
    for packed in (True, False):
        batch = collate_micro_batch(row, packed=packed, pad_token_id=PAD)
        results = []
        for subset in (None, needed):
            model.zero_grad(set_to_none=True)
            logprobs = token_logprobs(model, batch, needed=subset)
            (-(logprobs * needed).sum()).backward()
            results.append((logprobs.detach(), model.lm_head.weight.grad.clone(),
                            model.model.layers[0].mlp.up_proj.weight.grad.clone()))
        (full, *full_grads), (part, *part_grads) = results
        torch.testing.assert_close(part[needed], full[needed], atol=1e-6, rtol=0)
        assert (part[~needed] == 0.0).all() and (full[~needed] != 0.0).any()  # the others were not computed
        for mine, reference in zip(part_grads, full_grads):
            torch.testing.assert_close(mine, reference, atol=1e-5 * float(reference.abs().max()), rtol=1e-4)
            assert reference.abs().max() > 0


def test_attention_would_leak_without_packed_detection(tiny_dir):
    # Control: the equality above is not vacuous. If transformers did not isolate the sequences (here forced by
    # a cache, which turns off packed-sequence detection), later sequences would see earlier ones.
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    row = _three_sequence_bin()
    batch = collate_micro_batch(row, packed=True, pad_token_id=PAD)
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits
        isolated = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    assert torch.allclose(leaky[0, :9], isolated[0, :9], atol=1e-5)  # the first sequence sees nothing before it
    assert not torch.allclose(leaky[0, 9:], isolated[0, 9:], atol=1e-3)


def test_token_logprobs_is_differentiable_and_ignores_the_first_token(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    row = _three_sequence_bin()
    batch = collate_micro_batch(row, packed=True, pad_token_id=PAD)
    logprobs = token_logprobs(model, batch)
    loss = -(logprobs * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    assert model.model.embed_tokens.weight.grad is not None
    assert torch.isfinite(model.model.embed_tokens.weight.grad).all()


def test_packed_batch_must_have_one_row(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with pytest.raises(ValueError, match="exactly one row"):
        token_logprobs(model, {"input_ids": torch.ones(2, 3, dtype=torch.long), "position_ids": torch.zeros(2, 3)})


# --- shared prefixes -----------------------------------------------------------------------------------------


def _groups(prompt_lengths=(12, 10), completions=3, seed=0, shared_start=False):
    """Groups of rl samples: each group's prompt (loss-masked) then a different completion per sample."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for group, prompt_length in enumerate(prompt_lengths):
        prompt = torch.randint(3, 500, (prompt_length,), generator=generator).tolist()
        for index in range(completions):
            completion = torch.randint(3, 500, (3 + 2 * index,), generator=generator).tolist()
            if shared_start:  # every completion starts with the same token: weighted, so never shared
                completion[0] = 7
            ids = prompt + completion
            rows.append(sample(f"g{group}#{index}", ids, [False] * prompt_length + [True] * len(completion),
                               advantages=[0.0] * prompt_length + [0.5 - index * 0.25] * len(completion),
                               temperatures=[0.7] * len(ids)))
    return rows


def test_a_groups_prompt_is_stored_once_and_weighted_tokens_are_never_shared():
    rows = _groups(shared_start=True)
    [mb] = pack_samples(samples_table(rows), max_seq_len=200, share_prefixes=True).to_pylist()
    assert mb["sample_ids"] == ["g0#0", "g0#1", "g0#2", "g1#0", "g1#1", "g1#2"]
    # The shared completion token carries weight, so only the prompt is shared.
    assert mb["shared_prefix_lengths"] == [0, 12, 12, 0, 10, 10]
    assert mb["sequence_lengths"] == [15, 5, 7, 13, 5, 7]
    assert mb["position_ids"][15:20] == [12, 13, 14, 15, 16]  # a sharing sequence continues its prefix
    # Every sample is its root's prefix then its stored tokens, with its own streams there.
    stored, offset = {}, 0
    for sample_id, length in zip(mb["sample_ids"], mb["sequence_lengths"]):
        stored[sample_id] = (mb["input_ids"][offset:offset + length], mb["advantages"][offset:offset + length])
        offset += length
    for row in rows:
        group = row["sample_id"].split("#")[0]
        root_ids = stored[f"{group}#0"][0]
        shared = len(row["input_ids"]) - len(stored[row["sample_id"]][0])
        assert root_ids[:shared] + stored[row["sample_id"]][0] == row["input_ids"]
        assert stored[row["sample_id"]][1] == pytest.approx(row["advantages"][shared:])
    unshared = pack_samples(samples_table(rows), max_seq_len=200).to_pylist()[0]
    assert unshared["shared_prefix_lengths"] == [0] * 6 and sum(unshared["sequence_lengths"]) == 96


def test_a_group_longer_than_a_micro_batch_splits_into_groups_that_each_store_the_prompt():
    rows = _groups(prompt_lengths=(12,), completions=4)  # stored: 15, then 5, 7, 9 sharing
    table = pack_samples(samples_table(rows), max_seq_len=30, share_prefixes=True)
    assert sorted(table["sample_ids"].to_pylist()) == [["g0#0", "g0#1", "g0#2"], ["g0#3"]]
    assert table["shared_prefix_lengths"].to_pylist() == [[0, 12, 12], [0]]
    assert all(sum(lengths) <= 30 for lengths in table["sequence_lengths"].to_pylist())


def test_a_sharing_sequence_without_a_whole_one_before_it_is_refused():
    [row] = pack_samples(samples_table(_groups(prompt_lengths=(12,))), max_seq_len=200,
                         share_prefixes=True).to_pylist()
    row["shared_prefix_lengths"][0], row["position_ids"][:15] = 3, list(range(3, 18))
    with pytest.raises(ValueError, match="follows no sequence stored whole"):
        check_micro_batches(pa.Table.from_pylist([row], schema=MICRO_BATCHES))
    with pytest.raises(ValueError, match="packed layout"):
        collate_micro_batch(pack_samples(samples_table(_groups(prompt_lengths=(12,))), max_seq_len=200,
                                         share_prefixes=True).to_pylist()[0], packed=False, pad_token_id=PAD)


def test_shared_prefixes_train_what_unshared_packing_trains(tiny_dir):
    """The same per-token logprobs (temperatures included) and the same gradient of an rl-like loss as the
    unshared packing, within float rounding, from a third fewer tokens; a model without the packed attention
    refuses the layout instead of attending past the prefix."""
    from rollout_lib.model.packed_attention import use_packed_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    use_packed_attention(model)
    rows = _groups(prompt_lengths=(12, 10, 14))
    results = {}
    for share in (False, True):
        [row] = pack_samples(samples_table(rows), max_seq_len=400, share_prefixes=share).to_pylist()
        batch = collate_micro_batch(row, packed=True, pad_token_id=PAD)
        model.zero_grad(set_to_none=True)
        logprobs = token_logprobs(model, batch, needed=batch["loss_mask"])
        (-(logprobs * batch["advantages"]).sum()).backward()
        per_sample, offset = {}, 0
        for sample_id, length in zip(row["sample_ids"], row["sequence_lengths"]):
            mask = batch["loss_mask"][offset:offset + length]
            per_sample[sample_id] = logprobs.detach()[offset:offset + length][mask]
            offset += length
        grads = [p.grad.clone() for p in (model.lm_head.weight, model.model.layers[0].self_attn.q_proj.weight,
                                          model.model.embed_tokens.weight)]
        results[share] = (per_sample, grads, int(batch["input_ids"].numel()))
    (plain, plain_grads, plain_tokens), (shared, shared_grads, shared_tokens) = results[False], results[True]
    assert shared_tokens == plain_tokens - 2 * (12 + 10 + 14)
    assert plain.keys() == shared.keys()
    for sample_id in plain:
        assert (plain[sample_id] < 0).all()
        torch.testing.assert_close(shared[sample_id], plain[sample_id], atol=1e-5, rtol=0)
    for mine, reference in zip(shared_grads, plain_grads):
        assert reference.abs().max() > 0
        torch.testing.assert_close(mine, reference, atol=1e-5 * float(reference.abs().max()), rtol=1e-4)

    plain_model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    [row] = pack_samples(samples_table(rows), max_seq_len=400, share_prefixes=True).to_pylist()
    with pytest.raises(ValueError, match="packed attention"):
        token_logprobs(plain_model, collate_micro_batch(row, packed=True, pad_token_id=PAD))
