"""A policy server on another node: started there (`rollout serve start BASE --live-policy`, here from another
working directory with a home of its own), reached by URL only (`policy_sampler.base_url`), and given each
step's weights through the run's store, which it reads itself (serving/store_fetch.py, in its worker extension): every state is reloaded
and passes the probe against the trainer's own forward, and a server that cannot read the store fails the step in
one line naming its URL and the store. A LoRA policy: on a server started with `--lora-rank` each step's adapter
goes through the store and is loaded in place there; served merged (`adapter_serving = "merged"`), a full-weights
server reloads the merged weights."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import psutil
import pytest

from clirun import final_result, on_other_node, run_rollout

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def policy_server_of_other_node(home, name: str, *flags: str):
    """tiny:qwen2 served as a live policy by another node (`rollout serve start ... --live-policy FLAGS`); its
    replica (`rollout serve status`: base_url, pid, log). Stopped at the end, and what it fetched goes with it."""
    from rollout_lib.serving.store_fetch import fetch_directory

    started = on_other_node(home, "serve", "start", "tiny:qwen2", "--name", name, "--live-policy", *flags)
    fetched: list[str] = []
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        [replica] = json.loads(on_other_node(home, "serve", "status").stdout)[0]["replicas"]
        yield replica
        # The server's worker (a child of the API server's process) fetches into a directory named by its own pid.
        server = psutil.Process(replica["pid"])
        fetched = [directory for directory in map(fetch_directory, [server.pid] + [child.pid for child in
                                                                                  server.children(recursive=True)])
                   if os.path.exists(directory)]
    finally:
        on_other_node(home, "serve", "stop", "--all")
    # What the server fetched (a model's size, in shared memory) went with it.
    assert not [directory for directory in fetched if os.path.exists(directory)]


@pytest.fixture(scope="module")
def remote_policy(tmp_path_factory):
    """tiny:qwen2 served as a live policy by the other node; its URL."""
    with policy_server_of_other_node(tmp_path_factory.mktemp("node1") / "home", "remote-policy") as replica:
        yield replica["base_url"]


def engine_steps(store, run_name: str) -> list[dict]:
    """The run's step metrics, each step's asserted sampled from a state the server had just loaded, once (a remote
    server is brought to each stage's state by that stage's sampler: sampling/vllm.py), that passed the probe: within
    its tolerance of the trainer's forward (a server still on the step before is >= 0.038 off: policy_server.py)."""
    from rollout_lib.runlog.metrics_file import read_metrics

    steps = [record for record in read_metrics(store, run_name) if record["step"] > 0]
    assert all(record["policy_server/reloads"] == 1 for record in steps), steps
    assert all(record["policy_server/probe_diff"] < 1e-3 for record in steps), steps
    return steps


def assert_lora_checkpoint(store, checkpoint: str, step: int) -> None:
    from rollout_lib.checkpoint import read_manifest
    from test_rl_data_parallel import assert_adapter_checkpoint

    manifest = read_manifest(store, checkpoint)
    assert manifest["step"] == step
    assert_adapter_checkpoint({"manifest": manifest, "weights": store.get_tensors(manifest["weights"])})


