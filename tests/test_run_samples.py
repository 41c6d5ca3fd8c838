"""`rollout runs samples`: a step's samples read back from a real tiny RL run's store (issue 41, docs/runs.md).

One run is shared by the module: rl-tiny, 2 steps, scored by target_length and a reward that raises for some
completions (tests/example_rewards.py), so that a step has rewards per function, advantages and failures, with a
held-out evaluation of 6 prompts x 2 samples before step 1 and after step 2. The command's rows are checked against the stored
tables, against the rewards and advantages recomputed here from the completions' text, and (held out) against the
run's own eval metrics.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest

from clirun import train_in_process
from conftest import ROOT
from rollout_cli.main import main
from rollout_lib import wire
from rollout_lib.runlog.metrics_file import MetricsFile, read_metrics
from rollout_lib.runlog.eval_tables import read_rl_eval_tables
from rollout_lib.runlog.step_tables import read_step_tables
from rollout_lib.store import ObjectStore
from test_ui_browser import browser  # noqa: F401 - the fixture (headless Chromium)

RUN = "samples-tiny"
FAILING = "words_unless_length_divides_by_4"  # in tests/example_rewards.py; its rewards are keyed by this name


def rollout(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def sampled_run(prefect_server, tmp_path_factory) -> ObjectStore:
    directory = tmp_path_factory.mktemp("samples")
    config = directory / "rl.toml"
    prompts = ROOT / "data/rl-tiny-prompts.jsonl"
    config.write_text((ROOT / "configs/rl-tiny.toml").read_text()
                      .replace('"data/rl-tiny-prompts.jsonl" }', f'"{prompts}" }}\neval = {{ source = {{ type = '
                               f'"jsonl_path", path = "{prompts}" }}, every = 2, max_prompts = 6, sampling = {{ group_size = 2, '
                               'temperature = 1.0, max_tokens = 16 } }')
                      + f'\n[[algorithm.rl.envs.rewards]]\nfunction = "example_rewards:{FAILING}"\n')
    store = ObjectStore(str(directory / "store"))
    done = train_in_process("train", "rl", "--config", str(config), "--store", store.root, "--name", RUN,
                            "--max-steps", "2", "--set", "algorithm.rl.reward_loop.max_missing_fraction=0.9")
    assert len(done["reward_curve"]) == 2
    return store


def samples_json(capsys, store: ObjectStore, *args: str) -> dict:
    code, out, err = rollout(capsys, "runs", "samples", RUN, "--store", store.root, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def stored(store: ObjectStore, step: int) -> tuple[dict, list[dict], list[dict]]:
    """Step `step`'s record, its scored rollouts and its training samples, as the run stored them."""
    record = read_step_tables(store, RUN, step)
    return (record, store.get_table(record["scored"], wire.ROLLOUTS).to_pylist(),
            store.get_table(record["samples"], wire.TRAINING_SAMPLES).to_pylist())


@pytest.mark.slow
def test_the_latest_step_by_default_row_for_row_as_stored(capsys, sampled_run):
    from rollout_lib.model.loading import load_tokenizer, resolve_model

    document = samples_json(capsys, sampled_run)
    assert (document["run"], document["step"], document["steps"]) == (RUN, 2, [1, 2])
    record, scored, _ = stored(sampled_run, 2)
    rows = document["rows"]
    assert len(rows) == document["samples"] == len(scored) == 4 * 8
    tokenizer = load_tokenizer(resolve_model("tiny:qwen2"))
    for row, rollout_row in zip(rows, scored):
        assert row["sample_id"] == rollout_row["sample_id"]
        assert row["reward"] == rollout_row["reward"] and row["reward_error"] == rollout_row["reward_error"]
        assert row["completion"] == tokenizer.decode(rollout_row["completion_ids"], skip_special_tokens=True)
        assert (row["prompt_tokens"], row["completion_tokens"]) == (len(rollout_row["prompt_ids"]),
                                                                   len(rollout_row["completion_ids"]))
        assert row["prompt"][-1]["role"] == "user" and row["prompt"][-1]["content"]
        # step 2 sampled from the state step 1 trained
        assert row["sampled_from"] == record["sampled_from_state"] == read_step_tables(sampled_run, RUN, 1)["state"]
        assert row["turns"] is None  # a single-turn env
    assert sum(bool(row["completion"]) for row in rows) > len(rows) // 2
    # Each function's reward, recomputed from the text; the total is their sum (weights 1).
    for row in rows:
        words = len(row["completion"].split())
        assert row["rewards"]["target_length"] == pytest.approx(max(0.0, 1 - abs(words - 12) / 12))
        if row["reward"] is not None:
            assert row["rewards"][FAILING] == pytest.approx(words / 16)
            assert row["reward"] == pytest.approx(sum(row["rewards"].values()))
        else:
            assert row["rewards"][FAILING] is None  # it raised
    # GRPO: advantage = reward - the mean of its group's scored rewards; none for a missing reward.
    groups = defaultdict(list)
    for row in rows:
        if row["reward"] is not None:
            groups[row["example_id"]].append(row["reward"])
    for row in rows:
        if row["reward"] is None:
            assert row["advantage"] is None
        else:
            group = groups[row["example_id"]]
            assert row["advantage"] == pytest.approx(row["reward"] - sum(group) / len(group), abs=1e-5)


