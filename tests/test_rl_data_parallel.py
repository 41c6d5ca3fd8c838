"""Data-parallel RL training (`algorithm.rl.hardware.nproc = 2`, rl/policy_group.py): two torchrun processes (gloo)
train each step's micro-batches between them and reach what one process trains, within rounding; a rank given
nothing but empty micro-batches does not hang; a rank SIGKILLed mid-run fails the run naming the step and the rank,
and the rerun, rebuilding the state from the store (its pending steps replayed data-parallel), ends on the
uninterrupted run's checkpoint id; two nodes of one process (torchrun's c10d rendezvous on 127.0.0.1) write the very
checkpoint one node of two writes. A LoRA policy (`algorithm.rl.adapter`) trains the same over 2 plain and 2 sharded
ranks, its checkpoints the adapter alone, and a sharded rank killed mid-step is rebuilt bit for bit by the rerun,
which ends on the uninterrupted sharded run's checkpoint id.

Tolerances as in tests/test_data_parallel.py: with SGD (lr 0.05) the 2-process weights agree with 1 process within
1e-6 while the weights move by more than 1e-4. (With the config's AdamW they agreed within 3.5e-6 after 3 steps at
lr 1e-2: Adam divides by the gradient's running magnitude, so rounding in near-zero gradients is magnified.)
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
import torch

from rollout_lib.config import RlConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.rl.advantages import training_samples
from rollout_lib.rl.pack import pack
from rollout_lib.rl.policy import initial_policy, policy_at, policy_inputs, snapshot_policy, train_policy_step
from rollout_lib.rl.prompts import load_prompts
from rollout_lib.rl.sample import build_samplers, sample_rollouts
from rollout_lib.rl.score import run_reward_loops, score_rollouts
from rollout_lib.store import ObjectStore
from rollout_lib.checkpoint import ADAPTER_KEY, model_weights, read_manifest
from rollout_lib.trainer.data_parallel import KILL_RANK_ENV
from rollout_lib.trainer.node_parts import RECEIVE_SPEC
from rollout_lib.identity.training import training_identity
from rollout_lib.model.loading import model_content_digest
from rollout_lib.trainer.resident import ResidentTrainer
from rollout_lib.rl.policy_group import PolicyGroup
import rollout_lib.rl.policy
from test_data_parallel import finished_within
from test_nodes import first_in_rank_order, free_port

ROOT = Path(__file__).resolve().parent.parent
WEIGHT_ATOL = 1e-6
SGD = ["algorithm.rl.optimizer.kind=sgd", "algorithm.rl.optimizer.lr=0.05"]


def rl_config(store: str, nproc: int, *overrides: str) -> RlConfig:
    return load_config(RlConfig, ROOT / "configs/rl-tiny.toml", [
        f"run.store={store}", f"algorithm.rl.hardware.nproc={nproc}", *SGD, *overrides])


def micro_batches_of_step(cfg: RlConfig, store: ObjectStore, prompts: dict, policy, step: int,
                          reward_loops) -> tuple[str, float]:
    """Step `step`'s sample, score and pack stages from `policy`: (its micro-batches' id, the mean reward)."""
    rollouts, _ = sample_rollouts(cfg, build_samplers(cfg, policy.model, policy.tokenizer), prompts, step)
    scored, reward_metrics = score_rollouts(cfg, rollouts, prompts, reward_loops)
    micro_batches, _ = pack(cfg, training_samples(cfg, scored)[0])
    return store.put_table(micro_batches), reward_metrics["reward_mean"]


def run_in_process(store: str, nproc: int, steps: int, *overrides: str) -> dict:
    """`steps` RL steps of rl-tiny through the library's stages, a snapshot every 2 steps and at the end: each
    step's rewards and train metrics, the final checkpoint's manifest and weights from the store and the flow
    process's copy of them (what it samples the next step with)."""
    cfg = rl_config(store, nproc, *overrides)
    store_ = ObjectStore(cfg.run.store)
    prompts = {env.name: load_prompts(env) for env in cfg.settings.envs}
    run = policy_inputs(store_, cfg, {name: store_.put_table(table) for name, table in prompts.items()})
    rewards, history = [], []
    with ResidentTrainer() as resident, run_reward_loops(cfg) as reward_loops:
        state = initial = initial_policy(run, resident)
        for step in range(1, steps + 1):
            micro_batches, reward = micro_batches_of_step(cfg, store_, prompts, policy_at(run, state, resident), step,
                                                          reward_loops)
            state, metrics = train_policy_step(run, state, step, micro_batches, resident)
            if step % 2 == 0 or step == steps:
                checkpoint = snapshot_policy(run, state, resident, metrics)
            rewards.append(reward)
            history.append(metrics)
        held = {name: tensor.clone() for name, tensor in model_weights(policy_at(run, state, resident).model).items()}
    manifest = read_manifest(store_, checkpoint)
    return {"rewards": rewards, "history": history, "held": held, "identity": manifest["training_identity"],
            "manifest": manifest, "weights": store_.get_tensors(manifest["weights"]),
            "initial": store_.get_tensors(read_manifest(store_, initial)["weights"]), "config": cfg}


