"""A policy server on another node: started there (`rollout serve start BASE --live-policy`, here from another
working directory with a home of its own), reached by URL only (`policy_sampler.base_url`), and given each
step's weights through the run's store, which it reads itself (serving/store_fetch.py): every state is reloaded
and passes the probe against the trainer's own forward, and a server that cannot read the store fails the step in
one line naming its URL and the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from clirun import final_result, run_rollout

pytestmark = pytest.mark.slow


def other_node(home, *args: str) -> subprocess.CompletedProcess:
    """`rollout ...` as typed on the other node: its own directory and home, nothing shared but the code."""
    work = home.parent / "node-work"
    work.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLOUT_STATE_DIR", "PREFECT_API_URL")}
    return subprocess.run([sys.executable, "-m", "rollout_cli", *args], cwd=work,
                          env={**env, "ROLLOUT_HOME": str(home)}, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def remote_policy(tmp_path_factory):
    """tiny:qwen2 served as a live policy by the other node; its URL. Stopped at the end."""
    from rollout_lib.serving.store_fetch import fetch_directory

    home = tmp_path_factory.mktemp("node1") / "home"
    started = other_node(home, "serve", "start", "tiny:qwen2", "--name", "remote-policy", "--live-policy")
    replica = None
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        [replica] = json.loads(other_node(home, "serve", "status").stdout)[0]["replicas"]
        yield replica["base_url"]
    finally:
        other_node(home, "serve", "stop", "--all")
    # What the server fetched (a model's size, in shared memory) went with it.
    assert not os.path.exists(fetch_directory(replica["pid"]))


def test_a_run_samples_on_a_policy_server_of_another_node_shipping_each_state_through_the_store(
        prefect_server, remote_policy, tmp_path):
    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.serving import engine
    from rollout_lib.store import ObjectStore

    store = tmp_path / "store"
    done = run_rollout("train", "rl", "--config", "configs/rl-tiny.toml", "--max-steps", "3",
                       "--set", f'algorithm.rl.policy_sampler={{ type = "vllm", base_url = ["{remote_policy}/v1"] }}',
                       "--set", f"run.store={store}", "--set", "run.name=rl-remote")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(final_result(done)["reward_curve"]) == 3
    steps = [record for record in read_metrics(ObjectStore(str(store)), "rl-remote") if record["step"] > 0]
    # Each step sampled a state the server had just fetched from the store and reloaded: within the probe's
    # tolerance of the trainer's forward (a server still on the step before is >= 0.038 off: policy_server.py).
    assert all(record["policy_server/reloads"] >= 1 for record in steps), steps
    assert all(record["policy_server/probe_diff"] < 1e-3 for record in steps)
    assert not [d for d in engine.running_deployments() if d.live_policy]  # the run started no server of its own
    assert not (store / "transfer").exists() or not any((store / "transfer").iterdir())  # what was shipped is gone


def test_a_policy_server_that_cannot_read_the_store_fails_naming_its_url_and_the_store(remote_policy,
                                                                                        tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_lib.serving.policy_server import PolicyServer, PolicyServerError, remote_deployment
    from rollout_lib.store import ObjectStore

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # A store only this process reaches (fsspec's in-memory filesystem): the other node finds nothing there.
    server = PolicyServer(remote_deployment([f"{remote_policy}/v1"]), ship_through=ObjectStore("memory://unshared"))
    try:
        with pytest.raises(PolicyServerError) as raised:
            server.hold("state-a", model, tokenizer)
    finally:
        server.close()
    message = str(raised.value)
    assert message.startswith(f"policy server {remote_policy} ('remote-policy') cannot read the policy state from "
                              "the run's store at memory:///unshared/transfer/remote-policy: ")
    assert "no policy state at memory:///unshared/transfer/remote-policy" in message
    assert "\n" not in message
