"""`run.trackers`: a run's steps in MLflow, W&B and trackio, each the real thing (issue 41, docs/runs.md "Trackers").

MLflow: one `mlflow server` on SQLite for the module (from .venv-mlflow, which `scripts/setup.sh --test` makes),
read back with MLflow's own client in that venv. W&B: offline mode, its run files read back (wandb_file.py) and
its table files. trackio: its project's SQLite, through trackio's own storage class. Runs are in process
(`train_in_process`): rm-tiny for the metrics path and a resume, rl-tiny (2 steps) for sample tables, rm-tiny
with MLflow's server dead or hung for "never fails, blocks or slows the run".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clirun import train_in_process
from conftest import ROOT
from rollout_cli.local_server import free_port
from rollout_cli.processes import stop_process_group
from rollout_lib.config import ConfigError
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.config.rm import RmConfig
from rollout_lib.identity.training import training_identity
from rollout_lib.runlog.metrics_file import read_metrics
from rollout_lib.runlog.trackers import wandb_file
from rollout_lib.runlog.trackers.build import run_key, wandb_dir
from rollout_lib.runlog.samples import shown_first
from rollout_lib.store import ObjectStore

MLFLOW_VENV = ROOT / ".venv-mlflow"
THREAD_LOGGER = "rollout_lib.runlog.trackers.thread"


# --- settings -----------------------------------------------------------------------------------------------------


def test_trackers_stay_out_of_the_training_identity():
    base = load_config(RmConfig, ROOT / "configs/rm-tiny.toml")
    on = load_config(RmConfig, ROOT / "configs/rm-tiny.toml", [
        'run.trackers=["mlflow", "wandb", "trackio", "tensorboard"]', "run.tracker_samples=4",
        'run.mlflow={tracking_uri = "http://127.0.0.1:1", experiment = "x"}', 'run.wandb={mode = "offline"}',
        'run.trackio={project = "p"}'])
    assert on.run.trackers == ["mlflow", "wandb", "trackio", "tensorboard"] and on.run.writes_tensorboard
    assert training_hash(on) == training_hash(base)
    assert training_identity(on) == training_identity(base)


def test_tracker_settings_fail_loudly_and_name_the_key():
    with pytest.raises(ConfigError, match=r"run: run.wandb: settings of a tracker not in run.trackers"):
        load_config(RmConfig, ROOT / "configs/rm-tiny.toml", ['run.wandb={mode = "offline"}'])
    with pytest.raises(ConfigError, match=r"run.trackers\[0\]: Input should be 'mlflow'"):
        load_config(RmConfig, ROOT / "configs/rm-tiny.toml", ['run.trackers=["comet"]'])
    with pytest.raises(ConfigError, match=r"run.mlflow.tracking_uri: String should match pattern"):
        load_config(RmConfig, ROOT / "configs/rm-tiny.toml",
                    ['run.trackers=["mlflow"]', 'run.mlflow={tracking_uri = "sqlite:///x.db"}'])


def test_a_tracker_package_missing_is_refused_at_plan_time_in_one_line():
    # The real CLI in a process where `import wandb` fails as for a package not installed (sys.modules[name] = None
    # is Python's own way to block an import; importlib.util.find_spec answers None for it).
    blocked = ("import sys; sys.modules['wandb'] = None; sys.argv[0] = 'rollout'; "
               "from rollout_cli.main import main; sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", blocked, "train", "rm", "--config", "configs/rm-tiny.toml",
                           "--set", 'run.trackers=["wandb"]', "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "run.trackers" in lines[0] and "wandb" in lines[0] and "pip install -e '.[trackers]'" in lines[0]


def test_the_offline_w_and_b_attempts_of_a_run_are_found_with_wandbs_same_second_suffixes(tmp_path):
    # wandb names an attempt's directory offline-run-<second>-<id>, then -1, -2, ... when an attempt of that id
    # started in the same second (wandb_init.set_sync_dir_suffix): a SIGKILL and its rerun can (CI did). A directory
    # without its run file (an attempt killed before W&B wrote it) and another run's id are not attempts.
    run_id = "fd4114e65cec4141"
    attempts = [f"offline-run-20261128_055149-{run_id}", f"offline-run-20261128_055149-{run_id}-1",
                f"offline-run-20261128_055149-{run_id}-2", f"offline-run-20261128_055149-{run_id}-10",
                f"offline-run-20261128_055150-{run_id}"]
    other_run = f"offline-run-20261128_055149-{run_id}0000"
    for name, file in [*((name, f"run-{run_id}.wandb") for name in reversed(attempts)),
                       (other_run, f"run-{run_id}0000.wandb")]:
        (tmp_path / "wandb" / name).mkdir(parents=True)
        (tmp_path / "wandb" / name / file).touch()
    (tmp_path / "wandb" / f"offline-run-20261128_055148-{run_id}").mkdir()  # killed before W&B wrote its file
    found = [path.parent.name for path in wandb_file.attempt_files(tmp_path, run_id)]
    assert found == attempts


def test_a_step_table_holds_the_failed_then_the_worst_and_best():
    rows = [{"sample_id": f"s{i}", "reward": reward} for i, reward in enumerate([0.5, None, 0.1, 0.9, 0.3, 0.7])]
    assert [row["sample_id"] for row in shown_first(rows, 4)] == ["s1", "s2", "s3", "s4"]
    assert [row["sample_id"] for row in shown_first(rows, 10)] == ["s1", "s2", "s3", "s4", "s5", "s0"]
    assert shown_first(rows, 0) == []


# --- the real trackers ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on SQLite, one worker, no job runner (~0.5 GB, ~15 s to healthy here); always stopped."""
    if not (MLFLOW_VENV / "bin" / "mlflow").exists():
        pytest.fail(f"no {MLFLOW_VENV}: run `bash scripts/setup.sh --test` (it makes the MLflow server's venv)")
    directory = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = (directory / "server.log").open("ab")
    process = subprocess.Popen(
        [str(MLFLOW_VENV / "bin" / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
         "--artifacts-destination", str(directory / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, (directory / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield uri
    finally:
        stop_process_group(process.pid)


def mlflow_read(uri: str, experiment: str, run_key_value: str, tables: list[str] = ()) -> dict:
    """The MLflow run of a rollout run, read with MLflow's own client (in the server's venv): its runs with that
    key, status, params, tags, each metric's full history, its artifacts and the tables `mlflow.load_table` reads."""
    script = f"""
import json, mlflow
from mlflow import MlflowClient
mlflow.set_tracking_uri({uri!r})
client = MlflowClient()
experiment = client.get_experiment_by_name({experiment!r})
runs = client.search_runs([experiment.experiment_id], filter_string="tags.`rollout.run_key` = '{run_key_value}'")
run = runs[0]
history = {{key: [[m.step, m.value] for m in client.get_metric_history(run.info.run_id, key)]
           for key in run.data.metrics}}
tables = {{}}
for path in {list(tables)!r}:
    frame = client.load_table(experiment.experiment_id, path, run_ids=[run.info.run_id])
    tables[path] = {{"columns": list(frame.columns), "rows": len(frame)}}
print(json.dumps({{"runs": len(runs), "status": run.info.status, "params": run.data.params, "tags": run.data.tags,
                  "history": history, "artifacts": [a.path for a in client.list_artifacts(run.info.run_id)],
                  "tables": tables}}))
"""
    done = subprocess.run([str(MLFLOW_VENV / "bin" / "python"), "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory) -> Path:
    # trackio reads its directory once, at import: every run of this module writes to this one.
    return tmp_path_factory.mktemp("trackio")


def tracker_overrides(mlflow_uri: str, trackio_dir: Path, experiment: str) -> list[str]:
    return ["--set", 'run.trackers=["mlflow", "wandb", "trackio"]',
            "--set", f'run.mlflow={{tracking_uri = "{mlflow_uri}", experiment = "{experiment}"}}',
            "--set", 'run.wandb={mode = "offline", project = "rollout-tests"}',
            "--set", f'run.trackio={{project = "{experiment}", dir = "{trackio_dir}"}}']


def wandb_run_files(store: ObjectStore, run_name: str) -> list[Path]:
    """The run's offline W&B files, attempt after attempt."""
    run_id = run_key(store, run_name)[:16]
    files = wandb_file.attempt_files(wandb_dir(store, run_name), run_id)
    assert files, f"no offline W&B run {run_id} under {wandb_dir(store, run_name)}"
    return files


def wandb_history(store: ObjectStore, run_name: str) -> list[dict]:
    """Every history row of the run's offline W&B files, attempt after attempt."""
    return [row for path in wandb_run_files(store, run_name) for row in wandb_file.history(path)]


def trackio_logs(trackio_dir: Path, project: str, run_name: str) -> list[dict]:
    from trackio import SQLiteStorage

    assert os.environ.get("TRACKIO_DIR") == str(trackio_dir)
    return SQLiteStorage.get_logs(project, run_name)


def steps_of(rows: list[dict], metric: str, step_key: str = "step") -> list[int]:
    return [row[step_key] for row in rows if metric in row]


@pytest.mark.slow
def test_rm_steps_settings_and_summary_in_each_tracker_and_a_rerun_continues_them(prefect_server, mlflow_server,
                                                                                 trackio_dir, tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    args = ["train", "rm", "--config", "configs/rm-tiny.toml", "--store", store.root,
            "--set", "algorithm.rm.checkpoint_interval=2",
            "--set", 'algorithm.rm.eval_dataset={type = "jsonl_path", path = "data/rm-tiny.jsonl"}',
            *tracker_overrides(mlflow_server, trackio_dir, "rm-trackers")]
    first = train_in_process(*args, "--max-steps", "4")
    # The same training extended to 6 steps: steps 1-4 come back from cache and reach the trackers as reused steps;
    # each tracker already holds them (and step 0), so it gets 5 and 6 only: no step twice, none missing.
    second = train_in_process(*args, "--max-steps", "6")
    records = {record["step"]: record for record in read_metrics(store, "rm-tiny")}
    assert sorted(records) == [0, 1, 2, 3, 4, 5, 6]

    key = run_key(store, "rm-tiny")
    mlflow = mlflow_read(mlflow_server, "rm-trackers", key)
    assert mlflow["runs"] == 1 and mlflow["status"] == "FINISHED"
    assert [step for step, _ in mlflow["history"]["loss"]] == [1, 2, 3, 4, 5, 6]
    assert [value for _, value in mlflow["history"]["loss"]] == pytest.approx([records[s]["loss"] for s in range(1, 7)])
    # held-out: before training (step 0), after the first run's last step, after the rerun's
    assert [step for step, _ in mlflow["history"]["eval/accuracy"]] == [0, 4, 6]
    assert mlflow["params"]["algorithm.rm.optimizer.lr"] == "0.001"
    assert mlflow["params"]["training identity"] == training_identity(load_config(RmConfig, ROOT / "configs/rm-tiny.toml"))
    assert mlflow["tags"]["rollout.final_checkpoint"] == second["checkpoint"]
    assert mlflow["tags"]["rollout.flow_run"].endswith(f"/runs/flow-run/{second['flow_run_id']}")
    assert "curves.png" in mlflow["artifacts"]
    assert "storage_options" not in json.dumps(mlflow["params"])  # never credentials

    wandb_rows = wandb_history(store, "rm-tiny")
    assert steps_of(wandb_rows, "loss", "_step") == [1, 2, 3, 4, 5, 6]
    assert steps_of(wandb_rows, "eval/accuracy", "_step") == [0, 4, 6]
    assert [row["loss"] for row in wandb_rows if "loss" in row] == pytest.approx([records[s]["loss"] for s in range(1, 7)])

    logs = trackio_logs(trackio_dir, "rm-trackers", "rm-tiny")
    assert steps_of(logs, "loss") == [1, 2, 3, 4, 5, 6]
    assert steps_of(logs, "eval/accuracy") == [0, 4, 6]
    finals = [row["summary/final_checkpoint"] for row in logs if "summary/final_checkpoint" in row]
    assert finals == [first["checkpoint"], second["checkpoint"]]
    assert any("curves" in row for row in logs)


@pytest.mark.slow
def test_a_run_that_fails_is_marked_failed_with_its_error_in_each_tracker(prefect_server, mlflow_server,
                                                                           trackio_dir, tmp_path):
    # An absurd learning rate: step 1 is finite, its update blows the weights up, step 2's loss is not.
    store = ObjectStore(str(tmp_path / "store"))
    with pytest.raises(Exception, match="non-finite"):
        train_in_process("train", "rm", "--config", "configs/rm-tiny.toml", "--store", store.root, "--name",
                         "rm-fails", "--max-steps", "3", "--set", "algorithm.rm.optimizer.lr=1e30",
                         *tracker_overrides(mlflow_server, trackio_dir, "rm-fails"))
    mlflow = mlflow_read(mlflow_server, "rm-fails", run_key(store, "rm-fails"))
    assert mlflow["status"] == "FAILED" and "non-finite" in mlflow["tags"]["rollout.error"], mlflow["tags"]
    assert [step for step, _ in mlflow["history"]["loss"]] == [1]  # what it trained before the failure
    errors = [row["summary/error"] for row in trackio_logs(trackio_dir, "rm-fails", "rm-fails")
              if "summary/error" in row]
    assert len(errors) == 1 and "non-finite" in errors[0]
    (run_file,) = wandb_run_files(store, "rm-fails")
    assert any("non-finite" in str(update.get("error", "")) for update in wandb_file.summary_updates(run_file))
    assert wandb_file.exit_codes(run_file) == [1]  # W&B shows it failed


@pytest.mark.slow
def test_rl_sample_tables_in_each_tracker(prefect_server, mlflow_server, trackio_dir, tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    config = tmp_path / "rl.toml"
    config.write_text((ROOT / "configs/rl-tiny.toml").read_text()
                      .replace('"data/rl-tiny-prompts.jsonl"', f'"{ROOT / "data/rl-tiny-prompts.jsonl"}"'))
    done = train_in_process("train", "rl", "--config", str(config), "--store", store.root, "--name", "rl-trackers",
                            "--max-steps", "2", "--set", "run.tracker_samples=5",
                            *tracker_overrides(mlflow_server, trackio_dir, "rl-trackers"))
    assert len(done["reward_curve"]) == 2

    tables = ["samples/step_000000001.json", "samples/step_000000002.json"]
    mlflow = mlflow_read(mlflow_server, "rl-trackers", run_key(store, "rl-trackers"), tables)
    assert [step for step, _ in mlflow["history"]["reward_mean"]] == [1, 2]
    for path in tables:
        assert mlflow["tables"][path]["rows"] == 5
        assert {"prompt", "completion", "reward", "advantage", "reward_error"} <= set(mlflow["tables"][path]["columns"])

    wandb_rows = wandb_history(store, "rl-trackers")
    table_rows = [row for row in wandb_rows if row.get("sample_table/_type") == "table-file"]
    assert [row["_step"] for row in table_rows] == [1, 2] and all(row["sample_table/nrows"] == 5 for row in table_rows)
    assert all(row["samples"] == 32 for row in table_rows)  # the step's sample count, a metric, beside it
    run_dirs = wandb_dir(store, "rl-trackers") / "wandb"
    table_file = next(run_dirs.glob(f"offline-run-*/files/{table_rows[0]['sample_table/path']}"))
    written = json.loads(table_file.read_text())
    assert len(written["data"]) == 5 and "completion" in written["columns"]

    logs = trackio_logs(trackio_dir, "rl-trackers", "rl-trackers")
    tables = [row for row in logs if "sample_table" in row]
    assert [row["step"] for row in tables] == [1, 2]
    assert tables[0]["sample_table"]["_type"] == "trackio.table" and len(tables[0]["sample_table"]["_value"]) == 5
    assert steps_of(logs, "samples") == [1, 2]  # the step's sample count, a metric, is kept beside the table


class HungServer:
    """A port that accepts connections and never answers: a server that hangs rather than dies."""

    def __init__(self):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(16)
        self.uri = f"http://127.0.0.1:{self.socket.getsockname()[1]}"

    def close(self):
        self.socket.close()


@pytest.mark.slow
def test_a_dead_or_hung_mlflow_server_warns_once_and_changes_nothing(prefect_server, tmp_path, caplog):
    args = ["train", "rm", "--config", "configs/rm-tiny.toml", "--max-steps", "4"]
    plain = train_in_process(*args, "--store", str(tmp_path / "plain"))
    dead_port = free_port()  # nothing listens there: a server that was killed
    hung = HungServer()
    try:
        results = {}
        for name, uri in (("dead", f"http://127.0.0.1:{dead_port}"), ("hung", hung.uri)):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger=THREAD_LOGGER):
                results[name] = train_in_process(
                    *args, "--store", str(tmp_path / name), "--set", 'run.trackers=["mlflow"]',
                    "--set", f'run.mlflow={{tracking_uri = "{uri}", timeout_s = 5}}')
            warnings = [record.getMessage() for record in caplog.records if record.name == THREAD_LOGGER]
            assert len(warnings) == 1 and warnings[0].startswith("tracker mlflow failed, the run goes on without it")
    finally:
        hung.close()
    for name, result in results.items():
        assert result["checkpoint"] == plain["checkpoint"], name
        # The hung server's 5 s timeout is paid on the tracker's thread, not by the training loop.
        assert result["train_seconds"] < plain["train_seconds"] + 3.0, (name, result["train_seconds"],
                                                                        plain["train_seconds"])


@pytest.mark.slow
def test_a_rerun_after_sigkill_continues_each_tracker_run_without_duplicates_or_gaps(prefect_server, mlflow_server,
                                                                                    trackio_dir, tmp_path):
    from clirun import cli_env, run_until_then_kill

    store = ObjectStore(str(tmp_path / "store"))
    args = ["train", "rm", "--config", "configs/rm-tiny.toml", "--store", store.root, "--name", "killed-tiny",
            "--max-steps", "12", "--set", "algorithm.rm.checkpoint_interval=4",
            *tracker_overrides(mlflow_server, trackio_dir, "killed-trackers")]
    # SIGKILLed inside the second segment (steps 5-8), after its step 6: whatever each tracker had sent by then
    # stays, the steps queued on its thread are lost with the process.
    # Without WANDB_SERVICE: wandb puts it in the environment of a process that started W&B (this one, in an earlier
    # test), and a child with it joins that process's wandb-core, which would hold the killed run's id as in use
    # (a user's kill and rerun are two processes, each with a service of its own).
    env = {key: value for key, value in cli_env(ROLLOUT_LOG_LEVEL="DEBUG").items() if key != "WANDB_SERVICE"}
    run_until_then_kill(args, "step 6: ", tmp_path / "killed.log", env=env)
    rerun = train_in_process(*args)  # resumes: steps 1-4 from cache, 5-12 trained
    losses = {record["step"]: record["loss"] for record in read_metrics(store, "killed-tiny")}
    assert sorted(losses) == list(range(1, 13))

    mlflow = mlflow_read(mlflow_server, "killed-trackers", run_key(store, "killed-tiny"))
    assert mlflow["runs"] == 1 and mlflow["tags"]["rollout.final_checkpoint"] == rerun["checkpoint"]
    assert [step for step, _ in mlflow["history"]["loss"]] == list(range(1, 13))
    assert [value for _, value in mlflow["history"]["loss"]] == pytest.approx([losses[s] for s in range(1, 13)])
    assert steps_of(wandb_history(store, "killed-tiny"), "loss", "_step") == list(range(1, 13))
    assert steps_of(trackio_logs(trackio_dir, "killed-trackers", "killed-tiny"), "loss") == list(range(1, 13))