def assert_same_training(one: dict, two: dict) -> None:
    assert two["identity"] == training_identity(two["config"]) != one["identity"]  # nproc = 2: its own chain
    assert two["rewards"] == one["rewards"]  # the same rollouts: the weights sampling them agree
    for single, dp in zip(one["history"], two["history"]):
        assert dp["micro_batches"] == single["micro_batches"] and dp["tokens"] == single["tokens"]
        assert dp["tokens/rl"] == single["tokens/rl"]  # the component counts are the step's, summed over ranks
        assert dp["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
        assert dp["loss"] == pytest.approx(single["loss"], abs=1e-6)
    moved = max((one["weights"][n] - one["initial"][n]).abs().max().item() for n in one["weights"])
    worst = max((one["weights"][n] - two["weights"][n]).abs().max().item() for n in one["weights"])
    assert moved > 1e-4 and worst <= WEIGHT_ATOL, (moved, worst)
    # The flow process samples with exactly what rank 0 wrote (tied embeddings included).
    assert all(torch.equal(two["held"][name], two["weights"][name]) for name in two["weights"])
    print(f"weights moved up to {moved:.3g}; 1 vs 2 processes at most {worst:.3g} apart")


@pytest.mark.slow
def test_two_processes_on_one_node_or_on_two_train_what_one_trains(prefect_server, tmp_path, monkeypatch):
    one = run_in_process(str(tmp_path / "one"), 1, 2)
    two = run_in_process(str(tmp_path / "two"), 2, 2)
    assert all(m["micro_batches"] > 2 for m in one["history"])  # both ranks had real micro-batches
    assert_same_training(one, two)

    # The same 2 ranks as 2 nodes of 1 (tests/test_nodes.py): node 1 a torchrun from another directory, started
    # by the command the group announces, ranked first by the rendezvous (so rank 0 is not on the flow's node).
    elsewhere = tmp_path / "node-1"
    elsewhere.mkdir()
    joined: list[subprocess.Popen] = []

    def launch_other_nodes(commands: dict[int, list[str]]) -> None:
        assert list(commands) == [1] and commands[1][-2:] == [RECEIVE_SPEC, "gloo"]
        joined.append(subprocess.Popen(first_in_rank_order(commands[1]), cwd=elsewhere, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL))

    monkeypatch.setattr(rollout_lib.rl.policy, "PolicyGroup", functools.partial(PolicyGroup,
                                                                                announce=launch_other_nodes))
    nodes = run_in_process(str(tmp_path / "nodes"), 1, 2, "algorithm.rl.hardware.nnodes=2",
                           f"algorithm.rl.hardware.rdzv_endpoint=127.0.0.1:{free_port()}")
    assert len(joined) == 1 and joined[0].wait(timeout=60) == 0  # one start; stopped with the run
    assert nodes["manifest"] == two["manifest"] and nodes["rewards"] == two["rewards"]  # the same checkpoint
    assert all(torch.equal(nodes["held"][name], nodes["weights"][name]) for name in nodes["weights"])

    # Node 1 a node agent (tests/test_node_agents.py: `rollout node start`, a Prefect worker from a directory and
    # home of its own): the policy group's start submits node 1's part to it; nothing is run for node 1 here.
    import flows.node_launch  # noqa: F401  what the flows import: hardware.node_pool's launcher
    from test_node_agents import NodeAgent, part_runs

    monkeypatch.undo()
    agent = NodeAgent(tmp_path / "agent", "test-rl-nodes").start()
    try:
        pooled = run_in_process(str(tmp_path / "pooled"), 1, 2, "algorithm.rl.hardware.nnodes=2",
                                f"algorithm.rl.hardware.rdzv_endpoint=127.0.0.1:{free_port()}",
                                "algorithm.rl.hardware.node_pool=test-rl-nodes")
    finally:
        agent.stop()
    assert pooled["manifest"] == two["manifest"] and pooled["rewards"] == two["rewards"]
    assert [run["state"] for run in part_runs(prefect_server, "test-rl-nodes")] == ["COMPLETED"]  # one group


@pytest.mark.slow
def test_a_rank_with_only_empty_micro_batches_does_not_hang(tmp_path):
    one_batch = ["algorithm.rl.packing=false", "algorithm.rl.sequences_per_micro_batch=32"]  # 4 x 8 samples
    one, two = finished_within(300, "data-parallel RL training", lambda: (
        run_in_process(str(tmp_path / "one"), 1, 2, *one_batch),
        run_in_process(str(tmp_path / "two"), 2, 2, *one_batch)))
    assert all(m["micro_batches"] == 1 for m in two["history"])  # rank 1: a filler, every step
    assert_same_training(one, two)


# --- a LoRA policy (algorithm.rl.adapter) over data-parallel and sharded ranks ----------------------------------

LORA = ("algorithm.rl.adapter.r=4",)
SHARDED = ("algorithm.rl.hardware.sharding=fsdp",)


def assert_adapter_checkpoint(result: dict) -> None:
    """The checkpoint holds the adapter's weights alone (PEFT's names) and names its base by content."""
    assert result["weights"] and all(".lora_A." in name or ".lora_B." in name for name in result["weights"])
    assert result["manifest"][ADAPTER_KEY]["base_model_content"] == model_content_digest("tiny:qwen2")


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory) -> dict:
    """2 steps of a LoRA policy in 1 process, on 2 plain ranks and on 2 sharded ones (the last also the
    uninterrupted run the kill test below must end on)."""
    root = tmp_path_factory.mktemp("lora")
    return {"one": run_in_process(str(root / "one"), 1, 2, *LORA),
            "two": run_in_process(str(root / "two"), 2, 2, *LORA),
            "sharded": run_in_process(str(root / "sharded"), 2, 2, *LORA, *SHARDED)}


