"""`run.task_runner`: a step's scoring fanned out to a Dask cluster (prefect-dask) or a Ray cluster of two nodes
(prefect-ray) in chunks scores every rollout as the default thread runner's single score task does, so a run ends
on the same checkpoint; the runner is how fast, never what, so it is in no identity or cache key."""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import final_result, run_rollout, task_run_states, train_in_process
from rollout_lib.identity.training import training_settings
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.config.common import TaskRunnerSettings
from rollout_lib.store import ObjectStore
from rollout_lib.identity.training import training_identity

ROOT = Path(__file__).resolve().parent.parent
TINY = "configs/rl-tiny.toml"


def rl_tiny(**overrides) -> RlConfig:
    return load_config(RlConfig, str(ROOT / TINY), overrides)


def test_the_thread_runner_is_the_default_and_takes_no_cluster_settings():
    assert TaskRunnerSettings().type == "thread"
    assert rl_tiny().run.task_runner == TaskRunnerSettings()
    with pytest.raises(ConfigError, match=r"run\.task_runner.*address: settings of a dask or ray task runner"):
        rl_tiny(**{"run.task_runner.address": "tcp://10.0.0.1:8786"})
    with pytest.raises(ConfigError, match=r"run\.task_runner\.kind"):  # extra="forbid": a misspelt key is an error
        rl_tiny(**{"run.task_runner.kind": "dask"})
    with pytest.raises(ConfigError, match=r"run\.task_runner\.type"):
        rl_tiny(**{"run.task_runner.type": "spark"})


def test_cluster_settings_belong_to_the_cluster_they_start():
    local = TaskRunnerSettings(type="dask", n_workers=2, threads_per_worker=2)
    assert local.score_chunks == 2
    assert TaskRunnerSettings(type="dask", address="tcp://10.0.0.1:8786", chunks=16).score_chunks == 16
    assert TaskRunnerSettings(type="ray").score_chunks == 4
    with pytest.raises(ValueError, match="n_workers: settings of a Dask LocalCluster, not of a Dask cluster at an"):
        TaskRunnerSettings(type="dask", address="tcp://10.0.0.1:8786", n_workers=2)
    with pytest.raises(ValueError, match="threads_per_worker: settings of a Dask LocalCluster, not of a Ray"):
        TaskRunnerSettings(type="ray", threads_per_worker=4)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        TaskRunnerSettings(type="dask", chunks=0)


def test_the_task_runner_is_in_no_identity():
    default = rl_tiny()
    dask = rl_tiny(**{"run.task_runner.type": "dask", "run.task_runner.n_workers": 2, "run.task_runner.chunks": 3})
    assert training_hash(dask) == training_hash(default)
    assert training_identity(dask) == training_identity(default)
    assert "task_runner" not in str(training_settings(dask))