@pytest.mark.slow
def test_a_chosen_step_with_its_tokens(capsys, sampled_run):
    document = samples_json(capsys, sampled_run, "--step", "1", "--tokens")
    record, scored, samples = stored(sampled_run, 1)
    assert document["step"] == 1 and len(document["rows"]) == len(scored)
    inference = {sample["sample_id"]: sample["inference_logprobs"] for sample in samples}
    for row, rollout_row in zip(document["rows"], scored):
        assert row["sampled_from"] == record["sampled_from_state"]  # the initial checkpoint
        assert [token["id"] for token in row["tokens"]] == rollout_row["completion_ids"]
        assert [token["sampler_logprob"] for token in row["tokens"]] == pytest.approx(
            rollout_row["sampling_logprobs"])
        behaviour = inference[row["sample_id"]][len(rollout_row["prompt_ids"]):]
        for token, value in zip(row["tokens"], behaviour):  # NaN: taken from the training forward, not stored
            assert token["behaviour_logprob"] == (None if value != value else pytest.approx(value))
        assert all(token["advantage"] == pytest.approx(row["advantage"]) for token in row["tokens"]) \
            if row["advantage"] is not None else True


@pytest.mark.slow
def test_the_trainers_logprobs_on_demand_at_a_replayed_state_match_the_samplers(capsys, sampled_run):
    """Step 2 was sampled from the state after step 1, which has no snapshot (rl-tiny snapshots every 5 steps):
    --trainer-logprobs rebuilds it from the store (the initial checkpoint, step 1 replayed) with the settings the
    run recorded. The tiny run samples in process (the HF sampler), so the trainer's logprob of every sampled token
    is the sampler's up to batch shape; the initial checkpoint's are not (its step moved the weights)."""
    from rollout_lib.checkpoint import read_manifest
    from rollout_lib.rl.behaviour import ForwardInputs, chunk_logprobs
    from rollout_lib.rl.policy_state import policy_inputs
    from rollout_lib.rl.trainer_logprobs import recorded_config, trainer_logprobs
    from rollout_lib.runlog.metrics_file import run_dir
    from rollout_lib.trainer.causal import CausalLmTrainer

    document = samples_json(capsys, sampled_run, "--step", "2", "--tokens", "--trainer-logprobs")
    record, scored, samples = stored(sampled_run, 2)
    assert sampled_run.get_json(record["sampled_from_state"])["step"] == 1  # a step record, not a checkpoint
    gaps = []
    for row, rollout_row in zip(document["rows"], scored):
        trainer = [token["trainer_logprob"] for token in row["tokens"]]
        assert all(value is not None for value in trainer) and len(trainer) == len(rollout_row["completion_ids"])
        row_gaps = [abs(token["sampler_logprob"] - token["trainer_logprob"]) for token in row["tokens"]]
        assert row["logprob_gap"] == pytest.approx(max(row_gaps)) if row_gaps else row["logprob_gap"] is None
        gaps.extend(row_gaps)
    assert gaps and max(gaps) < 1e-4, max(gaps)

    # The same tokens under the initial checkpoint (what a wrong state would give) are far from the sampler's.
    initial_checkpoint = sampled_run.get_json(record["sampled_from_state"])["parent"]  # the state after step 0
    assert read_manifest(sampled_run, initial_checkpoint)["step"] == 0
    initial = CausalLmTrainer.from_checkpoint(
        policy_inputs(sampled_run, recorded_config(sampled_run, RUN), record["prompts"]), initial_checkpoint)
    first = samples[:8]
    stale = chunk_logprobs(initial.model.eval(), [ForwardInputs.of(s["input_ids"], s["loss_mask"], s["temperatures"])
                                                 for s in first])
    far = max(abs(v - s["inference_logprobs"][i]) for sample_values, s in zip(stale, first)
              for i, v in enumerate(sample_values) if s["loss_mask"][i])
    assert far > 10 * max(gaps), (far, max(gaps))
    assert trainer_logprobs(sampled_run, RUN, 2).keys() == {row["sample_id"] for row in document["rows"]}

    # The terminal view shows each sample's gap; a run without recorded settings says what to do, in one line.
    code, out, err = rollout(capsys, "runs", "samples", RUN, "--store", sampled_run.root, "--step", "2", "--best",
                             "1", "--trainer-logprobs")
    assert code == 0 and "|sampler - trainer| logprob <= " in out, err
    settings = f"{run_dir(sampled_run, RUN)}/settings.json"
    os.rename(settings, settings + ".away")
    try:
        code, out, err = rollout(capsys, "runs", "samples", RUN, "--store", sampled_run.root, "--trainer-logprobs")
    finally:
        os.rename(settings + ".away", settings)
    assert (code, out) == (2, "") and err == (
        f"rollout: error: run '{RUN}' in {sampled_run.root} has no recorded settings (it ran before rollout kept "
        "them): rerun its command, whose finished steps come back from cache, to record them\n")
    print(f"sampler vs trainer at the sampling state: <= {max(gaps):.2g}; vs the initial checkpoint: {far:.2g}")


