"""`rollout runs samples --eval`: an SFT and a reward-model run's held-out examples with the model's predictions
(issue 41, docs/runs.md), read back from real tiny runs' stores and checked against recomputation.

Two runs share the module, 2 steps each, each held out on its own training file (data/rm-tiny.jsonl: 4 pairs;
data/sft-tiny.jsonl: 4 conversations, packed into one micro-batch so that its rows are split per example). The RM
run ends on the checkpoint the same training without a held-out set ends on, and its evaluations are the metrics
alone: recording the rows changes neither the training nor what a run reports.
"""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from clirun import train_in_process
from conftest import ROOT
from rollout_cli.main import main
from rollout_lib import wire
from rollout_lib.runlog.eval_tables import read_eval_tables, record_eval_tables
from rollout_lib.runlog.metrics_file import MetricsFile
from rollout_lib.store import ObjectStore

RM_RUN, SFT_RUN = "evalrows-rm", "evalrows-sft"


pytestmark = pytest.mark.slow  # every test reads the module's two tiny runs (~16 s to train)


@pytest.fixture(scope="module")
def runs(prefect_server, tmp_path_factory) -> tuple[ObjectStore, dict, dict]:
    store = ObjectStore(str(tmp_path_factory.mktemp("evalrows") / "store"))
    rm = train_in_process("train", "rm", "--config", str(ROOT / "configs/rm-tiny.toml"), "--store", store.root,
                          "--name", RM_RUN, "--max-steps", "2", "--set",
                          f'algorithm.rm.eval_dataset={{type = "jsonl_path", path = "{ROOT / "data/rm-tiny.jsonl"}"}}')
    sft = train_in_process("train", "sft", "--config", str(ROOT / "configs/sft-tiny.toml"), "--store", store.root,
                           "--name", SFT_RUN, "--max-steps", "2",
                           "--set", f"algorithm.sft.dataset.path={ROOT / 'data/sft-tiny.jsonl'}",
                           "--set", f"algorithm.sft.eval_dataset.path={ROOT / 'data/sft-tiny.jsonl'}",
                           "--set", "algorithm.sft.packing.kind=on")
    return store, rm, sft


def rollout(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def eval_json(capsys, store: ObjectStore, run: str, *args: str) -> dict:
    code, out, err = rollout(capsys, "runs", "samples", run, "--store", store.root, "--eval", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / path).read_text().splitlines() if line.strip()]


def test_recording_rows_changes_neither_the_checkpoints_nor_the_metrics(runs, tmp_path):
    """The same RM training without a held-out set (nothing evaluated, no rows) ends on the same checkpoint; the
    run's evaluations are the metrics alone, as before rows were kept (the rows' id goes to the record only)."""
    _, rm, sft = runs
    plain = train_in_process("train", "rm", "--config", str(ROOT / "configs/rm-tiny.toml"), "--store",
                             str(tmp_path / "store"), "--name", RM_RUN, "--max-steps", "2")
    assert plain["checkpoint"] == rm["checkpoint"]
    assert set(rm["eval_after"]) == {"accuracy", "mean_margin", "pairs", "loss"}
    assert set(sft["eval_after"]) == {"loss", "perplexity", "tokens"}


def test_reward_model_pairs_worst_first_with_the_scores_the_checkpoint_gives(capsys, runs):
    from rollout_lib.rm.checkpoints import score_with_checkpoint

    store, rm, _ = runs
    document = eval_json(capsys, store, RM_RUN)
    assert (document["step"], document["steps"], document["algorithm"]) == (2, [0, 2], "rm")
    rows = document["rows"]
    assert len(rows) == document["examples"] == 4
    assert [row["margin"] for row in rows] == sorted(row["margin"] for row in rows)  # lowest margin first
    # the rows' accuracy and loss are the evaluation's
    assert sum(row["correct"] for row in rows) / 4 == rm["eval_after"]["accuracy"]
    assert math.isclose(sum(row["loss"] for row in rows) / 4, rm["eval_after"]["loss"], rel_tol=1e-6)
    # the text is the data's, and the scores are the final checkpoint's, scored again from the store
    pairs = jsonl("data/rm-tiny.jsonl")
    for row in rows:
        pair = pairs[row["pair_index"]]
        assert (row["prompt"], row["chosen"], row["rejected"]) == (pair["prompt"], pair["chosen"], pair["rejected"])
        assert row["source_line"] == row["pair_index"] + 1
    scored = score_with_checkpoint(store, rm["checkpoint"], pa.table({
        "prompt": [row["prompt"] for row in rows for _ in (0, 1)],
        "response": [response for row in rows for response in (row["chosen"], row["rejected"])],
        "source_line": [row["source_line"] for row in rows for _ in (0, 1)]}), max_seq_len=64)
    rewards = scored.column("reward").to_pylist()
    for index, row in enumerate(rows):
        assert row["r_chosen"] == pytest.approx(rewards[2 * index], abs=1e-5)
        assert row["r_rejected"] == pytest.approx(rewards[2 * index + 1], abs=1e-5)
        assert row["margin"] == pytest.approx(row["r_chosen"] - row["r_rejected"], abs=1e-12)
        assert row["correct"] == (row["margin"] > 0)
        assert row["loss"] == pytest.approx(math.log1p(math.exp(-row["margin"])), rel=1e-9)


def test_reward_model_step_0_best_and_worst(capsys, runs):
    store, _, _ = runs
    before = eval_json(capsys, store, RM_RUN, "--step", "0")
    after = eval_json(capsys, store, RM_RUN)
    assert before["step"] == 0 and [row["margin"] for row in before["rows"]] != [row["margin"] for row in
                                                                                  after["rows"]]
    worst, best = (eval_json(capsys, store, RM_RUN, option, "2")["rows"] for option in ("--worst", "--best"))
    assert worst == after["rows"][:2]
    assert [row["margin"] for row in best] == sorted((row["margin"] for row in after["rows"]), reverse=True)[:2]


