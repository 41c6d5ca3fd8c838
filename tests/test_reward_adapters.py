"""verl-style reward functions through the adapter (a verl user's reward file, unchanged, in worker processes and
on the event loop, and through the score stage), and the circuit breaker on a step's share of missing rewards."""

from __future__ import annotations

import json
import pickle
import sys

import pyarrow as pa
import pytest

from rollout_lib import wire
from rollout_lib.config import RlConfig
from rollout_lib.plan_checks import validate_config
from rollout_lib.errors import ConfigError
from rollout_lib.reward.functions import RewardInput, check_reward_function, resolve_reward_function
from rollout_lib.reward.loop import RewardLoop, RewardResult, is_async_callable
from rollout_lib.reward.results import (
    AllRewardsFailedError,
    TooManyRewardsMissingError,
    raise_if_too_many_missing,
)
from rollout_lib.reward.verl import AsyncVerlRewardFunction, VerlRewardFunction, is_verl_style
from rollout_lib.rl.score import (
    results_from_json,
    results_json,
    reward_results,
    run_reward_loops,
    score_rollouts,
)

# A reward file as a verl user writes it (after verl's utils/reward_score/gsm8k.py): nothing here knows rollout.
VERL_REWARD_FILE = '''
import asyncio
import re


def extract_solution(solution_str):
    matches = re.findall(r"#### (\\-?[0-9\\.\\,]+)", solution_str)
    return matches[-1].replace(",", "") if matches else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0, score=1.0):
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return score if float(answer) == float(ground_truth) else format_score


def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    answer = extract_solution(solution_str)
    return {"score": 1.0 if answer == ground_truth else 0.0, "acc": answer == ground_truth, "pred": answer}


async def compute_score_async(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    await asyncio.sleep(0.01)  # the shape of a call to a sandbox or a judge
    return {"score": float(extract_solution(solution_str) == ground_truth)}


def arguments(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    extra_info["seen"] = True  # verl's own reward managers write into extra_info
    return {"score": True, "called_with": [data_source, solution_str, ground_truth, extra_info, kwargs]}


def no_extra_info(data_source, solution_str, ground_truth):
    return 0.5


def bare_compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    # verl/utils/reward_score/gsm8k.py's shape: no data_source, no extra_info
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return score if float(answer) == float(ground_truth) else format_score


def two_texts(completion, answer):
    return float(completion == answer)


def needs_a_tokenizer(solution_str, ground_truth, tokenizer):
    return 0.0
'''