def test_a_lora_policy_samples_on_a_lora_server_of_another_node_given_each_adapter_through_the_store(
        prefect_server, tmp_path):
    """`rollout serve start tiny:qwen2 --live-policy --lora-rank 4` on the other node (its own server: it needs
    --enable-lora), a LoRA policy of rank 4 trained against it: each state's adapter, shipped through the store,
    is fetched by the server into its own directory and loaded there in place. Step 1, then the same run extended to
    step 2 (resume is a rerun), the server listing the adapter it loaded beside its base by then."""
    from clirun import train_in_process
    from rollout_lib.serving import engine
    from rollout_lib.store import ObjectStore

    store = ObjectStore(str(tmp_path / "store"))
    with policy_server_of_other_node(tmp_path / "home", "remote-lora-policy", "--lora-rank", "4") as replica:
        run = ["train", "rl", "--config", "configs/rl-tiny.toml", "--set", "algorithm.rl.adapter.r=4",
               "--set", f'algorithm.rl.policy_sampler={{ type = "vllm", base_url = ["{replica["base_url"]}/v1"] }}',
               "--store", store.root, "--name", "rl-remote-lora"]
        train_in_process(*run, "--max-steps", "1")
        done = train_in_process(*run, "--max-steps", "2")
        loads = re.findall(r"Loaded new LoRA adapter: name '(\S+)', path '(\S+)'", Path(replica["log"]).read_text())
        fetched = {path for _, path in loads}
        # Two states (the initial adapter for step 1, step 1's for step 2), each loaded in place under one name from
        # the server's own copy of what the run shipped: the adapter alone.
        assert [name for name, _ in loads] == ["remote-lora-policy-adapter"] * 2, loads
        [directory] = fetched
        assert Path(directory).name.startswith("rollout-policy-fetch-")
        assert sorted(os.listdir(directory)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not os.path.exists(directory)
    assert len(done["reward_curve"]) == 2
    assert_lora_checkpoint(store, done["checkpoint"], 2)
    assert [record["step"] for record in engine_steps(store, "rl-remote-lora")] == [1, 2]
    assert not [d for d in engine.running_deployments() if d.live_policy]  # the run started no server of its own
    assert not (tmp_path / "store" / "transfer").exists() or not any((tmp_path / "store" / "transfer").iterdir())


def test_a_run_samples_on_a_policy_server_of_another_node_shipping_each_state_through_the_store(
        prefect_server, remote_policy, tmp_path):
    from rollout_lib.serving import engine
    from rollout_lib.store import ObjectStore

    store = tmp_path / "store"
    done = run_rollout("train", "rl", "--config", "configs/rl-tiny.toml", "--max-steps", "3",
                       "--set", f'algorithm.rl.policy_sampler={{ type = "vllm", base_url = ["{remote_policy}/v1"] }}',
                       "--set", f"run.store={store}", "--set", "run.name=rl-remote")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(final_result(done)["reward_curve"]) == 3
    # Each step sampled a state the server had just fetched from the store and reloaded, and passed the probe.
    assert len(engine_steps(ObjectStore(str(store)), "rl-remote")) == 3
    assert not [d for d in engine.running_deployments() if d.live_policy]  # the run started no server of its own
    assert not (store / "transfer").exists() or not any((store / "transfer").iterdir())  # what was shipped is gone


def test_a_lora_policy_served_merged_samples_on_a_full_weights_server_of_another_node(prefect_server, remote_policy,
                                                                                     tmp_path):
    """`adapter_serving = "merged"`: the adapter folded into the base's weights, shipped and reloaded whole as a
    full fine-tune's, so a LoRA policy samples on a plain live-policy server (this module's, started anyway)."""
    from clirun import train_in_process
    from rollout_lib.store import ObjectStore

    store = ObjectStore(str(tmp_path / "store"))
    done = train_in_process("train", "rl", "--config", "configs/rl-tiny.toml", "--set", "algorithm.rl.adapter.r=4",
                            "--set", f'algorithm.rl.policy_sampler={{ type = "vllm", base_url = ["{remote_policy}/v1"], '
                                     'adapter_serving = "merged" }',
                            "--store", store.root, "--name", "rl-remote-merged", "--max-steps", "2")
    assert len(done["reward_curve"]) == 2
    assert_lora_checkpoint(store, done["checkpoint"], 2)
    # Step 2 sampled step 1's adapter, merged: the probe (trainer's peft forward vs the served merged weights) passed.
    assert [record["step"] for record in engine_steps(store, "rl-remote-merged")] == [1, 2]


def test_a_policy_server_that_cannot_read_the_store_fails_naming_its_url_and_the_store(remote_policy,
                                                                                        tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_lib.serving.policy_server import PolicyServer, PolicyServerError, PolicyServerSpec, remote_deployment
    from rollout_lib.settings_base import ModelRef
    from rollout_lib.store import ObjectStore

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # A store only this process reaches (fsspec's in-memory filesystem): the other node finds nothing there.
    spec = PolicyServerSpec(ModelRef(uri=str(tiny_model_dir)))
    server = PolicyServer(remote_deployment([f"{remote_policy}/v1"]), spec, ObjectStore("memory://unshared"))
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
