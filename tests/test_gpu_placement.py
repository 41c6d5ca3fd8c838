"""GPUs placed (issue 44): the trainer's ranks, the policy server's replicas and those of the frozen and reward models
rollout serves take disjoint GPUs of a node, each launched process seeing only its own (CUDA_VISIBLE_DEVICES), refused at plan time when they cannot. This machine
has no GPU: tested by the environment each launched process receives (docs/scale.md, "GPUs placed")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from clirun import ROOT
from rollout_cli.config_cmd import config_class
from rollout_cli.main import main
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.hardware import replica_gpus
from rollout_lib.rl import policy_group
from rollout_lib.serving import engine
from rollout_lib.trainer import data_parallel, rank_group, segment_group

TRAINER_GPUS = ["--set", "algorithm.rl.hardware.gpus=[0, 1]", "--set", "algorithm.rl.hardware.nproc=2"]


@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch):
    monkeypatch.chdir(ROOT)


def rollout(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def inputs_of(entry_point: str, *overrides: str):
    """What the launching side reads of a training's inputs: its config and settings block."""
    config = load_config(config_class(entry_point), f"configs/{entry_point}-tiny.toml", list(overrides))
    return SimpleNamespace(config=config, settings=config.settings)


class Launched(Exception):
    """Raised by the stand-in for Popen once it has seen what the process would be started with."""


def launched_env(monkeypatch, module, start) -> dict:
    """The environment `start()` launches its process with (module.subprocess.Popen, stopped there)."""
    seen = {}

    def popen(command, **kwargs):
        seen.update(kwargs["env"], command=command)
        raise Launched

    monkeypatch.setattr(module.subprocess, "Popen", popen)
    with pytest.raises(Launched):
        start()
    return seen


# --- what each launched process sees ------------------------------------------------------------------------