@pytest.fixture
def verl_rewards(tmp_path, monkeypatch):
    """The module `verl_gsm8k` (VERL_REWARD_FILE) importable here and in the sync workers (they inherit sys.path)."""
    (tmp_path / "verl_gsm8k.py").write_text(VERL_REWARD_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("verl_gsm8k", None)


def _item(text: str, answer: str | None = "42", env: str = "gsm8k", **info) -> RewardInput:
    return RewardInput(prompt=[{"role": "user", "content": "q"}], completion_text=text, answer=answer, info=info,
                       env=env)


# --- the adapter -------------------------------------------------------------------------------------------------


def test_a_verl_reward_file_runs_unchanged_in_worker_processes(verl_rewards):
    compute_score = resolve_reward_function("verl_gsm8k:compute_score", {"format_score": 0.1})
    assert isinstance(compute_score, VerlRewardFunction) and not is_async_callable(compute_score)
    pickle.dumps(compute_score)  # sync: it must travel to the workers
    completions = ["6 * 7 = 42\n#### 42", "#### 41", "I think it is 42", "#### 1,234"]
    items = [_item(text) for text in completions[:3]] + [_item(completions[3], answer="1234")]
    with RewardLoop([(compute_score, 1.0)], concurrency=4, timeout_s=30, sync_workers=1) as loop:
        results = loop.score(items)
        assert loop.sync_worker_pids()  # it ran in a worker process
    assert [r.reward for r in results] == [1.0, 0.1, 0.0, 1.0]  # right, wrong (format_score), no "####", right
    assert results[0].per_function == {"compute_score": 1.0}  # named after the user's function, not the adapter


def test_dict_returns_and_async_verl_functions(verl_rewards):
    as_dict = resolve_reward_function("verl_gsm8k:compute_score_dict")
    as_async = resolve_reward_function("verl_gsm8k:compute_score_async")
    assert isinstance(as_async, AsyncVerlRewardFunction) and is_async_callable(as_async)
    with RewardLoop([(as_dict, 1.0), (as_async, 2.0)], concurrency=4, timeout_s=30, sync_workers=1) as loop:
        results = loop.score([_item("#### 42"), _item("#### 7")])
    assert [r.reward for r in results] == [3.0, 0.0]
    assert results[0].per_function == {"compute_score_dict": 1.0, "compute_score_async": 1.0}
    # The dict's other numbers travel with the result, named by function ("pred", a string, is the function's own).
    assert [r.extra for r in results] == [{"compute_score_dict/acc": 1.0}, {"compute_score_dict/acc": 0.0}]


def test_a_reward_dicts_other_numbers_reach_the_steps_metrics(tmp_path, verl_rewards):
    """verl logs a reward dict's extra keys (reward_extra_info); here their means are the step's
    `reward/<function>/<key>`, over the rollouts whose dict carried them, and survive the store's JSON."""
    cfg = _config(tmp_path, {"gsm8k": "verl_gsm8k:compute_score_dict"})
    rollouts, prompts = _tables([("gsm8k", "#### 42", "42"), ("gsm8k", "#### 41", "42"), ("gsm8k", "#### 42", "42"),
                                 ("gsm8k", "#### 42", "forty-two")])
    with run_reward_loops(cfg) as loops:
        results, counts = reward_results(cfg, rollouts, prompts, loops)
        scored, metrics = score_rollouts(cfg, rollouts, prompts, loops)
    assert scored.column("reward").to_pylist() == [1.0, 0.0, 1.0, 0.0]
    assert metrics["reward/compute_score_dict/acc"] == 0.5  # 2 of 4 right
    assert results_from_json(results_json(results)) == results


def test_what_the_verl_function_is_called_with(verl_rewards):
    arguments = resolve_reward_function("verl_gsm8k:arguments", {"strict": True})
    info = {"split": "test"}
    called = arguments(_item("#### 42", answer="42", env="math", **info))
    assert called["score"] == 1.0  # a bool, as verl reads it (float(True))
    assert called["called_with"] == ["math", "#### 42", "42", {"split": "test", "seen": True}, {"strict": True}]
    assert info == {"split": "test"}  # extra_info is a copy: the row's info is not written into
    # data_source and ground_truth from info when the row has them / has no answer
    called = arguments(_item("x", answer=None, data_source="openai/gsm8k", ground_truth="7"))
    assert called["called_with"][:3] == ["openai/gsm8k", "x", "7"]
    # A function without extra_info gets none.
    assert resolve_reward_function("verl_gsm8k:no_extra_info")(_item("x")) == 0.5
    # No ground truth at all is a missing reward, never a comparison with None.
    with pytest.raises(ValueError, match="needs a ground truth: the row has no answer and its info no 'ground_truth'"):
        arguments(_item("x", answer=None))


def test_only_verl_signatures_are_adapted(verl_rewards):
    import example_rewards

    assert resolve_reward_function("example_rewards:completion_length") is example_rewards.completion_length
    assert not is_verl_style(lambda solution_str, data_source, ground_truth: 1.0)  # order matters
    assert not is_verl_style(lambda inp: 1.0)
    assert is_verl_style(lambda data_source, solution_str, ground_truth, *rest: 1.0)


def test_a_bare_verl_scorer_is_adapted_by_parameter_name(verl_rewards):
    check_reward_function("verl_gsm8k:bare_compute_score", {"format_score": 0.1})  # plan time: passes
    assert "verl_gsm8k" not in sys.modules
    bare = resolve_reward_function("verl_gsm8k:bare_compute_score", {"format_score": 0.1})
    assert isinstance(bare, VerlRewardFunction) and bare.taken == {"solution_str", "ground_truth"}
    with RewardLoop([(bare, 1.0)], concurrency=2, timeout_s=30, sync_workers=1) as loop:
        results = loop.score([_item("#### 42"), _item("#### 41"), _item("#### 7", answer=None, ground_truth="7")])
    assert [r.reward for r in results] == [1.0, 0.1, 1.0] and results[0].error is None


@pytest.mark.parametrize("function, signature", [
    ("two_texts", "two_texts(completion, answer) cannot be called as a reward (missing a required argument: "
                  "'answer')"),
    ("needs_a_tokenizer", "needs_a_tokenizer(solution_str, ground_truth, tokenizer) cannot be called as a reward "
                          "(missing a required argument: 'tokenizer')"),
])
def test_a_function_that_cannot_be_bound_is_refused_at_plan_time_naming_the_wrapper_to_write(verl_rewards, function,
                                                                                             signature):
    expected = (f"reward function 'verl_gsm8k:{function}': {signature}: a reward function takes one RewardInput, "
                f"`def {function}(inp)`, or is verl's `compute_score(data_source, solution_str, ground_truth, "
                "extra_info=None)` or bare `compute_score(solution_str, ground_truth)`; else write a wrapper, e.g. "
                f"`def reward(inp): return {function}(inp.completion_text, inp.answer)`")
    with pytest.raises(ValueError) as at_plan_time:
        check_reward_function(f"verl_gsm8k:{function}")
    assert str(at_plan_time.value) == expected
    assert "verl_gsm8k" not in sys.modules  # found by reading its source, never imported
    with pytest.raises(ValueError) as at_resolution:  # a reference plan time cannot read is refused when imported
        resolve_reward_function(f"verl_gsm8k:{function}")
    assert str(at_resolution.value) == expected
    check_reward_function("verl_gsm8k:needs_a_tokenizer", {"tokenizer": "t"})  # bound by its kwargs: fine


def test_a_dry_run_refuses_an_unbindable_reward_function_in_one_line(verl_rewards):
    from clirun import run_rollout

    def dry_run(function: str):
        return run_rollout("train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run",
                           "--set", f'algorithm.rl.envs[0].rewards[0].function="verl_gsm8k:{function}"',
                           "--set", "algorithm.rl.envs[0].rewards[0].kwargs={}", PYTHONPATH=str(verl_rewards))

    refused = dry_run("two_texts")
    assert (refused.returncode, refused.stdout) == (2, ""), refused.stderr[-2000:]
    assert refused.stderr.startswith(
        "rollout: error: configs/rl-tiny.toml: algorithm.rl.envs[0].rewards[0].function: reward function "
        "'verl_gsm8k:two_texts': two_texts(completion, answer) cannot be called as a reward") and len(
        refused.stderr.splitlines()) == 1, refused.stderr
    passed = dry_run("bare_compute_score")
    assert passed.returncode == 0, passed.stderr[-2000:]


def test_kwargs_the_adapter_fills_are_refused_at_plan_time_and_at_resolution(verl_rewards):
    check_reward_function("verl_gsm8k:compute_score", {"format_score": 0.1})
    check_reward_function("verl_gsm8k:compute_score_dict", {"anything": 1})  # **kwargs
    assert "verl_gsm8k" not in sys.modules  # plan time never imports the user's module
    refused = r"kwargs \['ground_truth'\] are filled from each rollout for a verl-style compute_score"
    with pytest.raises(ValueError, match=r"^reward function 'verl_gsm8k:compute_score_dict': " + refused):
        check_reward_function("verl_gsm8k:compute_score_dict", {"ground_truth": "1"})
    with pytest.raises(ValueError, match="takes no parameter 'format_scor'"):
        check_reward_function("verl_gsm8k:compute_score", {"format_scor": 0.1})
    with pytest.raises(ValueError, match=r"^reward function 'verl_gsm8k:compute_score_dict': " + refused):
        resolve_reward_function("verl_gsm8k:compute_score_dict", {"ground_truth": "1"})
    with pytest.raises(ValueError, match="bad kwargs"):
        resolve_reward_function("verl_gsm8k:compute_score", {"format_scor": 0.1})


# --- the score stage: the adapter, and the circuit breaker ------------------------------------------------------


def _config(tmp_path, envs: dict[str, str], **reward_loop) -> RlConfig:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "unused here"}) + "\n")
    return validate_config(RlConfig, {
        "run": {"name": "adapters", "store": "memory://unused"},
        "algorithm": {"rl": {
            "base_model": "tiny:qwen2", "optimizer": {"lr": 1e-3}, "budget": {"max_steps": 1},
            "reward_loop": {"timeout_s": 30, "sync_workers": 1, **reward_loop},
            "envs": [{"name": name, "source": {"type": "jsonl_path", "path": str(prompts)}, "prompts_per_step": 1,
                      "rewards": [{"function": function}]} for name, function in envs.items()],
        }},
    })


