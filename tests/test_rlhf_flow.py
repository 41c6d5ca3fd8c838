"""rlhf end to end through `rollout train rlhf` and a real Prefect server: sft -> rm -> rl as three subflows, RL
starting from the SFT checkpoint and rewarded by the RM checkpoint (by id); a rerun after changing an RL setting
trains RL only (every SFT and RM task Cached); a pipeline SIGKILLed mid-RM, then mid-RL, then rerun ends on the
final checkpoint of an uninterrupted run; `rlhf/default` runs through the worker. Before any of it: the pipeline
config's errors name their place, and `--dry-run` plans the three stages.

The uninterrupted run is `rlhf/default` through the worker (`prefect deployment run`, as users run it): the CLI runs
here (the changed setting, the killed pipeline's rerun) end on its checkpoints, so the worker's pipeline and the
CLI's are held to the same bytes without a second uninterrupted pipeline."""

from __future__ import annotations

import json
import re

import pytest

from clirun import ROOT, final_result, metrics_table, run_rollout, run_until_then_kill, task_run_states
from rollout_lib.config import ConfigError, RlConfig, RlhfConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.config.loading import apply_overrides, read_toml
from rollout_lib.plan_checks import validate_config
from rollout_lib.store import ObjectStore
from rollout_lib.checkpoint import read_manifest
from rollout_lib.identity.training import training_identity

CONFIG = ["train", "rlhf", "--config", "configs/rlhf-tiny.toml"]
RL_STEPS = 20  # configs/rl-tiny.toml
RL_STAGES = ("sample-and-score", "score-merge", "advantages", "pack", "train")  # streamed scoring


def rlhf(store, *extra: str):
    completed = run_rollout(*CONFIG, "--set", f"run.store={store}", *extra)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return final_result(completed)


@pytest.mark.parametrize("overrides, error", [
    (['rl.overrides=["algorithm.rl.base_model=tiny:qwen2"]'],
     "rl.overrides[0]: sets algorithm.rl.base_model, which the pipeline sets: the policy starts from the SFT stage's "
     "checkpoint"),
    (['sft.overrides=["run.store=/elsewhere"]'],
     "sft.overrides[0]: sets run.store, which the pipeline sets: every stage trains in the pipeline's [run] store"),
    (['rm.overrides=["algorithm.rm.base_model=tiny:qwen2"]'],
     "rm.overrides[0]: sets algorithm.rm.base_model, which the pipeline sets: the RM starts from the SFT stage's "
     "checkpoint (rm.start_from)"),
    (['rl.rm_rewards[0].env="math"'],
     f"rl.rm_rewards[0].env: no env 'math' in {ROOT}/configs/rl-tiny.toml (its envs: words)"),
    (['rl.overrides=["algorithm.rl.envs[0].rewards[0].weight=2"]'],
     "rl.overrides[0]: sets algorithm.rl.envs[0].rewards[0].weight, but the RM checkpoint replaces the rewards of env "
     "'words' (rl.rm_rewards: keep_rewards = false)"),
    (['rl.overrides=["algorithm.rl.optimizer.lr=-1"]'],
     f"rl: {ROOT}/configs/rl-tiny.toml: algorithm.rl.optimizer.lr: must be > 0.0 (got -1)"),
    (['sft.config="configs/missing.toml"'], f"sft.config: {ROOT}/configs/missing.toml: config file not found"),
])
def test_a_bad_pipeline_setting_fails_before_any_stage_naming_its_place(overrides, error, monkeypatch):
    monkeypatch.chdir("/")  # stage configs and data paths resolve from the pipeline config's project, wherever this runs
    with pytest.raises(ConfigError) as raised:
        load_config(RlhfConfig, ROOT / "configs/rlhf-tiny.toml", overrides)
    assert str(raised.value) == f"{ROOT / 'configs/rlhf-tiny.toml'}: {error}"