def test_a_training_segments_torchrun_sees_only_the_trainers_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")  # the node's, as a scheduler may set it
    inputs = inputs_of("sft", "algorithm.sft.hardware.nproc=2", "algorithm.sft.hardware.gpus=[4, 6]")
    env = launched_env(monkeypatch, rank_group, lambda: segment_group.run_segment_in_processes(
        object, inputs, "checkpoint", 1, 2, 2))
    assert "rollout_lib.trainer.torchrun" in env["command"] and "--nproc_per_node=2" in env["command"]
    # local rank i takes the i-th visible GPU (segment_worker: cuda:LOCAL_RANK): rank 0 -> GPU 4, rank 1 -> GPU 6
    assert env["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert "4,6" not in " ".join(env["command"])  # the placement is the environment's, not the command line's


def test_the_rl_policy_groups_torchrun_sees_only_the_trainers_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    inputs = inputs_of("rl", "algorithm.rl.hardware.nproc=2", "algorithm.rl.hardware.gpus=[2, 3]")
    group = policy_group.PolicyGroup(inputs)
    try:
        env = launched_env(monkeypatch, rank_group, lambda: group.ranks._start("train step 1", "rerun"))
    finally:
        group.close()
    assert "rollout_lib.rl.policy_rank" in env["command"]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_without_gpus_the_ranks_environment_is_what_it_was(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert data_parallel.rank_environment(inputs_of("sft", "algorithm.sft.hardware.nproc=2"))[
        "CUDA_VISIBLE_DEVICES"] == "5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "CUDA_VISIBLE_DEVICES" not in data_parallel.rank_environment(
        inputs_of("sft", "algorithm.sft.hardware.nproc=2"))


def deployment(gpus: list[list[int]], env: dict | None = None) -> engine.Deployment:
    return engine.Deployment(name="policy", model="m", model_dir="/m", runner="generate", max_model_len=64,
                             env=env or {}, gpus=gpus)


def test_each_vllm_replica_sees_only_its_share_of_the_policy_servers_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    placed = deployment(replica_gpus([2, 3, 4, 5], 2))
    assert placed.gpus == [[2, 3], [4, 5]]
    assert [engine._server_env(placed, 2, j)["CUDA_VISIBLE_DEVICES"] for j in (0, 1)] == ["2,3", "4,5"]
    # placed wins over the deployment's own env, which is set for every replica alike
    assert engine._server_env(deployment([[6]], {"CUDA_VISIBLE_DEVICES": "0"}), 1, 0)["CUDA_VISIBLE_DEVICES"] == "6"
    assert engine._server_env(deployment([]), 2, 1)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"  # unplaced: as before
    # a record written before placement existed still loads, unplaced
    record = placed.to_json()
    del record["gpus"]
    assert engine.Deployment.from_json(record).gpus == []


def test_one_trainer_process_computes_on_the_first_of_its_gpus(monkeypatch):
    from rollout_lib.hardware import HardwareSettings, resolve_hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert resolve_hardware(HardwareSettings(gpus=[3])).device == torch.device("cuda", 3)
    # torchrun's ranks see only their GPUs, renumbered from 0: the settings' "cuda" is the rank's own there
    assert resolve_hardware(HardwareSettings(gpus=[3, 4], nproc=2)).device == torch.device("cuda")


# --- refused at plan time, in one line ----------------------------------------------------------------------


@pytest.mark.parametrize(("entry_point", "overrides", "error"), [
    ("rl", [*TRAINER_GPUS, "--set", 'algorithm.rl.policy_sampler={ type = "vllm", replicas = 2, gpus = [1, 2] }'],
     "algorithm.rl.policy_sampler.gpus: GPU 1 is also in algorithm.rl.hardware.gpus: the trainer's ranks and each "
     "served model's replicas take disjoint GPUs"),
    ("sft", ["--set", "algorithm.sft.hardware.nproc=4", "--set", "algorithm.sft.hardware.gpus=[0, 1]"],
     "algorithm.sft.hardware.gpus: nproc = 4 ranks per node take one GPU each, and gpus lists 2 ([0, 1]): list 4 "
     "GPUs or lower nproc"),
    ("rl", ["--set", 'algorithm.rl.policy_sampler={ type = "vllm", replicas = 2, gpus = [1, 2, 3] }'],
     "algorithm.rl.policy_sampler: gpus = [1, 2, 3] splits into replicas = 2 equal shares: list a multiple of 2 GPUs"),
    ("rm", ["--set", 'algorithm.rm.hardware.device="cpu"', "--set", "algorithm.rm.hardware.gpus=[0]"],
     "algorithm.rm.hardware: gpus places the trainer on GPUs [0]: use device = \"cuda\" or \"auto\", not 'cpu'"),
])
def test_gpus_that_do_not_fit_are_refused_in_one_line(capsys, entry_point, overrides, error):
    code, out, err = rollout(capsys, "train", entry_point, "--config", f"configs/{entry_point}-tiny.toml",
                             "--dry-run", *overrides)
    assert (code, out) == (2, ""), err
    assert err.startswith(f"rollout: error: configs/{entry_point}-tiny.toml: {error}") and len(err.splitlines()) == 1, \
        err


def test_a_gpu_the_node_does_not_have_is_refused_where_torch_sees_cuda(capsys, monkeypatch):
    # this machine has no GPU: CUDA as torch would report a node of 2 (on a CPU-only machine the check is skipped)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, out, err = rollout(capsys, "train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run", *TRAINER_GPUS,
                             "--set", 'algorithm.rl.policy_sampler={ type = "vllm", gpus = [5] }')
    assert (code, out) == (2, "") and len(err.splitlines()) == 1, err
    assert "algorithm.rl.policy_sampler.gpus: GPU 5 is not on this node, which has 2 (0-1)" in err


def test_disjoint_gpus_pass_the_plan_and_leave_the_training_identity_as_it_was(capsys):
    placed = [*TRAINER_GPUS, "--set", 'algorithm.rl.policy_sampler={ type = "vllm", replicas = 2, gpus = [2, 3] }']
    code, out, err = rollout(capsys, "train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run", *placed)
    assert code == 0, err
    unplaced = ["algorithm.rl.hardware.nproc=2", 'algorithm.rl.policy_sampler={ type = "vllm", replicas = 2 }']
    with_gpus = placed[1::2]  # the --set values
    assert training_hash(load_config(config_class("rl"), "configs/rl-tiny.toml", with_gpus)) == \
        training_hash(load_config(config_class("rl"), "configs/rl-tiny.toml", unplaced))


# --- the frozen and reward models rollout serves ------------------------------------------------------------------

JUDGE_ON_GPU_1 = ["--set", 'algorithm.rl.envs[0].rewards=[{ judge = { model = "tiny:qwen2", replicas = 2, '
                           'gpus = [1, 2] } }]']
SERVED_RM = 'algorithm.rl.envs[0].rewards=[{ reward_model = "tiny:qwen2", engine = "vllm", gpus = [%s] }]'