def _tables(rows: list[tuple[str, str, str | None]]) -> tuple[pa.Table, dict[str, pa.Table]]:
    """A ROLLOUTS table of (env, completion_text, answer) rows, one example each, and PROMPTS tables per env."""
    rollouts, prompts = [], {}
    for i, (env, completion, answer) in enumerate(rows):
        rollouts.append({"sample_id": f"s{i}", "example_id": f"e{i}", "env": env, "group_index": 0, "prompt_ids": [1],
                         "completion_ids": [2], "sampling_logprobs": [-0.5], "completion_text": completion,
                         "answer": answer, "info": None, "reward": None, "reward_error": None,
                         "completion_turns": None, "episode": None})
        prompts.setdefault(env, []).append({"example_id": f"e{i}", "env": env, "answer": answer, "info": None,
                                            "messages": [{"role": "user", "content": "What is 6 * 7?"}],
                                            "source_line": i + 1})
    return (pa.Table.from_pylist(rollouts, schema=wire.ROLLOUTS),
            {env: pa.Table.from_pylist(table, schema=wire.PROMPTS) for env, table in prompts.items()})


NO_GROUND_TRUTH = ("ValueError: reward fn 'compute_score': a verl-style compute_score needs a ground truth: the row "
                   "has no answer and its info no 'ground_truth'")
