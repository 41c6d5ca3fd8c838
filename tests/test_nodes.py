"""Training across nodes, simulated on this machine (docs/scale.md): each "node" is a torchrun of its own, joined by
torchrun's c10d rendezvous on 127.0.0.1, the second started from another working directory by the command the
first announces (what a launcher on another machine runs), which names no file of the first's: it receives the spec
over the group. train-rl's policy group across nodes: tests/test_rl_data_parallel.py."""

from __future__ import annotations

import socket
import subprocess

import pytest

from rollout_lib.identity.training import training_settings
from rollout_lib.config import RlConfig, SftConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.errors import ConfigError
from rollout_lib.rl.policy import policy_inputs
from rollout_lib.rl.policy_group import PolicyGroup
from rollout_lib.rl.prompts import load_prompts
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.causal import CausalLmTrainer, RecordedBatches
from rollout_lib.trainer.data_parallel import DataParallelError
from rollout_lib.trainer.node_parts import RECEIVE_SPEC, TORCHRUN
from rollout_lib.trainer.segment_group import run_segment_in_processes
from test_data_parallel import sft_inputs


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def sft(store: str, nproc: int, nnodes: int = 1, endpoint: str | None = None, timeout_s: float = 120) -> SftConfig:
    nodes = {"algorithm.sft.hardware.nnodes": nnodes, "algorithm.sft.hardware.rdzv_endpoint": endpoint,
             "algorithm.sft.hardware.rdzv_timeout_s": timeout_s} if nnodes > 1 else {}
    return load_config(SftConfig, "configs/sft-tiny.toml", {
        "run.store": store, "algorithm.sft.minibatch_size": 3, "algorithm.sft.gradient_accumulation": 3,
        "algorithm.sft.budget.max_steps": 2, "algorithm.sft.optimizer.lr": 0.05, "algorithm.sft.hardware.nproc": nproc,
        **nodes})


def test_nodes_are_hardware_settings_checked_before_anything_runs():
    with pytest.raises(ConfigError, match='algorithm.sft.hardware: .*set rdzv_endpoint = "host:port"'):
        load_config(SftConfig, "configs/sft-tiny.toml", {"algorithm.sft.hardware.nnodes": 2})
    with pytest.raises(ConfigError, match='algorithm.rl.hardware: .*set rdzv_endpoint = "host:port"'):
        load_config(RlConfig, "configs/rl-tiny.toml", {"algorithm.rl.hardware.nnodes": 2})
    # The ranks' count decides the additions, not how they spread over nodes: one identity.
    two_nodes = sft("/tmp/s", 1, 2, "127.0.0.1:29400")
    assert training_settings(two_nodes)["hardware"] == training_settings(sft("/tmp/s", 2))["hardware"] == {"nproc": 2}


def first_in_rank_order(command: list[str]) -> list[str]:
    """A node's torchrun command, its node named by 127.0.0.1 (sorted before this machine's name, "localhost"): the
    c10d rendezvous numbers nodes by address, so its ranks come first and rank 0 is not on the flow's node, as
    happens on a cluster. What rank 0 writes goes to the store; what the flow reads comes from its own node."""
    at = command.index(TORCHRUN) + 1
    return [*command[:at], "--local-addr=127.0.0.1", *command[at:]]


@pytest.mark.slow
def test_two_nodes_of_one_process_train_what_one_node_of_two_trains(tmp_path):
    store = str(tmp_path / "store")
    one_node, batches = sft_inputs(sft(store, 2))
    two_nodes, _ = sft_inputs(sft(store, 1, 2, f"127.0.0.1:{free_port()}"))
    start = CausalLmTrainer.initial(one_node, batches=batches).checkpoint_id
    expected, expected_history = run_segment_in_processes(CausalLmTrainer, one_node, start, 1, 2, 2, batches=batches)

    elsewhere = tmp_path / "node-1"
    elsewhere.mkdir()
    joined: list[subprocess.Popen] = []

    def launch_other_nodes(commands: dict[int, list[str]]) -> None:  # what a launcher on node 1 would run
        assert list(commands) == [1] and "--node-rank=1" in commands[1] and "--rdzv-backend=c10d" in commands[1]
        # no file of this machine's: node 1 receives the spec over the group
        assert commands[1][-2:] == [RECEIVE_SPEC, "gloo"] and not any(arg.endswith(".pkl") for arg in commands[1])
        joined.append(subprocess.Popen(first_in_rank_order(commands[1]), cwd=elsewhere, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL))

    checkpoint, history = run_segment_in_processes(CausalLmTrainer, two_nodes, start, 1, 2, 1,
                                                   announce=launch_other_nodes, batches=batches)
    assert joined and joined[0].wait(timeout=120) == 0
    assert checkpoint == expected  # same world size, same additions: the same checkpoint, byte for byte
    assert [m["loss"] for m in history] == [m["loss"] for m in expected_history]


@pytest.mark.slow
def test_a_node_that_never_joins_fails_the_segment_or_policy_group_in_one_line_naming_the_rendezvous(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    # 2 s: no node will come, so the whole timeout is waited (twice: the segment's group, the policy group)
    inputs, batches = sft_inputs(sft(str(tmp_path / "store"), 1, 2, endpoint, timeout_s=2))
    start = CausalLmTrainer.initial(inputs, batches=batches).checkpoint_id
    with pytest.raises(DataParallelError) as raised:
        run_segment_in_processes(CausalLmTrainer, inputs, start, 1, 2, 1, announce=lambda commands: None,
                                 batches=batches)
    message = str(raised.value)
    assert message == (f"train steps 1-2: not every node of 2 joined the training group's rendezvous at {endpoint} "
                       "within 2 s (hardware.rdzv_timeout_s); start the other nodes' torchrun (logged as the group "
                       "started), "
                       "or set hardware.nnodes = 1. The segment's start checkpoint is in the store, so a rerun trains "
                       "steps 1-2 again from it")

    # train-rl's policy group likewise, at its first command; nothing is lost: the start is in the store
    cfg = load_config(RlConfig, "configs/rl-tiny.toml", {
        "run.store": str(tmp_path / "rl"), "algorithm.rl.hardware.nnodes": 2,
        "algorithm.rl.hardware.rdzv_endpoint": endpoint, "algorithm.rl.hardware.rdzv_timeout_s": 2})
    store = ObjectStore(cfg.run.store)
    run = policy_inputs(store, cfg, {"words": store.put_table(load_prompts(cfg.settings.envs[0]))})
    start = CausalLmTrainer.initial(run, batches=RecordedBatches(store)).checkpoint_id
    group = PolicyGroup(run, announce=lambda commands: None)
    try:
        with pytest.raises(DataParallelError) as raised:
            group.export(start)
    finally:
        group.close()
    assert str(raised.value) == (
        f"export of state {start}: not every node of 2 joined the policy group's rendezvous at {endpoint} within 2 s "
        "(hardware.rdzv_timeout_s); start the other nodes' torchrun (logged as the group started), or set "
        "hardware.nnodes = 1. The steps before it are in the store, so a rerun trains from the last of them")