def test_sft_examples_worst_first_and_their_losses_add_up_to_the_evaluation(capsys, runs):
    store, _, sft = runs
    document = eval_json(capsys, store, SFT_RUN)
    assert (document["step"], document["steps"], document["algorithm"]) == (2, [0, 2], "sft")
    rows = document["rows"]
    assert len(rows) == 4
    assert [row["loss"] for row in rows] == sorted((row["loss"] for row in rows), reverse=True)  # highest first
    assert sum(row["tokens"] for row in rows) == sft["eval_after"]["tokens"]
    total = sum(row["nll_sum"] for row in rows) / sum(row["tokens"] for row in rows)
    assert math.isclose(total, sft["eval_after"]["loss"], rel_tol=1e-6)  # the token-weighted mean is the eval loss
    examples = jsonl("data/sft-tiny.jsonl")
    for row in rows:
        assert row["loss"] == pytest.approx(row["nll_sum"] / row["tokens"], rel=1e-12)
        example = examples[row["source_line"] - 1]
        completion = example.get("completion") or example["messages"][-1]["content"]
        assert row["completion"] == completion and row["prompt"][-1]["role"] == "user"
    assert len({row["loss"] for row in rows}) == 4  # one packed micro-batch, split into four different losses


def test_one_sft_example_evaluated_alone_has_its_row(capsys, runs, tmp_path):
    """The split at sequence boundaries: one example on its own (its own micro-batch) gives its row's numbers."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_lib.checkpoint import export_hf_directory
    from rollout_lib.packing import batch_unpacked
    from rollout_lib.sft.evaluate import evaluate_nll

    store, _, sft = runs
    worst = eval_json(capsys, store, SFT_RUN, "--worst", "1")["rows"][0]
    samples = store.get_table(sft["data"]["tokenized"]["samples"], wire.TRAINING_SAMPLES)  # the eval file's too
    alone = samples.filter(pc.equal(samples.column("sample_id"), worst["sample_id"]))
    model = AutoModelForCausalLM.from_pretrained(export_hf_directory(store, sft["checkpoint"], tmp_path / "model"),
                                                 dtype=torch.float32)
    metrics = evaluate_nll(model, batch_unpacked(alone, 1, max_seq_len=2048), packed=False, pad_token_id=0)
    assert metrics["tokens"] == worst["tokens"]
    assert metrics["loss"] == pytest.approx(worst["loss"], rel=1e-4)


def test_the_terminal_view_one_panel_per_example(capsys, runs):
    store, _, _ = runs
    code, out, err = rollout(capsys, "runs", "samples", RM_RUN, "--store", store.root, "--eval", "--worst", "2")
    assert code == 0, err
    assert "held-out evaluation at step 2" in out and out.count("pair ") == 2 and "rejected:" in out
    code, out, err = rollout(capsys, "runs", "samples", SFT_RUN, "--store", store.root, "--eval", "--step", "0")
    assert code == 0, err
    assert out.count("per token  (nll") == 4 and "assistant: " in out


def test_bad_input_and_missing_rows_say_so_in_one_line(capsys, runs):
    store, _, _ = runs
    data = read_eval_tables(store, RM_RUN, 2)["data"]

    def error(*args: str) -> str:
        code, out, err = rollout(capsys, "runs", "samples", *args, "--store", store.root)
        assert code == 2 and not out, (code, out, err)
        assert len(err.strip().splitlines()) == 1, err
        return err

    assert "at steps 0, 2; pick one with --step" in error(RM_RUN, "--eval", "--step", "1")
    assert "not --failed or --tokens" in error(RM_RUN, "--eval", "--failed")
    assert "pick one selection" in error(RM_RUN, "--eval", "--worst", "1", "--best", "1")
    assert "no run 'nope'" in error("nope", "--eval")
    # an evaluation whose result came from a cache written before rows were kept: its record names no rows
    record_eval_tables(store, RM_RUN, 7, "rm", None, data)
    assert "rerun the run's command" in error(RM_RUN, "--eval", "--step", "7")
    store.fs.rm(f"{store.root}/runs/{RM_RUN}/evals/step-7.json")
    # an RL run whose envs have no `eval` (or that evaluated before samples were stored) says so
    MetricsFile(store, "rl-like").record(1, {"reward_mean": 0.5})
    assert "has no held-out samples recorded: none of its envs has an `eval`" in error("rl-like", "--eval")


def test_a_run_without_records_says_rerun_and_a_rerun_records_them(capsys, runs):
    """Last: it takes the RM run's records away (as a run trained before evaluations kept rows has none)."""
    store, rm, _ = runs
    kept = eval_json(capsys, store, RM_RUN)
    store.fs.rm(f"{store.root}/runs/{RM_RUN}/evals", recursive=True)
    code, out, err = rollout(capsys, "runs", "samples", RM_RUN, "--store", store.root, "--eval")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "rerun its command" in err, err
    again = train_in_process("train", "rm", "--config", str(ROOT / "configs/rm-tiny.toml"), "--store", store.root,
                             "--name", RM_RUN, "--max-steps", "2", "--set",
                             f'algorithm.rm.eval_dataset={{type = "jsonl_path", path = "{ROOT / "data/rm-tiny.jsonl"}"}}')
    assert again["checkpoint"] == rm["checkpoint"] and again["eval_after"] == rm["eval_after"]  # from cache
    assert eval_json(capsys, store, RM_RUN) == kept