NOT_A_NUMBER = "ValueError: reward fn 'compute_score': could not convert string to float: 'forty-two'"
# 3 of 4 missing: two rows without a ground truth, one whose ground truth the function cannot read.
MOSTLY_MISSING = [("gsm8k", "#### 42", "42"), ("gsm8k", "#### 1", None), ("gsm8k", "#### 2", None),
                  ("gsm8k", "#### 42", "forty-two")]


def test_score_stage_runs_a_verl_function(tmp_path, verl_rewards):
    cfg = _config(tmp_path, {"gsm8k": "verl_gsm8k:compute_score"})
    rollouts, prompts = _tables([("gsm8k", "#### 42", "42"), ("gsm8k", "#### 41", "42"), ("gsm8k", "#### 2", None)])
    with run_reward_loops(cfg) as loops:
        scored, metrics = score_rollouts(cfg, rollouts, prompts, loops)
    assert scored.column("reward").to_pylist() == [1.0, 0.0, None]  # 1 of 3 missing: under the default 0.5
    assert scored.column("reward_error").to_pylist() == [None, None, NO_GROUND_TRUTH]
    assert metrics["missing_rewards"] == 1 and metrics["reward_mean"] == 0.5


def test_the_breaker_fails_a_step_with_most_rewards_missing(tmp_path, verl_rewards):
    cfg = _config(tmp_path, {"gsm8k": "verl_gsm8k:compute_score"})
    assert cfg.settings.reward_loop.max_missing_fraction == 0.5
    rollouts, prompts = _tables(MOSTLY_MISSING)
    with run_reward_loops(cfg) as loops, pytest.raises(TooManyRewardsMissingError) as failed:
        score_rollouts(cfg, rollouts, prompts, loops)
    assert str(failed.value) == (
        "3 of 4 rewards missing (75%), more than algorithm.rl.reward_loop.max_missing_fraction = 0.5 allows; "
        f"top cause (2x): {NO_GROUND_TRUTH}\nmost frequent errors:\n  2x {NO_GROUND_TRUTH}\n  1x {NOT_A_NUMBER}")
    assert failed.value.error_counts == [(NO_GROUND_TRUTH, 2), (NOT_A_NUMBER, 1)]

    # max_missing_fraction = 1.0: the step trains on the one reward it has.
    cfg = _config(tmp_path, {"gsm8k": "verl_gsm8k:compute_score"}, max_missing_fraction=1.0)
    with run_reward_loops(cfg) as loops:
        scored, metrics = score_rollouts(cfg, rollouts, prompts, loops)
    assert scored.column("reward").to_pylist() == [1.0, None, None, None]
    assert metrics["missing_rewards"] == 3