@pytest.mark.slow
def test_a_lora_policy_trains_across_two_plain_or_sharded_processes_what_one_trains(lora_runs):
    for ranks in ("two", "sharded"):
        assert_adapter_checkpoint(lora_runs[ranks])
        assert_same_training(lora_runs["one"], lora_runs[ranks])


@pytest.mark.slow
def test_a_sharded_lora_policy_with_a_rank_killed_mid_step_fails_naming_it_and_the_rerun_ends_on_its_checkpoint(
        tmp_path, monkeypatch, lora_runs):
    """Rank 1 of a sharded LoRA group SIGKILLs itself as step 2 starts. The rerun (a new process, as after `rollout
    train` failed: nothing resident, step 2's micro-batches found in the store as Prefect's cache finds them)
    rebuilds the step-1 state on new sharded ranks by replaying step 1 from the step-0 checkpoint, bit for bit what
    the first group trained, and ends step 2 on the checkpoint an uninterrupted sharded run reaches, byte for byte
    (which trains what one process trains: the test above)."""
    from rollout_lib.trainer.data_parallel import DataParallelError

    uninterrupted = lora_runs["sharded"]
    cfg = rl_config(str(tmp_path / "sharded"), 2, *LORA, *SHARDED)
    store = ObjectStore(cfg.run.store)
    prompts = {env.name: load_prompts(env) for env in cfg.settings.envs}
    run = policy_inputs(store, cfg, {name: store.put_table(table) for name, table in prompts.items()})
    monkeypatch.setenv(KILL_RANK_ENV, "1:2")
    with ResidentTrainer() as resident, run_reward_loops(cfg) as reward_loops:
        initial = initial_policy(run, resident)
        first, _ = micro_batches_of_step(cfg, store, prompts, policy_at(run, initial, resident), 1, reward_loops)
        state, _ = train_policy_step(run, initial, 1, first, resident)
        trained = model_weights(policy_at(run, state, resident).model)
        second, _ = micro_batches_of_step(cfg, store, prompts, policy_at(run, state, resident), 2, reward_loops)
        with pytest.raises(DataParallelError) as raised:
            train_policy_step(run, state, 2, second, resident)
    assert str(raised.value).startswith("train step 2: data-parallel policy training (2 processes) failed: rank 1 "
                                        "exited with code -9"), raised.value
    assert "SIGKILL" in str(raised.value).splitlines()[0]  # the first line says it all; torchrun's tail follows

    monkeypatch.delenv(KILL_RANK_ENV)
    with ResidentTrainer() as resident:  # the rerun's process
        rebuilt = model_weights(policy_at(run, state, resident).model)  # exported by a new group, replayed
        assert rebuilt.keys() == trained.keys() and all(torch.equal(rebuilt[n], trained[n]) for n in trained)
        end, metrics = train_policy_step(run, state, 2, second, resident)
        checkpoint = snapshot_policy(run, end, resident, metrics)
    manifest = read_manifest(store, checkpoint)
    assert manifest == uninterrupted["manifest"]  # the same step, weights, optimizer state and history objects
    assert manifest["step"] == 2 and manifest["training_identity"] == training_identity(cfg)
    assert_adapter_checkpoint(uninterrupted)
    moved = max((uninterrupted["weights"][n] - uninterrupted["initial"][n]).abs().max().item()
                for n in uninterrupted["weights"])
    assert moved > 1e-4 and metrics["loss"] == uninterrupted["history"][1]["loss"]


