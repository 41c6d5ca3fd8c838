"""A reward model served by vLLM's pooling runner (`engine = "vllm"`): the RM trained by `rollout train rm` inside the
test, served by rollout itself on two replicas, scores what the in-process scorer scores (same encoding, same
read-out, within float noise), keeps counting what inputs lost, survives a replica killed mid-step, and rewards a
`rollout train rl` run that reuses the running deployment.

One pooling deployment for the module (~30 s to start), stopped at its end."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from clirun import ROOT, final_result, run_rollout
from rollout_lib.config import ConfigError
from rollout_lib.config.loading import apply_overrides, read_toml, validate_config
from rollout_lib.config.rl import RlConfig
from rollout_lib.reward.settings import RewardModelSettings
from rollout_lib.reward.functions import RewardInput
from rollout_lib.reward.reward_model import load_scorer
from rollout_lib.serving import engine
from rollout_lib.serving.served import ServedModels
from rollout_lib.store import ObjectStore
from rollout_lib.checkpoint import read_manifest

pytestmark = pytest.mark.slow

RM_REF = "runs/rm-tiny/latest"
PAIRS = [json.loads(line) for line in (ROOT / "data/rm-tiny.jsonl").read_text().splitlines()]
ITEMS = [RewardInput([{"role": "user", "content": pair["prompt"]}], response)
         for pair in PAIRS for response in (pair["chosen"], pair["rejected"])]
LONG_PROMPT = RewardInput([{"role": "user", "content": "Tell me about the sea, at length. " * 6}], "The sea is wide.")
TOO_LONG = RewardInput([{"role": "user", "content": "Hi"}], "word " * 80)  # more than the RM's 64 tokens alone


def settings(store, **extra) -> RewardModelSettings:
    return RewardModelSettings(reward_model={"uri": RM_REF, "store": str(store)}, **extra)


async def score_all(scorer, items):
    return await asyncio.gather(*(scorer(item) for item in items), return_exceptions=True)


@pytest.fixture(scope="module")
def served_rm(prefect_server, tmp_path_factory):
    """(store, checkpoint id, ServedModels, served scorer) of configs/rm-tiny.toml trained through the CLI and
    served on 2 pooling replicas; the deployment is stopped at the module's end."""
    store = tmp_path_factory.mktemp("served-rm") / "store"
    done = run_rollout("train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={store}")
    assert done.returncode == 0, done.stderr[-3000:]
    served_models = ServedModels(str(store))
    try:
        scorer = load_scorer(settings(store, engine="vllm", replicas=2, batch_size=4), served_models, "test")
        yield store, final_result(done)["checkpoint"], served_models, scorer
    finally:
        served_models.close()  # it started the deployment: stops it


def test_served_scores_are_the_in_process_scores(served_rm):
    store, checkpoint, _, served = served_rm
    embedded = load_scorer(settings(store))
    items = [*ITEMS, LONG_PROMPT, TOO_LONG]
    expected, got = asyncio.run(score_all(embedded, items)), asyncio.run(score_all(served, items))

    assert served.pool.model == f"rm-{checkpoint[:60]}"  # named by the checkpoint, whatever ref named it
    assert len(served.pool.urls) == 2
    assert served.max_length == embedded.max_length == 64  # the max_seq_len train-rm recorded
    assert got[:-1] == pytest.approx(expected[:-1], abs=1e-5)
    assert len(set(got[:-1])) > 1  # real scores, not one constant
    assert isinstance(got[-1], ValueError) and "a response is never cut" in str(got[-1])
    served_counts, embedded_counts = served.take_counts(), embedded.take_counts()
    assert served_counts == embedded_counts
    assert served_counts["scored"] == 9 and served_counts["missing_too_long"] == 1


def test_served_scores_do_not_depend_on_the_batch(served_rm):
    """What resume-by-rerun needs of a served RM: a rescored step gets the same bits. True of this CPU build's fp32
    kernels (docs/rewards.md), not promised by vLLM: this test is where a change would show."""
    store, _, served_models, _ = served_rm
    alone = load_scorer(settings(store, engine="vllm", replicas=2, batch_size=1), served_models, "test")
    mixed = load_scorer(settings(store, engine="vllm", replicas=2, batch_size=3), served_models, "test")
    one_by_one = [asyncio.run(score_all(alone, [item]))[0] for item in ITEMS]
    assert asyncio.run(score_all(mixed, ITEMS[::-1]))[::-1] == one_by_one
    assert asyncio.run(score_all(alone, ITEMS)) == one_by_one


def test_counts_of_what_inputs_lost(served_rm):
    _, _, _, served = served_rm
    served.take_counts()
    asyncio.run(score_all(served, [LONG_PROMPT, TOO_LONG, ITEMS[0]]))
    counts = served.take_counts()
    assert counts["scored"] == 2 and counts["prompt_truncated"] == 1 and counts["missing_too_long"] == 1
    assert counts["prompt_tokens_dropped"] > 0