@pytest.mark.parametrize(("overrides", "error"), [
    ([*TRAINER_GPUS, *JUDGE_ON_GPU_1],
     "algorithm.rl.envs[0].rewards[0].judge.gpus: GPU 1 is also in algorithm.rl.hardware.gpus: the trainer's ranks "
     "and each served model's replicas take disjoint GPUs"),
    (["--set", 'algorithm.rl.policy_sampler={ type = "vllm", gpus = [3] }', "--set", SERVED_RM % "3"],
     "algorithm.rl.envs[0].rewards[0].gpus: GPU 3 is also in algorithm.rl.policy_sampler.gpus"),
    (["--set", 'algorithm.rl.envs[0].rewards=[{ judge = { model = "tiny:qwen2", replicas = 2, gpus = [1, 2, 3] } }]'],
     "algorithm.rl.envs[0].rewards[0].judge: gpus = [1, 2, 3] splits into replicas = 2 equal shares"),
    (["--set", 'algorithm.rl.envs[0].rewards=[{ reward_model = "tiny:qwen2", gpus = [0] }]'],
     "algorithm.rl.envs[0].rewards[0]: gpus places the vLLM servers rollout starts for this reward model: set "
     'engine = "vllm" with it'),
])
def test_frozen_and_reward_models_rollout_serves_take_their_own_gpus_or_are_refused_in_one_line(capsys, overrides,
                                                                                                  error):
    code, out, err = rollout(capsys, "train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run", *overrides)
    assert (code, out) == (2, ""), err
    assert err.startswith(f"rollout: error: configs/rl-tiny.toml: {error}") and len(err.splitlines()) == 1, err


def test_each_replica_of_a_served_judge_and_reward_model_sees_only_its_share(monkeypatch, tmp_path):
    """What ServedModels asks the engine for (a judge on 2 replicas over GPUs [4, 5], a reward model on [6]) and the
    environment each replica would be launched with; a running deployment of the model placed otherwise is
    refused in one line naming the setting, not reused or doubled; the placement leaves the identity as it was."""
    from rollout_lib.errors import ConfigError
    from rollout_lib.serving import served
    from rollout_lib.serving.settings import ServedModel
    from rollout_lib.settings_base import ModelRef

    started = []

    def start_deployment(reference, *, replicas, gpus, **_):
        started.append(deployment(replica_gpus(list(gpus), replicas)))
        raise Launched

    monkeypatch.setattr(served, "served_model_directory", lambda uri, store: tmp_path / "model")
    monkeypatch.setattr(engine, "running_deployments", lambda: [])
    monkeypatch.setattr(engine, "start_deployment", start_deployment)
    judge = ServedModel(model="tiny:qwen2", replicas=2, gpus=[4, 5])
    with served.ServedModels(str(tmp_path / "store")) as models:
        with pytest.raises(Launched):
            models.pool(judge, where="algorithm.rl.envs[0].rewards[0].judge")
        with pytest.raises(Launched):
            models.reward_model_pool(ModelRef(uri="tiny:qwen2"), replicas=1, where="r", gpus=[6])
    assert [placed.gpus for placed in started] == [[[4], [5]], [[6]]]
    assert [engine._server_env(started[0], 2, j)["CUDA_VISIBLE_DEVICES"] for j in (0, 1)] == ["4", "5"]
    assert engine._server_env(started[1], 1, 0)["CUDA_VISIBLE_DEVICES"] == "6"

    elsewhere = engine.Deployment(name="tiny-qwen2", model="tiny:qwen2", model_dir=str(tmp_path / "model"),
                                  runner="generate", max_model_len=64, env={}, gpus=[[0], [1]])
    monkeypatch.setattr(engine, "running_deployments", lambda: [elsewhere])
    with served.ServedModels(str(tmp_path / "store")) as models, pytest.raises(ConfigError) as refused:
        models.pool(judge, where="algorithm.rl.envs[0].rewards[0].judge")
    assert str(refused.value) == (
        "algorithm.rl.envs[0].rewards[0].judge.gpus: tiny:qwen2 is already served by deployment 'tiny-qwen2' on GPUs "
        "[[0], [1]], not [[4], [5]]: stop it (rollout serve stop tiny-qwen2) or leave gpus out to use it")

    def identity(rewards: str) -> str:
        return training_hash(load_config(config_class("rl"), "configs/rl-tiny.toml",
                                         [f"algorithm.rl.envs[0].rewards={rewards}"]))

    assert identity('[{ judge = { model = "tiny:qwen2", gpus = [4] } }]') == \
        identity('[{ judge = { model = "tiny:qwen2" } }]')
    assert identity('[{ reward_model = "tiny:qwen2", engine = "vllm", gpus = [6] }]') == \
        identity('[{ reward_model = "tiny:qwen2", engine = "vllm" }]')