def test_the_breaker_names_each_envs_share(tmp_path, verl_rewards):
    cfg = _config(tmp_path, {"gsm8k": "verl_gsm8k:compute_score", "words": "target_length"})
    rollouts, prompts = _tables([*MOSTLY_MISSING, ("words", "a few words", None)])
    with run_reward_loops(cfg) as loops, pytest.raises(TooManyRewardsMissingError) as failed:
        score_rollouts(cfg, rollouts, prompts, loops)
    assert str(failed.value).startswith(
        "3 of 5 rewards missing (60%), more than algorithm.rl.reward_loop.max_missing_fraction = 0.5 allows "
        f"(by env: gsm8k 3 of 4, words 0 of 1); top cause (2x): {NO_GROUND_TRUTH}\nmost frequent errors:\n  2x ")


def test_an_all_missing_step_fails_whatever_the_allowed_share(tmp_path, verl_rewards):
    cfg = _config(tmp_path, {"gsm8k": "verl_gsm8k:compute_score"}, max_missing_fraction=1.0)
    rollouts, prompts = _tables([("gsm8k", "#### 1", None), ("gsm8k", "#### 42", "forty-two")])
    with run_reward_loops(cfg) as loops, pytest.raises(AllRewardsFailedError) as failed:
        score_rollouts(cfg, rollouts, prompts, loops)
    assert str(failed.value) == (f"all 2 rewards failed; top cause (1x): {NO_GROUND_TRUTH}\nmost frequent errors:\n"
                                 f"  1x {NO_GROUND_TRUTH}\n  1x {NOT_A_NUMBER}")
    assert isinstance(failed.value, TooManyRewardsMissingError)  # one `except` catches both


def test_breaker_bounds(tmp_path):
    two_of_four = [RewardResult(1.0), RewardResult(0.0), RewardResult(None, "E: a"), RewardResult(None, "E: b")]
    raise_if_too_many_missing(two_of_four, 0.5, setting="limit")  # exactly the share allowed: fine
    raise_if_too_many_missing([], 0.0, setting="limit")
    with pytest.raises(TooManyRewardsMissingError, match=r"^2 of 4 rewards missing \(50%\), more than limit = 0.25 "):
        raise_if_too_many_missing(two_of_four, 0.25, setting="limit")
    raise_if_too_many_missing([RewardResult(None, "E: a")] * 3, 1.0, setting="limit")  # all-missing is not its job
    with pytest.raises(ConfigError, match=r"algorithm\.rl\.reward_loop\.max_missing_fraction"):
        _config(tmp_path, {"words": "target_length"}, max_missing_fraction=1.5)