@pytest.mark.slow
def test_worst_and_best_sort_by_total_reward(capsys, sampled_run):
    rewards = sorted(row["reward"] for row in samples_json(capsys, sampled_run)["rows"] if row["reward"] is not None)
    worst = [row["reward"] for row in samples_json(capsys, sampled_run, "--worst", "3")["rows"]]
    best = [row["reward"] for row in samples_json(capsys, sampled_run, "--best", "3")["rows"]]
    assert worst == rewards[:3]
    assert best == rewards[::-1][:3]
    assert rewards[0] < rewards[-1]  # the order is informative


@pytest.mark.slow
def test_failed_lists_the_missing_rewards_with_why(capsys, sampled_run):
    _, scored, _ = stored(sampled_run, 2)
    rows = samples_json(capsys, sampled_run, "--failed")["rows"]
    assert 0 < len(rows) == sum(row["reward"] is None for row in scored) < len(scored)
    for row in rows:
        assert row["reward"] is None and len(row["completion"]) % 4 == 0
        assert f"refusing a completion of {len(row['completion'])} characters" in row["reward_error"]

    code, out, err = rollout(capsys, "runs", "samples", RUN, "--store", sampled_run.root, "--failed")
    assert code == 0, err
    assert f"{RUN} step 2 (of steps 1-2): the failed; 32 samples" in out
    assert out.count("reward failed:") == len(rows)


@pytest.mark.slow
def test_the_terminal_view(capsys, sampled_run):
    code, out, err = rollout(capsys, "runs", "samples", RUN, "--store", sampled_run.root, "--best", "2")
    assert code == 0, err
    rows = samples_json(capsys, sampled_run, "--best", "2")["rows"]
    assert f"{RUN} step 2 (of steps 1-2): the 2 best; 32 samples, reward mean" in out
    assert f"sampled from {rows[0]['sampled_from'][:12]}" in out
    for row in rows:
        assert f"{row['reward']:.3f}" in out and f"{row['rewards']['target_length']:.3f}" in out
        first_word = row["completion"].split()[0] if row["completion"].split() else ""
        assert first_word[:10] in out


@pytest.mark.slow
def test_a_step_out_of_range_is_one_line(capsys, sampled_run):
    code, out, err = rollout(capsys, "runs", "samples", RUN, "--store", sampled_run.root, "--step", "9")
    assert code == 2 and out == ""
    assert err == (f"rollout: error: run '{RUN}' in {sampled_run.root} has no samples of step 9: its steps with "
                   "samples are 1-2; pick one with --step\n")