def test_a_replica_killed_mid_step_fails_over(served_rm):
    _, _, _, served = served_rm
    before = asyncio.run(score_all(served, ITEMS))
    deployment = engine.find_deployment(served.pool.model)
    victim = deployment.replicas[0]
    os.killpg(victim.pid, signal.SIGKILL)
    try:
        after = asyncio.run(score_all(served, ITEMS * 3))  # several batches: some go to the dead replica first
        assert after == pytest.approx(before * 3, abs=1e-5)
        assert served.pool.failures[victim.base_url.removesuffix("/v1")] >= 1
    finally:
        engine.restart_dead_replicas(deployment)


def test_a_reward_function_scores_with_the_served_reward_model_through_its_router(served_rm):
    """verl's DisRM shape: a function with a judge served by the pooling runner (`runner = "pooling"`, the running
    deployment reused) posts /classify to `reward_router_address`, token ids from `reward_model_tokenizer`; its
    scores are the served model's (the same request sent to the pool directly)."""
    from rollout_lib.reward.judge_tokenizer import judge_tokenizer
    from rollout_lib.reward.loops import RewardLoops

    store, checkpoint, served_models, served = served_rm
    raw = read_toml(ROOT / "configs/rl-tiny.toml")
    raw["run"]["store"] = str(store)
    raw["algorithm"]["rl"]["envs"][0]["rewards"] = [{"function": "example_genrm_rewards:compute_score_disrm",
                                                     "judge": {"model": checkpoint, "runner": "pooling"}}]
    config = validate_config(RlConfig, raw)
    items = [RewardInput(item.prompt, item.completion_text, answer="-", info={"question": item.prompt[0]["content"]})
             for item in ITEMS[:6]]
    with RewardLoops(config.settings.reward_loop, served_models) as loops:
        loop = loops.for_rewards(config.settings.envs[0].rewards, "algorithm.rl.envs[0].rewards")
        results = loop.score(items)
    tokenizer = judge_tokenizer(config.settings.envs[0].rewards[0].judge, served_models, "test")  # the function's
    assert [r.error for r in results] == [None] * 6
    expected = [asyncio.run(served.pool.classify([tokenizer(item.info["question"], item.completion_text)["input_ids"]]))[0]
                for item in items]
    assert [r.reward for r in results] == expected
    assert served_models.router(config.settings.envs[0].rewards[0].judge, where="test").pool.model == served.pool.model
    with pytest.raises(ConfigError, match=r"sampler\.source\.runner: 'pooling' serves a reward model"):
        raw["algorithm"]["rl"]["envs"][0]["sampler"] = {"source": {"model": checkpoint, "runner": "pooling"}}
        validate_config(RlConfig, raw)


def test_served_reward_model_settings(tmp_path):
    def config(rewards: str) -> RlConfig:
        overrides = [f"run.store={tmp_path}", f"algorithm.rl.envs[0].rewards={rewards}"]
        return validate_config(RlConfig, apply_overrides(read_toml(ROOT / "configs/rl-tiny.toml"), overrides))

    with pytest.raises(ConfigError, match=r"rewards\[0\]: .*replicas is the number of vLLM servers"):
        config('[{ reward_model = "runs/rm/latest", replicas = 2 }]')
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.engine: "):
        config('[{ reward_model = "runs/rm/latest", engine = "tgi" }]')
    embedded = config('[{ reward_model = "runs/rm/latest" }]')
    served = config('[{ reward_model = "runs/rm/latest", engine = "vllm" }]')
    two = config('[{ reward_model = "runs/rm/latest", engine = "vllm", replicas = 2 }]')
    assert served.served_reward_models() and not embedded.served_reward_models()
    # The engine decides the scores' last bits: part of the identity; the replica count is a resource.
    assert served.training_settings() != embedded.training_settings()
    assert served.training_settings() == two.training_settings()
    assert "engine" not in json.dumps(embedded.training_settings()["envs"][0]["rewards"])


def test_rl_rewarded_by_the_served_reward_model(served_rm, tmp_path):
    """`rollout train rl` with the RM on vLLM: the flow reuses the running deployment (started by the fixture,
    left running), and the step metrics carry the scorer's counts."""
    store, checkpoint, _, served = served_rm
    before = engine.find_deployment(served.pool.model)
    done = run_rollout("train", "rl", "--config", "configs/rl-tiny.toml",
                       "--set", f"run.store={store}", "--set", "run.name=rl-served-rm",
                       "--set", "algorithm.rl.budget.max_steps=2", "--set", "algorithm.rl.checkpoint_interval=2",
                       "--set", f'algorithm.rl.envs[0].rewards=[{{ reward_model = "{checkpoint}", engine = "vllm" }}]')
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reward model 'rm-" in done.stderr + done.stdout  # served before step 1 by connect-frozen-models
    after = engine.find_deployment(served.pool.model)
    assert after is not None and after.pids == before.pids  # reused as it was, and left running
    result = final_result(done)
    assert len(result["reward_curve"]) == 2 and all(isinstance(r, float) for r in result["reward_curve"])
    last_step = read_manifest(ObjectStore(str(store)), result["checkpoint"])["metrics"]
    assert last_step["step"] == 2 and last_step["reward_model/scored"] == 32  # 4 prompts x a group of 8
    assert last_step["missing_rewards"] == 0