def test_chunked_scoring_merges_to_the_single_score_tasks_table_and_metrics(tmp_path):
    import pyarrow as pa
    from prefect.logging import disable_run_logger

    from rollout_lib import wire
    from rollout_lib.rl.score import chunk_rows, run_reward_loops
    from tasks.rl import score_chunk_task, score_merge_task, score_task

    config = rl_tiny(**{"run.store": str(tmp_path / "store")})
    store = ObjectStore(config.run.store)
    prompts = store.put_table(pa.Table.from_pylist([
        {"example_id": example, "env": "words", "source_line": line, "answer": None, "info": None,
         "messages": [{"role": "user", "content": "Say something."}]} for line, example in enumerate("ab")],
        schema=wire.PROMPTS))
    completions = ["one two", "one two three four five six seven eight nine ten eleven twelve", "", "x " * 30,
                   "a b c", "the sea the sea the sea"]
    rollouts = store.put_table(pa.Table.from_pylist([
        {"sample_id": f"s{i}", "example_id": "ab"[i % 2], "env": "words", "group_index": i // 2, "prompt_ids": [1],
         "completion_ids": [2], "sampling_logprobs": [-0.1], "completion_text": text, "answer": None, "info": None}
        for i, text in enumerate(completions)], schema=wire.ROLLOUTS))
    table = store.get_table(rollouts)  # groups a and b interleaved: a chunk holds whole groups, not a run of rows
    assert [chunk_rows(table, chunk, 2) for chunk in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [chunk_rows(table, chunk, 4) for chunk in range(4)] == [[], [0, 2, 4], [], [1, 3, 5]]  # empty chunks too
    with disable_run_logger(), run_reward_loops(config) as loops:
        single = score_task.fn(config, {"words": prompts}, rollouts, 1, loops)
    for chunks in (1, 4, 7):
        chunk_ids = [score_chunk_task.fn(config, {"words": prompts}, rollouts, 1, chunk, chunks)
                     for chunk in range(chunks)]
        with disable_run_logger():
            merged = score_merge_task.fn(config, rollouts, 1, chunk_ids)
        assert merged["rollouts"] == single["rollouts"]
        assert {k: v for k, v in merged["metrics"].items() if k != "score_s"} == \
            {k: v for k, v in single["metrics"].items() if k != "score_s"}
    assert store.get_table(single["rollouts"]).column("reward").to_pylist()[1] == 1.0  # 12 words: the target


STEPS = ["--set", "algorithm.rl.budget.max_steps=2", "--set", "algorithm.rl.checkpoint_interval=2"]
DASK = ["--set", "run.task_runner.type=dask", "--set", "run.task_runner.n_workers=2"]


@pytest.fixture(scope="module")
def thread_run(prefect_server, tmp_path_factory) -> tuple[dict, Path]:
    """2 steps of rl-tiny on the default (thread) runner: its final result and its store."""
    store = tmp_path_factory.mktemp("thread") / "store"
    return train_in_process("train", "rl", "--config", TINY, "--set", f"run.store={store}", *STEPS), store


def chunk_states(states: dict) -> dict:
    return {name: state for name, state in states.items() if name.startswith(("score-step-", "score-merge-step-"))}


def run_on_a_cluster(store: Path, runner: list[str], started: str, expected: dict, **env: str) -> dict:
    """2 rl-tiny steps scored in 2 chunks a step on the runner `runner` stands for: the run's result, checked to
    end on the thread runner's checkpoint and reward curve (`expected`), with every chunk task run and `started`
    (the runner's line saying it started or joined a cluster) in its output."""
    done = run_rollout("train", "rl", "--config", TINY, "--set", f"run.store={store}", *STEPS, *runner, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = final_result(done)
    assert result["checkpoint"] == expected["checkpoint"]
    assert result["reward_curve"] == expected["reward_curve"]
    assert started in done.stdout + done.stderr
    states = task_run_states(result["flow_run_id"])
    assert chunk_states(states) == {name: "Completed" for step in (1, 2) for name in (
        f"score-step-{step}-chunk-0", f"score-step-{step}-chunk-1", f"score-merge-step-{step}")}
    return result


@pytest.mark.slow
def test_a_run_scored_on_a_dask_local_cluster_in_an_s3_store_ends_on_the_default_runners_checkpoint(thread_run,
                                                                                                     s3_options):
    """A team's set-up in small: the store (and so the result storage) in a bucket every Dask worker reaches with
    the run's storage_options (a moto server here)."""
    import uuid

    import fsspec

    from s3server import BUCKET
    from test_s3_results import toml_inline

    expected, thread_store = thread_run
    store_url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    on_s3 = ["--set", f"run.storage_options={toml_inline(s3_options)}"]
    result = run_on_a_cluster(store_url, [*DASK, *on_s3], "Creating a new Dask cluster", expected)
    assert ObjectStore(store_url, s3_options).get_ref("runs/rl-tiny/latest") == expected["checkpoint"]

    # Every object the default run stored (rollouts, scored tables, samples, micro-batches, states, the
    # checkpoint) is in the Dask run's store, byte for byte, but the rewards the default run scored as it sampled
    # (reward_loop.streamed: one object a step, which a Dask run scores in its chunks instead).
    bucket = fsspec.filesystem("s3", skip_instance_cache=True, **s3_options)
    root = store_url.removeprefix("s3://")
    thread_objects = {path.name for path in (thread_store / "objects").glob("*/*")}
    dask_objects = {path.rsplit("/", 1)[1] for path in bucket.find(f"{root}/objects")}
    assert len(thread_objects - dask_objects) == 2, sorted(thread_objects - dask_objects)[:5]  # 2 steps' rewards
    assert len(dask_objects - thread_objects) == 2 * 2  # 2 steps x 2 chunks
    # The workers stored their tasks' results in the run's result storage, in the bucket: a rerun is all cache.
    states = task_run_states(result["flow_run_id"])
    cached = [name for name in states if not name.startswith("snapshot-")]  # snapshots: the store's index is theirs
    assert len(bucket.find(f"{root}/prefect-results")) >= len(cached), sorted(states)
    # On a cluster of one worker, in the same 2 chunks a step: the chunks' cache keys hold no cluster (the runner is
    # how fast, never what), and one worker process less to start. The flow in this process: the CLI ran the first.
    one_worker = ["--set", "run.task_runner.type=dask", "--set", "run.task_runner.n_workers=1",
                  "--set", "run.task_runner.chunks=2"]
    rerun = train_in_process("train", "rl", "--config", TINY, "--set", f"run.store={store_url}", *STEPS,
                             *one_worker, *on_s3)
    assert rerun["checkpoint"] == expected["checkpoint"]
    assert set(chunk_states(task_run_states(rerun["flow_run_id"])).values()) == {"Cached"}


RAY = ["--set", "run.task_runner.type=ray", "--set", "run.task_runner.chunks=2"]


@pytest.fixture
def two_node_ray_cluster():
    """A Ray cluster of two nodes on this machine, as on two machines: `ray start --head` and a second `ray start
    --address` (each its own raylet, one CPU and a resource of its own), token-authenticated as Ray 2.60 clusters
    are (RAY_AUTH_MODE=token, the token in RAY_AUTH_TOKEN: every process of the cluster and every driver needs
    it). Yields (address, dashboard URL, the environment a driver needs); `ray stop` at the end."""
    from rollout_lib.processes import free_port

    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_USAGE_STATS_ENABLED": "0"}
    ray = str(Path(sys.executable).parent / "ray")
    port, dashboard = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--object-store-memory", "200000000",
              "--disable-usage-stats"]
    try:
        for args in (["--head", "--port", str(port), "--resources", '{"node_a": 1}', "--include-dashboard", "true",
                      "--dashboard-port", str(dashboard)],
                     ["--address", address, "--resources", '{"node_b": 1}']):
            started = subprocess.run([ray, "start", *args, *common], env=env, capture_output=True, text=True,
                                     timeout=120)
            assert started.returncode == 0, started.stdout + started.stderr
        yield address, f"http://127.0.0.1:{dashboard}", {key: env[key] for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("prefect_ray") is None, reason="the ray extra (scripts/setup.sh --test)")
def test_a_run_scored_on_a_two_node_ray_cluster_ends_on_the_default_runners_checkpoint(thread_run, tmp_path,
                                                                                      two_node_ray_cluster):
    expected, _ = thread_run
    address, dashboard, auth = two_node_ray_cluster
    run_on_a_cluster(tmp_path / "ray", [*RAY, "--set", f"run.task_runner.address={address}"],
                     "Using Ray cluster with 2 nodes.", expected, **auth)
    # The step's score chunks ran on both nodes (the cluster's own record of its tasks, read as a driver would:
    # in a process of its own with the cluster's token).
    listed = subprocess.run([sys.executable, "-c", (
        "from ray.util.state import list_tasks\n"
        f"tasks = list_tasks(address={dashboard!r}, filters=[('name', '=', 'score-chunk')], limit=1000)\n"
        "print(len({task.node_id for task in tasks}))")], env={**os.environ, **auth}, capture_output=True,
        text=True, timeout=120)
    assert listed.stdout.strip().splitlines()[-1:] == ["2"], listed.stdout + listed.stderr[-2000:]


def test_ray_without_its_extra_is_an_error_naming_the_setting(monkeypatch):
    from flows.common import fan_out_runner

    monkeypatch.setitem(sys.modules, "prefect_ray", None)  # as if not installed: importing it raises ImportError

    with pytest.raises(ConfigError, match=r"^run\.task_runner\.type: \"ray\" needs prefect-ray: pip install"):
        with fan_out_runner(TaskRunnerSettings(type="ray")):
            pass
    with fan_out_runner(TaskRunnerSettings()) as runner:
        assert runner is None  # the thread runner: the flow's own tasks, no cluster