@pytest.mark.slow
def test_the_held_out_evaluation_sample_by_sample_as_stored_and_as_its_metrics_say(capsys, sampled_run):
    found = samples_json(capsys, sampled_run, "--eval")  # the last evaluation by default
    assert (found["held_out"], found["step"], found["steps"], found["samples"]) == (True, 2, [0, 2], 12)
    record = read_rl_eval_tables(sampled_run, RUN, 2)["envs"]["words"]
    scored = sampled_run.get_table(record["scored"], wire.ROLLOUTS).to_pylist()
    rows = found["rows"]
    assert [(row["sample_id"], row["completion"]) for row in rows] == \
        [(rollout["sample_id"], rollout["completion_text"]) for rollout in scored]
    assert all(row["env"] == "words" and row["advantage"] is None for row in rows)
    assert [row["group_index"] for row in rows] == [0, 1] * 6
    assert all(row["prompt"][-1]["role"] == "user" for row in rows)
    # The rows are what the run's eval metrics were computed from: each function's reward and the total.
    metrics = next(m for m in read_metrics(sampled_run, RUN) if m["step"] == 2)
    present = [row["reward"] for row in rows if row["reward"] is not None]
    assert present and metrics["eval/words/missing_rewards"] == len(rows) - len(present)
    assert metrics["eval/words/reward_mean"] == pytest.approx(sum(present) / len(present))
    for row in rows:
        assert row["rewards"]["target_length"] is not None
        if row["reward"] is None:
            assert FAILING in row["reward_error"] and row["rewards"][FAILING] is None
        else:
            assert row["reward"] == pytest.approx(sum(row["rewards"].values()))
    failed = samples_json(capsys, sampled_run, "--eval", "--failed")["rows"]
    assert failed == [row for row in rows if row["reward"] is None]
    before = samples_json(capsys, sampled_run, "--eval", "--step", "0")
    assert before["step"] == 0 and before["samples"] == 12
    code, out, err = rollout(capsys, "runs", "samples", RUN, "--store", sampled_run.root, "--eval", "--best", "2")
    header = " ".join(out.split())  # the terminal's width wraps it
    assert code == 0 and header.startswith(f"{RUN} held-out evaluation at step 2 (evaluated at steps 0, 2): the 2 "
                                           "best; 12 samples"), err


def test_bad_requests_are_one_line_and_exit_2(capsys, tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    store.put_json({})  # a store exists once it holds something
    MetricsFile(store, "rm-like").record(1, {"loss": 0.69, "accuracy": 0.5})
    MetricsFile(store, "rl-old").record(1, {"reward_mean": 0.4, "loss": 0.0})
    cases = {
        ("nope",): f"no run 'nope' in {store.root}",
        ("rm-like",): f"run 'rm-like' in {store.root} is not an RL run: only train-rl keeps samples",
        ("rl-old",): f"run 'rl-old' in {store.root} has no samples recorded: it trained before rollout recorded them",
        ("rl-old", "--worst", "2", "--best", "2"): "runs samples: --worst, --best and --failed pick one selection",
        ("rl-old", "--eval"): f"run 'rl-old' in {store.root} has no held-out samples recorded: none of its envs",
        ("nope", "--eval"): f"no run 'nope' in {store.root}",
        ("rl-old", "--tokens"): "runs samples: --tokens goes with --json",
    }
    for args, start in cases.items():
        code, out, err = rollout(capsys, "runs", "samples", *args, "--store", store.root)
        assert (code, out) == (2, ""), (args, err)
        assert err.startswith(f"rollout: error: {start}") and err.count("\n") == 1, (args, err)


@pytest.mark.slow
def test_each_step_shows_a_bounded_table_in_the_ui_failed_first_then_worst_and_best(sampled_run, browser):
    """`<run>-samples`, a version a step: run.ui_samples (8) of the step's 32 rows, the failed ones first, then
    the lowest and the highest total reward in turn; its page renders in the UI (screenshot: run-samples.png)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from conftest import ARTIFACTS_DIR
    from test_ui_browser import _wait_for_text

    with get_client(sync_client=True) as client:
        versions = sorted(client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"{RUN}-samples"]))), key=lambda artifact: artifact.created)
    assert [version.description.split(":")[0] for version in versions] == [f"train-rl {RUN} step 1",
                                                                           f"train-rl {RUN} step 2"]
    rows = json.loads(versions[-1].data) if isinstance(versions[-1].data, str) else versions[-1].data
    _, scored, _ = stored(sampled_run, 2)
    failed = [row for row in scored if row["reward"] is None]
    rewards = sorted(row["reward"] for row in scored if row["reward"] is not None)
    assert 0 < len(failed) < 8 and len(rows) == 8, (len(failed), len(rows))
    assert all(row["reward"] is None and row["reward_error"] for row in rows[:len(failed)])
    turns = [value for pair in zip(rewards, reversed(rewards)) for value in pair]
    assert [row["reward"] for row in rows[len(failed):]] == pytest.approx(turns[:8 - len(failed)], rel=1e-5)
    assert all(row["completion"] and row["sample"].startswith("words/") for row in rows)

    url = f"{os.environ['PREFECT_API_URL'].removesuffix('/api')}/artifacts/artifact/{versions[-1].id}"
    browser.get(url)
    needles = ["reward_error", rows[0]["sample"], FAILING]
    text = _wait_for_text(browser, needles, timeout=60)
    ARTIFACTS_DIR.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS_DIR / "run-samples.png"))
    missing = [needle for needle in needles if needle not in text]
    assert not missing, f"{url} never showed {missing}; screenshot run-samples.png:\n{text[:2000]}"
