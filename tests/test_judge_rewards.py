"""LLM judges in the reward loop: the built-in judge reward (template, verdict parser; a verdict that does not parse
is a missing reward carrying the judge's text) and user reward functions handed the judge client, against the
session's real vLLM replicas (tiny:qwen2, random weights: its verdicts never parse, which is the failure path)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from rollout_lib import wire
from rollout_lib.config import ConfigError, RlConfig, validate_config
from rollout_lib.config.loading import read_toml
from rollout_lib.reward.functions import RewardInput
from rollout_lib.reward.judge import parse_score, render
from rollout_lib.reward.results import AllRewardsFailedError
from rollout_lib.rl.score import env_reward_loop, run_reward_loops, score_rollouts
from rollout_lib.serving.served import ServedModels


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
    assert config.training_settings()["envs"][0]["rewards"][0]["judge"] == {"served_name": "judge"}  # no address
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

    sync = rl_config([{"function": "judged_rewards:sync_one", "judge": judge}])
    with ServedModels() as served_models, run_reward_loops(sync, served_models) as loops:
        with pytest.raises(ValueError, match=r"algorithm.rl.envs\[0\].rewards\[0\].function: 'judged_rewards:sync_one' "
                                             r"is sync; a reward function that calls a judge is async"):
            score_rollouts(sync, rollouts_table(), {"words": prompts_table()}, loops)
    assert json.dumps(sync.training_settings())  # the judge's identity is plain JSON


@pytest.mark.slow
def test_a_judge_replica_killed_mid_step_fails_over_without_stalling(vllm_tiny):
    """32 verdicts in flight on the two replicas; one replica is SIGKILLed: every rollout still gets the judge's
    answer (here a verdict that does not parse, so the error carries the judge's text), none a 'no replica' error,
    and the step ends in about the time the survivor needs, not a timeout."""
    import os
    import signal
    import threading
    import time

    from rollout_lib.reward.tables import reward_inputs
    from rollout_lib.serving.settings import ExternalModel

    vllm_tiny.ensure_running()
    judge = {"base_url": vllm_tiny.base_urls, "name": vllm_tiny.name, "timeout_s": 60.0}
    config = rl_config([{"judge": judge, "max_tokens": 64}])
    with ServedModels() as served_models, run_reward_loops(config, served_models) as loops:
        loop = env_reward_loop(loops, config, config.settings.envs[0])
        pool = served_models.pool(ExternalModel(**judge), where="test")
        outcome: dict = {}

        def score() -> None:
            started = time.monotonic()
            outcome["results"] = loop.score(reward_inputs(rollouts_table(32), prompts_table()))
            outcome["seconds"] = time.monotonic() - started

        worker = threading.Thread(target=score)
        try:
            worker.start()
            deadline = time.monotonic() + 60
            while not (sum(pool.outstanding.values()) >= 16 and pool.outstanding[pool.urls[0]] > 0):
                assert time.monotonic() < deadline and worker.is_alive(), "the verdicts never went out"
                time.sleep(0.05)
            os.killpg(vllm_tiny.pids[0], signal.SIGKILL)
            worker.join(timeout=120)
        finally:
            vllm_tiny.ensure_running()
    assert not worker.is_alive(), "the step stalled"
    results = outcome["results"]
    assert len(results) == 32 and all(r.reward is None for r in results)
    assert all("judge verdict does not parse" in r.error for r in results), {r.error for r in results}
    assert pool.failures[pool.urls[0]] >= 1 and outcome["seconds"] < 60