# --- through the flow: `rollout train rl --nproc 2`, a rank SIGKILLed, the rerun -----------------------------------

ARGS = ["train", "rl", "--config", "configs/rl-tiny.toml", "--nproc", "2", "--max-steps", "3", "--set",
        "algorithm.rl.checkpoint_interval=3", "--quiet"]


@pytest.mark.slow
def test_sigkill_of_one_rank_fails_the_run_clearly_and_the_rerun_ends_on_the_same_checkpoint(prefect_server,
                                                                                             tmp_path):
    """Rank 1 SIGKILLs itself as step 3 (the last) starts: steps 1-2 are pending records on the step-0 checkpoint,
    so the rerun's ranks rebuild the state after step 2 by replaying them together, and must reach the same bits."""
    from clirun import final_result, run_rollout, task_run_states, train_in_process

    expected = train_in_process(*ARGS, "--store", str(tmp_path / "uninterrupted"))

    args = [*ARGS, "--store", str(tmp_path / "interrupted")]
    killed = run_rollout(*args, **{KILL_RANK_ENV: "1:3"})
    assert killed.returncode == 1, killed.stderr[-3000:]
    error = next(line for line in killed.stderr.splitlines() if line.startswith("rollout: error:"))
    assert "train step 3: data-parallel policy training (2 processes) failed: rank 1 exited with code -9" in error \
        and "SIGKILL" in error, error
    assert ObjectStore(str(tmp_path / "interrupted")).get_ref("runs/rl-tiny/latest") is None

    rerun = run_rollout(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = final_result(rerun)
    states = task_run_states(resumed["flow_run_id"])
    assert states["train-step-2"] == "Cached" and states["sample-and-score-step-3"] == "Cached", states
    assert states["train-step-3"] == "Completed", states
    assert resumed["checkpoint"] == expected["checkpoint"]
    assert resumed["reward_curve"] == expected["reward_curve"]
    manifest = read_manifest(ObjectStore(str(tmp_path / "interrupted")), resumed["checkpoint"])
    config = load_config(RlConfig, ROOT / "configs/rl-tiny.toml", {  # what --nproc 2 and the --set stand for
        "algorithm.rl.hardware.nproc": 2, "algorithm.rl.budget.max_steps": 3, "algorithm.rl.checkpoint_interval": 3})
    assert manifest["step"] == 3 and manifest["training_identity"] == training_identity(config)


@pytest.mark.slow
def test_a_failing_step_names_the_rank_and_its_error_and_the_next_command_starts_a_new_group(tmp_path):
    from rollout_lib.rl.policy_group import PolicyGroup
    from rollout_lib.trainer.causal import CausalLmTrainer, RecordedBatches
    from rollout_lib.trainer.data_parallel import DataParallelError

    cfg = load_config(RlConfig, ROOT / "configs/rl-tiny.toml", [f"run.store={tmp_path / 'store'}",
                                                                "algorithm.rl.hardware.nproc=2"])
    store = ObjectStore(cfg.run.store)
    run = policy_inputs(store, cfg, {"words": store.put_table(load_prompts(cfg.settings.envs[0]))})
    start = CausalLmTrainer.initial(run, batches=RecordedBatches(store)).checkpoint_id
    group = PolicyGroup(run)
    try:
        with pytest.raises(DataParallelError, match=r"train step 1: data-parallel policy training \(2 processes\) "
                                                    r"failed: rank \d: step 1: .*" + "0" * 64):
            group.train(start, 1, "0" * 64)  # no such micro-batches
        frozen = group.frozen_copy(start, group.export(start))  # a new group, at the same weights
        assert all(torch.equal(frozen.model.state_dict()[name], tensor)
                   for name, tensor in store.get_tensors(read_manifest(store, start)["weights"]).items())
    finally:
        group.close()
