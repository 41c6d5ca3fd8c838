"""LLM judges in the reward loop: the built-in judge reward (template, verdict parser; a verdict that does not parse
is a missing reward carrying the judge's text), user reward functions handed the judge client (async, and sync in a
worker process through the judge's router), and seed 004's verl GenRM function through `reward_router_address` in an
RL run (against a judge of its own that admits the seed's 4096-token request) and across a replica's SIGKILL, against
real vLLM replicas (tiny:qwen2, random weights: its verdicts never parse, which is the failure path)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

from in_flight import vllm_requests_answered
from rollout_lib.identity.training import training_settings
from rollout_lib import wire
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.plan_checks import validate_config
from rollout_lib.config.loading import read_toml
from rollout_lib.reward.functions import RewardInput
from rollout_lib.reward.judge import parse_score, render
from rollout_lib.reward.results import AllRewardsFailedError
from rollout_lib.rl.score import env_reward_loop, run_reward_loops, score_rollouts
from rollout_lib.serving.served import ServedModels

ROOT = Path(__file__).resolve().parent.parent


def rl_config(rewards: list[dict], **reward_loop) -> RlConfig:
    raw = read_toml("configs/rl-tiny.toml")
    raw["algorithm"]["rl"]["envs"][0]["rewards"] = rewards
    raw["algorithm"]["rl"]["reward_loop"] = reward_loop
    return validate_config(RlConfig, raw)


def test_the_template_is_filled_once_and_never_interpreted():
    inp = RewardInput(prompt=[{"role": "system", "content": "sys"}, {"role": "user", "content": "Q {response}"}],
                      completion_text="A {prompt} {0.__class__}", answer="42")
    assert render("[{prompt}] [{response}] [{answer}] {other}", inp) == \
        "[Q {response}] [A {prompt} {0.__class__}] [42] {other}"


def test_a_verdict_is_parsed_scaled_or_refused_with_the_judges_text():
    pattern = r"Score:\s*(-?\d+(?:\.\d+)?)"
    assert parse_score("Good.\nScore: 7", pattern, 0, 10) == pytest.approx(0.7)
    assert parse_score("Score: 2 ... Score: 10", pattern, 0, 10) == 1.0  # the last verdict counts
    with pytest.raises(ValueError, match=r"judge verdict does not parse \(no match of .*\): 'I think it is fine'"):
        parse_score("I think it is fine", pattern, 0, 10)
    with pytest.raises(ValueError, match=r"judge score 11 is outside \[0, 10\]"):
        parse_score("Score: 11", pattern, 0, 10)


def test_judge_settings_are_checked():
    judge = {"base_url": ["http://127.0.0.1:9/v1"], "name": "judge"}
    config = rl_config([{"judge": judge, "weight": 0.5}])
    assert config.judges() == [("algorithm.rl.envs[0].rewards[0].judge", config.settings.envs[0].rewards[0].judge)]
    assert training_settings(config)["envs"][0]["rewards"][0]["judge"] == {"served_name": "judge"}  # no address
    for bad, message in [({"judge": judge, "pattern": "(unclosed"}, "pattern is not a regular expression"),
                         ({"judge": judge, "template": "no placeholder"}, "template has no {response}"),
                         ({"judge": judge, "score_range": [1, 1]}, "score_range must be [low, high]")]:
        with pytest.raises(ConfigError, match=r"algorithm.rl.envs\[0\].rewards\[0\]"):
            rl_config([bad])
        try:
            rl_config([bad])
        except ConfigError as exc:
            assert message in str(exc)


def rollouts_table(n: int = 4) -> pa.Table:
    return pa.Table.from_pylist([{
        "sample_id": f"e#{i}", "example_id": "e", "env": "words", "group_index": i, "prompt_ids": [1],
        "completion_ids": [2], "sampling_logprobs": [-0.1], "completion_text": f"the sea {i}", "answer": None,
        "info": None} for i in range(n)], schema=wire.ROLLOUTS)


def prompts_table() -> pa.Table:
    return pa.Table.from_pylist([{"example_id": "e", "env": "words", "source_line": 1, "answer": None, "info": None,
                                  "messages": [{"role": "user", "content": "Say something."}]}], schema=wire.PROMPTS)


@pytest.mark.slow
def test_a_verdict_that_does_not_parse_is_a_missing_reward_with_the_judges_text(vllm_tiny):
    vllm_tiny.ensure_running()
    judge = {"base_url": vllm_tiny.base_urls, "name": vllm_tiny.name}
    config = rl_config([{"judge": judge, "max_tokens": 8}])
    with ServedModels() as served_models, run_reward_loops(config, served_models) as loops:
        with pytest.raises(AllRewardsFailedError) as failure:
            score_rollouts(config, rollouts_table(), {"words": prompts_table()}, loops)
    message = str(failure.value)
    first_line = message.splitlines()[0]  # the top cause is on it: a failed run's one-line error shows it
    assert first_line.startswith("all 4 rewards failed; top cause (") and "judge verdict does not parse" in first_line
    assert message.splitlines()[1] == "most frequent errors:"
    assert "judge verdict does not parse (no match of " in message and "): '" in message  # the judge's own text


@pytest.mark.slow
def test_a_user_reward_function_gets_the_judge_client(vllm_tiny, tmp_path, monkeypatch):
    vllm_tiny.ensure_running()
    (tmp_path / "judged_rewards.py").write_text(
        "async def asks_the_judge(inp, *, judge, bonus=0.0):\n"
        "    verdict = await judge.chat([{'role': 'user', 'content': 'Rate: ' + inp.completion_text}], seed=1)\n"
        "    return min(1.0, len(verdict) / 100) + bonus\n"
        "def sync_one(inp, *, judge):\n"
        "    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    judge = {"base_url": vllm_tiny.base_urls, "name": vllm_tiny.name}
    config = rl_config([{"function": "judged_rewards:asks_the_judge", "judge": judge, "judge_max_tokens": 16,
                         "kwargs": {"bonus": 1.0}}])
    with ServedModels() as served_models, run_reward_loops(config, served_models) as loops:
        scored, metrics = score_rollouts(config, rollouts_table(), {"words": prompts_table()}, loops)
    rewards = scored.column("reward").to_pylist()
    assert metrics["missing_rewards"] == 0 and all(1.0 < r <= 2.0 for r in rewards), rewards  # the judge answered

    # A sync one runs in a worker process and asks through the judge's router (tests/example_genrm_rewards.py).
    sync = rl_config([{"function": "example_genrm_rewards:sync_judged", "judge": judge, "judge_max_tokens": 16,
                       "kwargs": {"bonus": 1.0}}])
    with ServedModels() as served_models, run_reward_loops(sync, served_models) as loops:
        scored, metrics = score_rollouts(sync, rollouts_table(), {"words": prompts_table()}, loops)
        sync_workers = env_reward_loop(loops, sync, sync.settings.envs[0]).sync_worker_pids()
    rewards = scored.column("reward").to_pylist()
    assert metrics["missing_rewards"] == 0 and all(1.0 < r <= 2.0 for r in rewards), rewards
    assert sync_workers and os.getpid() not in sync_workers
    assert json.dumps(training_settings(sync))  # the judge's identity is plain JSON


def score_while_a_replica_dies(vllm_tiny, loop, pool, inputs) -> tuple[list, float]:
    """`loop.score(inputs)` in a thread; once 16 calls are in flight with some on the first replica, that replica's
    group is SIGKILLed. Returns the results and the seconds scoring took; the replica is left dead (the next test's
    `vllm_tiny` restarts it)."""
    import signal
    import threading
    import time

    outcome: dict = {}

    def score() -> None:
        started = time.monotonic()
        outcome["results"] = loop.score(inputs)
        outcome["seconds"] = time.monotonic() - started

    worker = threading.Thread(target=score)
    worker.start()
    deadline = time.monotonic() + 60
    while not (sum(pool.outstanding.values()) >= 16 and pool.outstanding[pool.urls[0]] > 0):
        assert time.monotonic() < deadline and worker.is_alive(), "the calls never went out"
        time.sleep(0.05)
    os.killpg(vllm_tiny.pids[0], signal.SIGKILL)
    worker.join(timeout=120)
    assert not worker.is_alive(), "the step stalled"
    return outcome["results"], outcome["seconds"]


@pytest.mark.slow
def test_a_judge_replica_killed_mid_step_fails_over_for_the_judge_reward_and_through_the_router(vllm_tiny):
    """One step's rewards, two per rollout, both on the session's judge (one pool): the built-in judge reward, and
    the seed's compute_score_gsm8k (its copy asking for 16-token verdicts, which the session's judge admits) asking
    through the router. 64 calls in flight on the two replicas; one replica is SIGKILLed (one kill for both: a
    replica restart fewer for the suite than a kill for each). Every call is still answered: the judge reward's each
    a verdict that does not parse (a missing reward carrying the judge's text), none a 'no replica' error; the
    router's each a score, never a missing reward; and the step ends in about the time the survivor needs, not a
    timeout."""
    from rollout_lib.serving.settings import ExternalModel

    vllm_tiny.ensure_running()
    judge = {"base_url": vllm_tiny.base_urls, "name": vllm_tiny.name, "timeout_s": 60.0,
             "tokenizer": str(vllm_tiny.model_dir)}
    routed = "example_genrm_rewards:compute_score_gsm8k_short_verdict"
    config = rl_config([{"judge": judge, "max_tokens": 64}, {"function": routed, "judge": judge}])
    inputs = [RewardInput(prompt=[{"role": "user", "content": "What is 6 * 7?"}], completion_text=f"It is {i}.",
                          answer="42", info={"question": "What is 6 * 7?"}) for i in range(32)]
    with ServedModels() as served_models, run_reward_loops(config, served_models) as loops:
        loop = env_reward_loop(loops, config, config.settings.envs[0])
        pool = served_models.pool(ExternalModel(**judge), where="test")
        assert served_models.router(ExternalModel(**judge), where="test").pool is pool  # the router sends through it
        results, seconds = score_while_a_replica_dies(vllm_tiny, loop, pool, inputs)
    assert len(results) == 32
    judged, by_router = list(results[0].per_function)
    assert by_router.startswith("compute_score_gsm8k_short_verdict"), results[0].per_function
    assert all(r.reward is None and r.per_function[judged] is None for r in results)
    assert all("judge verdict does not parse" in r.error for r in results), {r.error for r in results}
    assert all(r.per_function[by_router] is not None for r in results), {r.error for r in results}
    assert all(by_router not in r.error for r in results), {r.error for r in results}  # the router's: no error
    assert pool.failures[pool.urls[0]] >= 1 and set(pool.outstanding.values()) == {0}
    assert seconds < 60
    print(f"64 judge calls, 32 of them through the router, one replica SIGKILLed: {seconds:.1f} s")


@pytest.fixture
def seed_sized_judge():
    """tiny:qwen2 served as a judge that admits the seed's request for up to 4096 tokens: max_model_len 4096 (past
    the model's 1024 positions, which vLLM allows with VLLM_ALLOW_LONG_MAX_MODEL_LEN), each answer capped at 16 tokens
    by the server's own setting (vLLM's --override-generation-config max_new_tokens), so no position past 1024 is
    ever computed and a verdict costs what the session judge's do. One replica, stopped at the test's end."""
    from rollout_lib.serving import engine

    name = "test-genrm-judge"
    try:
        yield engine.start_deployment("tiny:qwen2", name=name, max_model_len=4096,
                                      extra_args=["--override-generation-config", '{"max_new_tokens": 16}'],
                                      env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    finally:
        engine.stop_deployment(name)


@pytest.mark.slow
def test_the_seeds_genrm_compute_score_runs_unchanged_in_an_rl_run(seed_sized_judge, prefect_server, tmp_path):
    """Seed 004's GenRM example (`compute_score_gsm8k`: a prompt to the judge through `reward_router_address`, the
    last paragraph of the verdict as an int), as a user's file (tests/example_genrm_rewards.py, the seed's text: it
    asks for up to 4096 tokens), in `rollout train rl` for 2 steps of rl-tiny with a vLLM judge that admits that.
    The random judge's verdicts are no int, so every score is the function's own 0, never a missing reward; every
    rollout's verdict came from vLLM."""
    from clirun import final_result, run_rollout

    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.store import ObjectStore

    judge = seed_sized_judge
    prompts = tmp_path / "gsm8k.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a} * {b}?", "answer": str(a * b),
                                           "info": {"question": f"What is {a} * {b}?", "data_source": "gsm8k"}}) + "\n"
                               for a, b in [(6, 7), (3, 4), (5, 9), (8, 8)]))
    base_urls = ", ".join(json.dumps(url) for url in judge.base_urls)
    config = tmp_path / "rl-genrm.toml"
    config.write_text(f"""
[run]
name = "rl-genrm"
seed = 1
store = "{tmp_path / 'store'}"

[algorithm.rl]
base_model = "tiny:qwen2"
max_seq_len = 128

[algorithm.rl.optimizer]
kind = "adamw"
lr = 1.0e-2

[algorithm.rl.budget]
max_steps = 2

[[algorithm.rl.envs]]
name = "gsm8k"
source = {{ type = "jsonl_path", path = "{prompts}" }}
prompts_per_step = 2
sampling = {{ group_size = 4, temperature = 1.0, max_tokens = 16 }}
algo = {{ type = "grpo" }}

[[algorithm.rl.envs.rewards]]
function = "example_genrm_rewards:compute_score_gsm8k"
judge = {{ base_url = [{base_urls}], name = "{judge.name}", tokenizer = "{judge.model_dir}" }}
""")
    run = run_rollout("train", "rl", "--config", str(config), PYTHONPATH=str(ROOT / "tests"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert final_result(run)["reward_curve"] == [0.0, 0.0]
    steps = read_metrics(ObjectStore(str(tmp_path / "store")), "rl-genrm")
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:  # mean 0 and std 0 over the present rewards, and none missing: every one of them is 0
        assert (step["reward_mean"], step["reward_std"], step["missing_rewards"], step["reward_errors"]) == \
            (0.0, 0.0, 0, []), step
    # 2 steps x 2 prompts x 4 samples: every verdict asked through the router and answered by the judge, once
    assert vllm_requests_answered(judge.base_urls) == 16
