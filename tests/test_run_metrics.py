"""Metrics that outlive the run: the per-step metrics file (appended as steps complete, each step once after a
resume), its remote layout, `rollout runs` / `rollout runs show`, and TensorBoard event files that never change
what a run trains."""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from clirun import ROOT, cli_env, final_result, run_rollout, run_until_then_kill, train_in_process
from rollout_cli.runs import runs_group
from rollout_lib.identity.training import training_settings
from rollout_lib.config import RmConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.runlog import read_metrics
from rollout_lib.runlog.metrics_file import METRICS_FILE, MetricsFile, decode_record
from rollout_lib.runlog.recorder import RunRecorder
from rollout_lib.runlog.runs import headline, list_runs, run_history, run_summary
from rollout_lib.runlog.tensorboard import TensorBoardLog
from rollout_lib.store import ObjectStore, StoreError
from rollout_lib.checkpoint import CHECKPOINT_KIND

RUN = "metrics-run"


def metrics_path(store: ObjectStore, run: str = RUN) -> Path:
    return Path(store.root) / "runs" / run / METRICS_FILE


def strict_lines(path: Path) -> list[dict]:
    """The file's lines as strict JSON (NaN and Infinity tokens are not JSON)."""
    def refuse(token):
        raise ValueError(f"non-JSON token {token}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def steps(records: list[dict]) -> list[int]:
    return [record["step"] for record in records]


def scalars(log_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {event.step: event.value for event in accumulator.Scalars(tag)}


# --- the metrics file -----------------------------------------------------------------------------------------


def test_each_step_is_appended_as_it_completes(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    log = MetricsFile(store, RUN, total_steps=3)
    for step in (1, 2, 3):
        log.record(step, {"step": step, "loss": 1.0 / step, "note": "text"})
        # on disk already, one line per step so far: a killed run keeps it
        assert steps(strict_lines(metrics_path(store))) == list(range(1, step + 1))
    records = read_metrics(store, RUN)
    assert [record["loss"] for record in records] == [1.0, 0.5, 1.0 / 3]
    assert all(list(record)[0] == "step" and list(record)[-1] == "wall_time" for record in records)
    assert records[0]["wall_time"] <= records[1]["wall_time"] <= records[2]["wall_time"]
    assert records[0]["note"] == "text"


def test_a_replayed_step_replaces_its_line_and_the_lines_after_it(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    first = MetricsFile(store, RUN, total_steps=8)
    for step in range(1, 7):  # killed after step 6; its last snapshot was at step 4
        first.record(step, {"loss": float(step)})
    for attempt in range(3):  # resumed three times: each replays steps 5.. from the snapshot
        resumed = MetricsFile(store, RUN, total_steps=8)
        resumed.backfill([{"step": step, "loss": -1.0} for step in range(1, 5)])  # the cached segment: known
        for step in range(5, 7 + attempt):
            resumed.record(step, {"loss": 10.0 * step + attempt})
    lines = strict_lines(metrics_path(store))
    assert steps(lines) == list(range(1, 9))  # each step once: the file does not grow with replays
    assert [line["loss"] for line in lines] == [1.0, 2.0, 3.0, 4.0, 52.0, 62.0, 72.0, 82.0]
    assert steps(read_metrics(store, RUN)) == list(range(1, 9))


def test_non_finite_floats_are_valid_json_and_read_back_as_floats(tmp_path):
    import torch

    store = ObjectStore(str(tmp_path / "store"))
    MetricsFile(store, RUN).record(1, {"loss": math.nan, "grad_norm": math.inf, "low": -math.inf,
                                      "tensor": torch.tensor(0.5), "nested": {"x": math.nan}})
    (line,) = strict_lines(metrics_path(store))  # strict JSON
    assert line["loss"] == "NaN" and line["grad_norm"] == "Infinity" and line["low"] == "-Infinity"
    assert line["tensor"] == 0.5 and line["nested"] == {"x": "NaN"}
    (record,) = read_metrics(store, RUN)
    assert math.isnan(record["loss"]) and record["grad_norm"] == math.inf and record["low"] == -math.inf


def test_backfill_adds_only_missing_steps_and_annotate_keeps_the_wall_time(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    log = MetricsFile(store, RUN)
    log.record(1, {"accuracy": 0.5})
    added = log.backfill([{"step": 1, "accuracy": 0.0}, {"step": 2, "accuracy": 0.75}])
    assert steps(added) == [2]
    before = read_metrics(store, RUN)
    log.annotate(2, {"eval/accuracy": 1.0})
    after = read_metrics(store, RUN)
    assert after[0] == before[0] and after[1] == {**before[1], "eval/accuracy": 1.0}
    assert len(metrics_path(store).read_text().splitlines()) == 2


def test_step_0_is_the_evaluation_before_training_once_whatever_the_reruns(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    before, after = {"eval/loss": 0.69, "eval/accuracy": 0.5}, {"eval/loss": 0.4, "eval/accuracy": 0.9}
    log = MetricsFile(store, RUN, total_steps=4)
    log.annotate(0, before)  # the evaluation of the initial model: a record of its own
    for step in range(1, 5):
        log.record(step, {"loss": 1.0 / step})
    log.annotate(4, after)
    lines = strict_lines(metrics_path(store))
    assert steps(lines) == [0, 1, 2, 3, 4]
    assert set(lines[0]) == {"step", "eval/loss", "eval/accuracy", "wall_time"}  # the evaluation alone

    for _ in range(2):  # reruns: the cached evaluation again, then steps 3.. replayed from the snapshot at 2
        rerun = MetricsFile(store, RUN, total_steps=4)
        rerun.annotate(0, before)
        for step in (3, 4):
            rerun.record(step, {"loss": 2.0 / step})
        rerun.annotate(4, after)
    lines = strict_lines(metrics_path(store))
    assert steps(lines) == [0, 1, 2, 3, 4] and lines[0]["eval/accuracy"] == 0.5 and lines[4]["loss"] == 0.5

    older = MetricsFile(store, "older-run")  # a run recorded before step 0 was: its rerun adds it in step order
    older.record(1, {"loss": 1.0})
    MetricsFile(store, "older-run").annotate(0, before)
    assert steps(strict_lines(metrics_path(store, "older-run"))) == [0, 1]


def test_a_half_written_last_line_is_skipped_then_dropped(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    MetricsFile(store, RUN).record(1, {"loss": 1.0})
    with metrics_path(store).open("a") as f:
        f.write('{"step": 2, "loss": 0.')  # a writer killed mid-line
    assert steps(read_metrics(store, RUN)) == [1]
    MetricsFile(store, RUN).record(2, {"loss": 0.5})
    assert steps(strict_lines(metrics_path(store))) == [1, 2]


def test_a_shorter_run_of_the_same_name_drops_the_steps_past_its_budget(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    log = MetricsFile(store, RUN, total_steps=6)
    for step in range(1, 7):
        log.record(step, {"loss": 1.0})
    MetricsFile(store, RUN, total_steps=4)
    assert steps(read_metrics(store, RUN)) == [1, 2, 3, 4]


@pytest.mark.parametrize("remote", ["memory", "s3"])
def test_a_remote_store_keeps_one_object_per_step_read_the_same_way(remote, request):
    if remote == "s3":
        from s3server import BUCKET

        store = ObjectStore(f"s3://{BUCKET}/metrics-{uuid.uuid4().hex}", request.getfixturevalue("s3_options"))
    else:
        store = ObjectStore(f"memory://metrics-{uuid.uuid4().hex}")
    first = MetricsFile(store, RUN, total_steps=5)
    for step in range(1, 5):
        first.record(step, {"loss": float(step), "nan": math.nan})
    resumed = MetricsFile(store, RUN, total_steps=5)
    resumed.backfill([{"step": 1, "loss": -1.0}, {"step": 2, "loss": -1.0}])
    for step in (3, 4, 5):
        resumed.record(step, {"loss": 10.0 * step})
    resumed.annotate(5, {"eval/loss": 0.25})
    names = sorted(path.rsplit("/", 1)[-1] for path in store.fs.find(f"{store.root}/runs/{RUN}"))
    assert names == [f"{step:09d}.json" for step in range(1, 6)]
    records = read_metrics(store, RUN)
    assert steps(records) == [1, 2, 3, 4, 5] and [r["loss"] for r in records] == [1.0, 2.0, 30.0, 40.0, 50.0]
    assert math.isnan(records[0]["nan"]) and records[-1]["eval/loss"] == 0.25

    # a replay from step 3 drops the objects of the steps after it, as a local file drops its lines
    MetricsFile(store, RUN, total_steps=5).record(3, {"loss": 3.5})
    assert steps(read_metrics(store, RUN)) == [1, 2, 3]
    (summary,) = list_runs(store)  # listed from its metrics alone: no checkpoint yet
    assert (summary.name, summary.checkpoint, summary.last_step, summary.headline) == (RUN, None, 3, ("loss", 3.5))


def test_the_recorder_never_fails_the_run(tmp_path, monkeypatch, caplog):
    recorder = RunRecorder(ObjectStore(str(tmp_path / "store")), RUN, total_steps=2)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(recorder.metrics, "record", broken)
    recorder.record(1, {"loss": 1.0})  # logged, not raised
    assert "recording metrics (record) failed" in caplog.text


# --- listing runs ---------------------------------------------------------------------------------------------


def fake_checkpoint(store: ObjectStore, run: str, step: int, metrics: dict, kind: str) -> str:
    checkpoint = store.put_json({"kind": CHECKPOINT_KIND, "step": step, "parent": None, "kind_of_model": kind,
                                 "metrics": {"step": step, **metrics}})
    store.set_ref(f"runs/{run}/latest", checkpoint)
    return checkpoint


def test_runs_are_listed_with_their_headline_and_older_runs_from_their_manifest(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    old = fake_checkpoint(store, "old-rm", 3, {"loss": 0.6, "accuracy": 0.75}, "reward_model")
    recorder = RunRecorder(store, "sft-run", total_steps=2)
    recorder.record(1, {"step": 1, "loss": 2.0})
    recorder.record(2, {"step": 2, "loss": 1.5})
    recorder.annotate(2, {"eval/loss": 1.75})
    fake_checkpoint(store, "sft-run", 2, {"loss": 1.5}, "causal_lm")

    runs = {run.name: run for run in list_runs(store)}
    assert set(runs) == {"old-rm", "sft-run"}
    assert runs["old-rm"].checkpoint == old and runs["old-rm"].checkpoint_step == 3
    assert runs["old-rm"].headline == ("accuracy", 0.75)
    assert runs["sft-run"].headline == ("held-out loss", 1.75) and runs["sft-run"].last_step == 2
    assert runs["sft-run"].updated is not None
    assert [record["step"] for record in run_history(store, "old-rm")] == [3]  # from the manifest

    assert headline({"reward_mean": 0.25, "loss": 1.0}, "causal_lm") == ("reward_mean", 0.25)
    assert headline({"eval/accuracy": 0.9, "accuracy": 0.5}, "reward_model") == ("held-out accuracy", 0.9)
    with pytest.raises(StoreError, match=f"no run 'nope' in {store.root}"):
        run_summary(store, "nope")


def test_the_runs_commands(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    recorder = RunRecorder(store, "rl-run", total_steps=2)
    recorder.annotate(0, {"eval/words/reward_mean": 0.125, "eval/words/eval_s": 1.5})  # before training
    recorder.record(1, {"step": 1, "reward_mean": 0.25, "loss": math.nan})
    recorder.record(2, {"step": 2, "reward_mean": 0.5, "loss": 0.125, "eval/words/reward_mean": 0.75})
    runner = CliRunner()

    listed = runner.invoke(runs_group, ["--store", store.root])
    assert listed.exit_code == 0, listed.output
    header, row = listed.output.splitlines()
    assert header.split() == ["run", "checkpoint", "step", "headline", "updated"]
    assert row.split()[:5] == ["rl-run", "-", "2", "reward_mean", "0.5"]

    shown = runner.invoke(runs_group, ["show", "rl-run", "--store", store.root])
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[0].split() == ["step", "reward_mean", "loss", "eval/words/reward_mean", "time"]
    assert lines[1].split()[:2] == ["0", "0.125"]  # step 0: the held-out evaluation alone
    assert lines[2].split()[:3] == ["1", "0.25", "nan"] and lines[3].split()[:4] == ["2", "0.5", "0.125", "0.75"]

    as_json = runner.invoke(runs_group, ["show", "rl-run", "--store", store.root, "--json"])
    assert [decode_record(line)["step"] for line in as_json.output.splitlines()] == [0, 1, 2]
    assert '"loss": "NaN"' in as_json.output

    picked = runner.invoke(runs_group, ["--store", store.root, "show", "rl-run", "--columns", "loss"])
    assert picked.output.splitlines()[0].split() == ["step", "loss", "time"]


def test_smoothing_is_tensorboards_debiased_ema():
    from rollout_lib.runlog.plot import smooth, smoothing_weight

    assert smooth([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    assert smooth([0.7] * 5, 0.9) == pytest.approx([0.7] * 5)  # debiased: no pull towards 0 at the start
    assert [smoothing_weight(n) for n in (5, 10, 30, 75, 150, 1000)] == pytest.approx([0.0, 0.6, 0.6, 0.8, 0.9, 0.9])


def test_curves_share_the_step_axis_with_held_out_points_on_their_training_panel():
    from rollout_lib.runlog.plot import curve_panels, smooth, smoothing_weight

    rm = [{"step": 0, "eval/loss": 0.7, "eval/accuracy": 0.5, "eval/mean_margin": 0.0, "eval/pairs": 4}]
    rm += [{"step": step, "loss": 0.7 - step / 100 + (-1) ** step / 10, "accuracy": 0.5 + step / 80,
            "mean_margin": step / 20, "lr": 0.001, "grad_norm": math.nan if step == 3 else 1.0}
           for step in range(1, 31)]
    rm[-1].update({"eval/loss": 0.4, "eval/accuracy": 0.9, "eval/mean_margin": 1.5})
    panels = {panel.title: panel for panel in curve_panels(rm)}
    assert list(panels) == ["loss", "pair accuracy", "mean margin", "learning rate", "gradient norm"]
    train, held_out = panels["loss"].series
    assert (train.label, train.steps, train.held_out) == ("train", list(range(1, 31)), False)
    assert train.smoothed == pytest.approx(smooth(train.values, smoothing_weight(30)))
    assert (held_out.steps, held_out.values, held_out.held_out) == ([0, 30], [0.7, 0.4], True)  # step 0 included
    assert panels["pair accuracy"].series[1].values == [0.5, 0.9]
    (lr,) = panels["learning rate"].series
    assert lr.smoothed is None and panels["learning rate"].from_zero  # a schedule, drawn as it is
    assert 3 not in panels["gradient norm"].series[0].steps  # a NaN is no point

    rl = [{"step": 0, "eval/words/reward_mean": 0.25, "eval/words/pass_rate": 0.0, "eval/math/reward_mean": 0.5}]
    rl += [{"step": step, "reward_mean": step / 10, "loss": 0.1,
            **({"eval/words/reward_mean": step / 20, "eval/math/reward_mean": 0.5} if step % 5 == 0 else {})}
           for step in range(1, 11)]
    panels = {panel.title: panel for panel in curve_panels(rl)}
    assert list(panels) == ["loss", "mean reward", "held-out pass rate"]
    assert [(s.label, s.steps) for s in panels["mean reward"].series] == [
        ("train", list(range(1, 11))), ("held-out math", [0, 5, 10]), ("held-out words", [0, 5, 10])]
    assert panels["held-out pass rate"].series[0].steps == [0]
    assert curve_panels([{"step": 1, "pairs": 2}]) == []


def test_runs_plot_writes_the_curves_png(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    metrics = MetricsFile(store, "rl-run")
    metrics.annotate(0, {"eval/words/reward_mean": 0.0})
    for step in range(1, 11):
        metrics.record(step, {"loss": 1.0 / step, "reward_mean": step / 10, "lr": 0.01, "grad_norm": 1.0 / step,
                              **({"eval/words/reward_mean": step / 20} if step % 5 == 0 else {})})
    out = tmp_path / "curves.png"
    done = CliRunner().invoke(runs_group, ["--store", store.root, "plot", "rl-run", "--out", str(out)])
    assert done.exit_code == 0, done.output
    from PIL import Image

    with Image.open(out) as image:  # sized for the UI's ~960 px content column: 4 panels, 2 by 2
        assert image.format == "PNG" and image.size == (960, 600)
    empty = CliRunner().invoke(runs_group, ["--store", store.root, "plot", "nothing"])
    assert empty.exit_code != 0


def test_segment_means_are_the_means_of_the_segments_steps():
    from rollout_lib.runlog.step_log import segment_means

    segment = [{"loss": 0.5, "accuracy": 1.0}, {"loss": 0.25, "accuracy": 0.5}, {"loss": math.nan, "accuracy": 0.0}]
    means = segment_means(segment, ("loss", "accuracy", "reward_mean"))
    assert means["loss"] == 0.375 and means["accuracy"] == 0.5 and math.isnan(means["reward_mean"])


def test_the_curves_artifact_updates_at_snapshots_at_most_every_30_s_then_5_percent_of_the_run():
    from types import SimpleNamespace

    from flows.common import CurvesArtifact

    curves = CurvesArtifact(SimpleNamespace(run=SimpleNamespace(name="r")), "train-rm")
    curves._started = 0.0  # the first snapshot 30 s into the run: a shorter run draws only its final curves
    assert not curves.due(29.0) and curves.due(30.0)
    curves._first_update = curves._last_update = 30.0
    assert not curves.due(59.0) and curves.due(60.0)
    curves._first_update = curves._last_update = 0.0
    assert not curves.due(29.0) and curves.due(30.0)
    curves._last_update = 3600.0  # an hour in: 180 s between versions
    assert not curves.due(3600.0 + 179.0) and curves.due(3600.0 + 181.0)


def test_an_unknown_run_is_one_line_naming_the_store(tmp_path, capsys):
    from rollout_cli.main import main

    store = ObjectStore(str(tmp_path / "store"))
    MetricsFile(store, "there").record(1, {"loss": 1.0})
    assert main(["runs", "show", "missing", "--store", store.root]) == 2
    assert capsys.readouterr().err == f"rollout: error: no run 'missing' in {store.root}\n"
    assert main(["runs", "--store", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"rollout: error: no store at {tmp_path / 'nowhere'}\n"


# --- TensorBoard ----------------------------------------------------------------------------------------------


def test_tensorboard_scalars_and_a_replay_purges_what_it_replays(tmp_path):
    log_dir = tmp_path / "tb"
    first = TensorBoardLog(log_dir)
    for step in (1, 2, 3):
        first.write(step, {"step": step, "loss": float(step), "note": "text", "flag": True})
    first.close()
    resumed = TensorBoardLog(log_dir)  # a rerun replaying from step 2
    assert resumed.had_events
    resumed.write(2, {"loss": 20.0})
    resumed.annotate(2, {"eval/loss": 0.5})
    resumed.close()
    assert scalars(log_dir, "loss") == {1: 1.0, 2: 20.0}
    assert scalars(log_dir, "eval/loss") == {2: 0.5}


def test_the_recorder_gives_tensorboard_each_step_once_with_reused_steps(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    with RunRecorder(store, RUN, total_steps=4, tensorboard=True) as recorder:
        recorder.record(1, {"step": 1, "loss": 1.0})
        recorder.record(2, {"step": 2, "loss": 2.0})
        recorder.backfill([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}])  # the segment that published them
        recorder.backfill([{"step": 3, "loss": 3.0}, {"step": 4, "loss": 4.0}])  # a reused segment
        recorder.annotate(4, {"eval/loss": 0.5})
    log_dir = Path(store.root) / "runs" / RUN / "tensorboard"
    assert scalars(log_dir, "loss") == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    assert scalars(log_dir, "eval/loss") == {4: 0.5}
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1  # no replay: one writer
    assert steps(read_metrics(store, RUN)) == [1, 2, 3, 4]


def test_tensorboard_does_not_change_the_training_identity():
    base = load_config(RmConfig, ROOT / "configs/rm-tiny.toml")
    on = load_config(RmConfig, ROOT / "configs/rm-tiny.toml", ["run.tensorboard=true"])
    assert on.run.tensorboard and not base.run.tensorboard
    assert training_hash(on) == training_hash(base)
    assert training_settings(on) == training_settings(base)


# --- end to end: the CLI on a real Prefect server -------------------------------------------------------------


@pytest.mark.slow
def test_train_rm_records_its_steps_lists_the_run_and_tensorboard_reuses_every_step(prefect_server, tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    args = ["train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={store.root}",
            "--set", "algorithm.rm.checkpoint_interval=2",
            "--set", 'algorithm.rm.eval_dataset={type = "jsonl_path", path = "data/rm-tiny.jsonl"}']
    done = run_rollout(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    result = final_result(done)
    checkpoint = result["checkpoint"]
    records = read_metrics(store, "rm-tiny")
    assert steps(strict_lines(metrics_path(store, "rm-tiny"))) == [0, 1, 2]
    # step 0: the held-out evaluation before training, alone; the one after training is on the last step's line
    assert records[0] == {"step": 0, **{f"eval/{name}": value for name, value in result["eval_before"].items()},
                          "wall_time": records[0]["wall_time"]}
    assert {"loss", "accuracy", "lr", "wall_time"} <= set(records[1])
    assert "eval/accuracy" in records[2] and "eval/accuracy" not in records[1]

    # The flow's lines: the segment's means (not its last batch), the checkpoint's short id, held-out after.
    log = done.stdout + done.stderr
    loss, accuracy = (sum(record[name] for record in records[1:]) / 2 for name in ("loss", "accuracy"))
    assert f"steps 1-2: mean loss {loss:.4f}, mean accuracy {accuracy:.3f} -> checkpoint {checkpoint[:12]}\n" in log
    after = result["eval_after"]
    assert f"held-out after training: accuracy {after['accuracy']:.3f} over {after['pairs']} pairs" in log

    listed = CliRunner().invoke(runs_group, ["--store", store.root])
    assert listed.exit_code == 0, listed.output
    row = listed.output.splitlines()[1].split()
    assert row[:5] == ["rm-tiny", checkpoint[:12], "2", "held-out", "accuracy"]
    shown = CliRunner().invoke(runs_group, ["show", "rm-tiny", "--store", store.root])
    assert [line.split()[0] for line in shown.output.splitlines()] == ["step", "0", "1", "2"]
    assert shown.output.splitlines()[1].split()[1] == f"{result['eval_before']['accuracy']:.4g}"  # eval/accuracy

    # The same run with TensorBoard on: the same training (the name's claim holds, every step is reused), and
    # TensorBoard gets the steps the run already had; the metrics file is left as it was.
    again = run_rollout(*args, "--set", "run.tensorboard=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert final_result(again)["checkpoint"] == checkpoint
    assert read_metrics(store, "rm-tiny") == records
    losses = scalars(Path(store.root) / "runs" / "rm-tiny" / "tensorboard", "loss")
    assert losses == pytest.approx({1: records[1]["loss"], 2: records[2]["loss"]})


@pytest.mark.slow
def test_a_killed_run_keeps_its_steps_and_its_rerun_records_each_step_once(prefect_server, tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    args = ["train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={store.root}",
            "--set", "algorithm.rm.budget.max_steps=12", "--set", "algorithm.rm.checkpoint_interval=4"]
    # Killed inside the second segment (steps 5-8), after its step 6 (ROLLOUT_LOG_LEVEL=DEBUG logs every step).
    run_until_then_kill(args, "step 6: ", tmp_path / "killed.log", env=cli_env(ROLLOUT_LOG_LEVEL="DEBUG"))
    killed = read_metrics(store, "rm-tiny")
    assert steps(killed)[:6] == list(range(1, 7))  # every finished step outlived the run

    train_in_process(*args)  # the rerun (in this process: the CLI is the killed run's)
    lines = strict_lines(metrics_path(store, "rm-tiny"))
    assert steps(lines) == list(range(1, 13))  # replayed steps 5.. replaced their lines: each step once
    assert lines[:4] == [json.loads(json.dumps(record)) for record in killed[:4]]  # the cached segment: untouched
    assert lines[4]["wall_time"] > killed[4]["wall_time"]  # step 5 was trained again
    assert [line["loss"] for line in lines[4:6]] == pytest.approx([record["loss"] for record in killed[4:6]])


def test_step_lines_each_step_while_slow_and_throttled_while_fast(caplog):
    import logging

    from rollout_lib.runlog.step_log import StepLog

    clock = iter([0.0, 20.0, 40.0, 40.1, 40.2, 40.3, 51.0, 51.1])  # slow, slow, fast x3, slow, last
    # its own clock: patching time.monotonic would hand these times to any other thread of the process too
    steps = StepLog(total_steps=8, min_interval_s=10.0, clock=lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="rollout_lib.steps"):
        for step in range(1, 9):
            steps(step, {"loss": 1.0 / step, "accuracy": 0.5, "tokens": 100})
    lines = [record.getMessage() for record in caplog.records]
    assert [line.split(":")[0] for line in lines] == ["step 1/8", "step 2/8", "step 3/8", "step 7/8", "step 8/8"]
    assert lines[0] == "step 1/8: loss 1, accuracy 0.5"
    assert lines[1] == "step 2/8: loss 0.5, accuracy 0.5, 5 tokens/s"  # 100 tokens in 20 s
    assert lines[3].endswith(", 36 tokens/s")  # steps 4-7: 400 tokens in the 11 s since step 3's line
    assert lines[4].endswith(", 1000 tokens/s")  # the last step is always logged