def test_the_pipeline_passes_each_stage_the_store_and_the_earlier_checkpoints_by_id(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_config(RlhfConfig, ROOT / "configs/rlhf-tiny.toml", ["run.store=/tmp/rlhf-store"])
    sft_id, rm_id = "a" * 64, "b" * 64
    assert config.stage_overrides("sft") == {"run.store": "/tmp/rlhf-store", "run.storage_options": {}}
    assert config.stage_overrides("rm", sft_checkpoint=sft_id)["algorithm.rm.base_model"] == sft_id
    rl = config.stage_overrides("rl", sft_checkpoint=sft_id, rm_checkpoint=rm_id)
    assert rl["algorithm.rl.base_model"] == sft_id
    assert rl["algorithm.rl.envs[0].rewards"] == [{"reward_model": rm_id, "weight": 1.0}]
    # keep_rewards: the RM's score beside the env's own reward.
    kept = load_config(RlhfConfig, ROOT / "configs/rlhf-tiny.toml", ["rl.rm_rewards[0].keep_rewards=true"])
    assert kept.stage_overrides("rl", rm_checkpoint=rm_id)["algorithm.rl.envs[0].rewards"] == [
        {"function": "target_length", "kwargs": {"target": 12, "unit": "words"}},
        {"reward_model": rm_id, "weight": 1.0}]
    # The RM on its own base model: retraining SFT leaves it alone.
    own = load_config(RlhfConfig, ROOT / "configs/rlhf-tiny.toml", ['rm.start_from="base_model"'])
    assert "algorithm.rm.base_model" not in own.stage_overrides("rm", sft_checkpoint=sft_id)
    assert config.stage_run_name("rl", "0123456789abcdef" * 4) == "rlhf-tiny-rl-01234567"


def test_dry_run_plans_the_three_stages(tmp_path):
    planned = run_rollout(*CONFIG, "--dry-run", "--set", f"run.store={tmp_path / 'store'}")
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan = json.loads(planned.stdout)
    assert plan["entry_point"] == "rlhf" and list(plan["stages"]) == ["sft", "rm", "rl"]
    sft, rm, rl = plan["stages"]["sft"], plan["stages"]["rm"], plan["stages"]["rl"]
    assert re.fullmatch(r"rlhf-tiny-sft-[0-9a-f]{8}", sft["run"]) and sft["model"]["reference"] == "tiny:qwen2"
    assert rm["model"] == rl["model"] == {"reference": "<the sft stage's checkpoint>"}
    assert rl["envs"][0]["rewards"] == ["reward_model <the rm stage's checkpoint> (weight 1)"]
    assert not (tmp_path / "store").exists()  # nothing trained, nothing written


@pytest.fixture(scope="module")
def rlhf_reference(worker_stack, tmp_path_factory) -> dict:
    """The pipeline run every other one here is compared with: `rlhf/default` (configs/rlhf-tiny.toml) through the
    session's worker, in a store of its own; its result read back from the API as `rollout follow` reads it (the
    `<run>-result` artifact), in the shape `rollout train rlhf` prints. Its tests go with the worker stack's xdist
    group (conftest.SHARED_SERVERS): a module fixture is set up once per xdist worker."""
    from rollout_cli.follow import Api, run_result

    store = tmp_path_factory.mktemp("rlhf") / "store"
    flow_run = worker_stack.run("rlhf/default", timeout=600, overrides=[f"run.store={store}"])
    assert flow_run["state"]["type"] == "COMPLETED", flow_run["cli"]["output"][-3000:]
    result = run_result(Api(worker_stack.api_url), flow_run["id"])
    assert result is not None, f"no result artifact for flow run {flow_run['id']}"
    return {"store": store, "flow_run": flow_run, "flow_run_id": flow_run["id"], **result}


@pytest.mark.slow
def test_rl_starts_from_the_sft_checkpoint_and_is_rewarded_by_the_rm_checkpoint(rlhf_reference):
    store = ObjectStore(str(rlhf_reference["store"]))
    stages = rlhf_reference["stages"]
    sft, rm, rl = stages["sft"], stages["rm"], stages["rl"]
    assert rlhf_reference["checkpoint"] == rl["checkpoint"]

    # Each stage is a training of its own, named by its identity, whose ref points at its final checkpoint.
    for stage, result in stages.items():
        manifest = read_manifest(store, result["checkpoint"])
        assert re.fullmatch(rf"rlhf-tiny-{stage}-[0-9a-f]{{8}}", result["run"])
        assert result["run"].endswith(manifest["training_identity"][:8])
        assert store.get_ref(f"runs/{result['run']}/latest") == result["checkpoint"]
        assert set(task_run_states(result["flow_run_id"]).values()) == {"Completed"}
    assert set(task_run_states(rlhf_reference["flow_run_id"])) == {"train-sft-0", "train-rm-0", "train-rl-0"}

    # The RM starts from the SFT checkpoint (rm.start_from = "sft"), a causal LM given a score head.
    assert read_manifest(store, sft["checkpoint"])["kind_of_model"] == "causal_lm"
    assert read_manifest(store, rm["checkpoint"])["base_model"] == sft["checkpoint"]
    assert read_manifest(store, rm["checkpoint"])["kind_of_model"] == "reward_model"

    # RL starts from the SFT checkpoint by id, and scores with the RM checkpoint by id: its training identity is
    # that of rl-tiny with exactly these two, nothing else (the identity covers the reward models' contents).
    rl_manifest = read_manifest(store, rl["checkpoint"])
    assert rl_manifest["base_model"] == sft["checkpoint"] == rl["base_model"]
    assert rl["reward_models"] == {"algorithm.rl.envs[0].rewards[0].reward_model": rm["checkpoint"]}
    expected = validate_config(RlConfig, apply_overrides(read_toml(ROOT / "configs/rl-tiny.toml"), [
        f"run.store={rlhf_reference['store']}", f"algorithm.rl.base_model={sft['checkpoint']}",
        f'algorithm.rl.envs[0].rewards=[{{ reward_model = "{rm["checkpoint"]}" }}]']))
    assert rl_manifest["training_identity"] == training_identity(expected)
    table = metrics_table(rl["run"])
    assert table["reward_model/scored"] == [32] * RL_STEPS  # every rollout of every step scored by the RM

    # RL raises the RM's score (measured: -0.027 at step 1 -> 0.150 at step 20).
    curve = rlhf_reference["reward_curve"]
    assert len(curve) == RL_STEPS and sum(curve[-3:]) / 3 > sum(curve[:3]) / 3 + 0.05, curve


CHANGED_STEPS = 3


@pytest.mark.slow
def test_changing_an_rl_setting_reruns_only_the_rl_stage(rlhf_reference):
    # Another learning rate, and 3 RL steps of it: every one of them trained, not one from the first RL's cache.
    changed = rlhf(rlhf_reference["store"], "--set",
                   f'rl.overrides=["algorithm.rl.optimizer.lr=5e-3", "algorithm.rl.budget.max_steps={CHANGED_STEPS}"]')
    before, after = rlhf_reference["stages"], changed["stages"]
    for stage in ("sft", "rm"):
        assert (after[stage]["run"], after[stage]["checkpoint"]) == (before[stage]["run"], before[stage]["checkpoint"])
        states = task_run_states(after[stage]["flow_run_id"])
        assert states and set(states.values()) == {"Cached"}, (stage, states)
    # Another RL training: another identity, so another run name (the first one's ref is left as it was).
    assert after["rl"]["run"] != before["rl"]["run"] and after["rl"]["checkpoint"] != before["rl"]["checkpoint"]
    assert after["rl"]["base_model"] == before["sft"]["checkpoint"]
    store = ObjectStore(str(rlhf_reference["store"]))
    assert store.get_ref(f"runs/{before['rl']['run']}/latest") == before["rl"]["checkpoint"]
    states = task_run_states(after["rl"]["flow_run_id"])
    trained = ["init-policy", *[f"{stage}-step-{k}" for stage in RL_STAGES for k in range(1, CHANGED_STEPS + 1)]]
    assert {states[name] for name in trained} == {"Completed"}
    assert len(changed["reward_curve"]) == CHANGED_STEPS
    assert states["load-prompts-words"] == "Cached"  # the prompts table does not depend on the learning rate


@pytest.mark.slow
def test_a_pipeline_killed_mid_rm_then_mid_rl_reruns_to_the_uninterrupted_checkpoint(rlhf_reference, tmp_path):
    stages = rlhf_reference["stages"]
    args = [*CONFIG, "--set", f"run.store={tmp_path / 'store'}"]
    # SIGKILL once the RM has trained (and snapshotted) its first step, then once RL has trained step 8
    # (snapshot at 5).
    killed = run_until_then_kill(args, f"Flow run '{stages['rm']['run']}' - steps 1-1", tmp_path / "kill-rm.log")
    assert "train-step-1'" not in killed
    killed = run_until_then_kill(args, "train-step-8' - Finished", tmp_path / "kill-rl.log")
    assert "train-step-10'" not in killed

    rerun = run_rollout(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = final_result(rerun)
    assert resumed["checkpoint"] == rlhf_reference["checkpoint"]  # byte-identical final checkpoint
    assert resumed["reward_curve"] == rlhf_reference["reward_curve"]
    for stage in ("sft", "rm", "rl"):
        assert (resumed["stages"][stage]["run"], resumed["stages"][stage]["checkpoint"]) == \
            (stages[stage]["run"], stages[stage]["checkpoint"])
    for stage in ("sft", "rm"):
        assert set(task_run_states(resumed["stages"][stage]["flow_run_id"]).values()) == {"Cached"}
    states = task_run_states(resumed["stages"]["rl"]["flow_run_id"])
    for name in ["load-prompts-words", "init-policy", *[f"{s}-step-{k}" for s in RL_STAGES for k in range(1, 9)]]:
        assert states[name] == "Cached", (name, states[name])
    assert {states[f"{s}-step-{k}"] for s in RL_STAGES for k in range(9, RL_STEPS + 1)} == {"Completed"}


@pytest.mark.slow
def test_rlhf_default_deployment_runs_the_pipeline_through_the_worker(worker_stack, rlhf_reference):
    """The reference pipeline is the deployment's run: its three stages ran as subflows of the worker's flow run,
    and its final checkpoint is published in its store. (That the CLI trains the same pipeline to the same bytes:
    the killed pipeline's rerun above ends on this run's checkpoints, stage by stage.)"""
    flow_run = rlhf_reference["flow_run"]
    assert flow_run["cli"]["returncode"] == 0  # `--watch` exits 0 on Completed
    assert flow_run["parameters"]["config"] == "configs/rlhf-tiny.toml"  # the deployment's own parameters
    subflows = worker_stack.api("POST", "/flow_runs/filter", {"flow_runs": {"parent_task_run_id": {"any_": [
        task_run["id"] for task_run in worker_stack.task_runs(flow_run["id"])]}}})
    stages = rlhf_reference["stages"]
    assert sorted((run["id"], run["name"], run["state"]["type"]) for run in subflows) == sorted(
        (stages[stage]["flow_run_id"], stages[stage]["run"], "COMPLETED") for stage in ("sft", "rm", "rl"))
    final = stages["rl"]
    assert ObjectStore(str(rlhf_reference["store"])).get_ref(f"runs/{final['run']}/latest") == final["checkpoint"]
