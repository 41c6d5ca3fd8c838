"""The reward loop: sync/async detection, weighted scoring, timeouts that really stop the work, failures as
missing rewards, the concurrency bound, built-ins, and the Arrow round trip."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import signal
import time

import pyarrow as pa
import pytest

import example_rewards
from rollout_lib import wire
from rollout_lib.reward import pool
from rollout_lib.reward.functions import RewardInput, resolve_reward_function
from rollout_lib.reward.loop import (
    AllRewardsFailedError,
    RewardLoop,
    RewardResult,
    apply_rewards,
    is_async_callable,
    raise_if_all_missing,
    reward_metrics,
    score_inputs_sync,
)
from rollout_lib.reward.tables import reward_inputs


def _item(text: str = "hello world", answer: str | None = None, **info) -> RewardInput:
    return RewardInput(prompt=[{"role": "user", "content": "q"}], completion_text=text, answer=answer, info=info)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pid_running(pid: int) -> bool:
    # A killed grandchild is reaped by init, not by us; in a container init may never reap, so a zombie
    # counts as stopped.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _async_one(inp: RewardInput) -> float:
    return 1.0


async def _async_scaled(inp: RewardInput, *, scale: float) -> float:
    return scale * len(inp.completion_text)


class _AsyncCallable:
    async def __call__(self, inp: RewardInput) -> dict:
        return {"score": 3.0}


class _Judge:
    async def score(self, inp: RewardInput) -> float:
        return 4.0


# --- detection -------------------------------------------------------------------------------------------------


def test_is_async_callable_sees_through_partials_methods_and_call():
    assert is_async_callable(_async_one)
    assert is_async_callable(functools.partial(_async_scaled, scale=2.0))
    assert is_async_callable(functools.partial(functools.partial(_async_scaled), scale=2.0))
    assert is_async_callable(_AsyncCallable())
    assert is_async_callable(_Judge().score)
    assert not is_async_callable(_AsyncCallable)  # the class: calling it constructs
    assert not is_async_callable(example_rewards.sleep_then_one)
    assert not is_async_callable(functools.partial(example_rewards.sleep_then_one))
    assert not is_async_callable(lambda inp: 1.0)


# --- scoring -----------------------------------------------------------------------------------------------------


def test_weighted_sum_of_sync_and_async_functions():
    functions = [
        (example_rewards.completion_length, 2.0),  # sync: runs in a worker process
        (functools.partial(_async_scaled, scale=0.5), 1.0),
        (_AsyncCallable(), -1.0),  # dict {"score": 3.0}
        (_Judge().score, 0.25),
        (example_rewards.worker_pid, 0.0),
    ]
    with RewardLoop(functions, concurrency=4, timeout_s=30) as loop:
        results = loop.score([_item("abcd"), _item("ab")])
    assert [r.reward for r in results] == [2 * 4 + 0.5 * 4 - 3 + 1, 2 * 2 + 0.5 * 2 - 3 + 1]
    assert results[0].error is None
    assert results[0].per_function["completion_length"] == 4.0
    assert results[0].per_function["_async_scaled"] == 2.0
    assert results[0].per_function["_AsyncCallable"] == 3.0
    assert results[0].per_function["worker_pid"] != os.getpid()  # sync work never runs in the caller


def test_hung_sync_function_is_killed_and_the_loop_goes_on():
    with RewardLoop([(example_rewards.sleep_then_one, 1.0)], concurrency=2, timeout_s=0.5, sync_workers=1) as loop:
        assert loop.score([_item(sleep_s=0)])[0].reward == 1.0  # starts the worker outside any timeout
        (hung_pid,) = loop.sync_worker_pids()
        start = time.monotonic()
        results = loop.score([_item(sleep_s=1000), _item(sleep_s=0), _item(sleep_s=0.01)])
        assert time.monotonic() - start < 20
        assert results[0].reward is None
        assert results[0].error == "TimeoutError: reward fn 'sleep_then_one' exceeded 0.5s"
        assert [r.reward for r in results[1:]] == [1.0, 1.0]  # scored by a fresh worker
        assert not _pid_exists(hung_pid)  # killed and reaped, not just abandoned
        assert loop.sync_worker_pids() and hung_pid not in loop.sync_worker_pids()
        worker_pids = loop.sync_worker_pids()
    assert not any(_pid_exists(pid) for pid in worker_pids)  # the context manager shut the pool down


@pytest.mark.parametrize("shell_prefix", [
    "",
    # Regression: the worker died of the group's SIGTERM and was reaped before the group's SIGKILL, which was
    # then skipped (a reaped pid may be reused), so a child ignoring SIGTERM outlived the timeout.
    "trap '' TERM; ",
], ids=["child", "child-ignoring-sigterm"])
def test_timeout_also_kills_what_the_sync_function_started(tmp_path, shell_prefix):
    pid_file = tmp_path / "pid"
    command = ["sh", "-c", f"{shell_prefix}echo $$ > {pid_file}; exec sleep 1000"]
    with RewardLoop([(example_rewards.command_succeeds, 1.0)], concurrency=1, timeout_s=1.0, sync_workers=1) as loop:
        (result,) = loop.score([_item(command=command)])
        assert result.error == "TimeoutError: reward fn 'command_succeeds' exceeded 1.0s"
        sleeper = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while _pid_running(sleeper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pid_running(sleeper)
        assert loop.score([_item(command=["true"])])[0].reward == 1.0  # and the loop goes on


def test_closing_the_loop_kills_what_functions_left_running(tmp_path):
    pid_file = tmp_path / "pid"
    command = ["sh", "-c", f"sleep 1000 & echo $! > {pid_file}"]  # exits 0 at once, sleep stays in the group
    with RewardLoop([(example_rewards.command_succeeds, 1.0)], concurrency=1, timeout_s=30, sync_workers=1) as loop:
        assert loop.score([_item(command=command)])[0].reward == 1.0
        sleeper = int(pid_file.read_text())
        assert _pid_running(sleeper)
    deadline = time.monotonic() + 5
    while _pid_running(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_running(sleeper)


def test_close_is_idempotent_and_a_closed_loop_refuses_to_score():
    loop = RewardLoop([(example_rewards.worker_pid, 1.0)], concurrency=1, timeout_s=30, sync_workers=1)
    with loop:
        loop.score([_item()])
        (pid,) = loop.sync_worker_pids()
    assert not _pid_exists(pid)
    loop.close()  # a no-op the second time
    with pytest.raises(RuntimeError, match="RewardLoop is closed"):
        loop.score([_item()])


def test_a_worker_that_died_while_idle_is_replaced():
    with RewardLoop([(example_rewards.sleep_then_one, 1.0)], concurrency=1, timeout_s=30, sync_workers=1) as loop:
        loop.score([_item(sleep_s=0)])
        (pid,) = loop.sync_worker_pids()
        os.kill(pid, signal.SIGKILL)  # OOM killer, say
        while _pid_running(pid):  # the kill lands asynchronously; a zombie (unreaped by us) counts as dead
            time.sleep(0.01)
        assert loop.score([_item(sleep_s=0)]) == [RewardResult(1.0, None, {"sleep_then_one": 1.0})]
        assert loop.sync_worker_pids() != [pid]


def test_a_call_sent_to_a_worker_that_just_died_goes_to_a_fresh_one_once(monkeypatch):
    # The race the "started" acknowledgement exists for: killed while idle, but its death not yet visible when
    # the call is sent. The call never began, so it is retried on a fresh worker (a crash mid-call is not).
    with RewardLoop([(example_rewards.sleep_then_one, 1.0)], concurrency=1, timeout_s=30, sync_workers=1) as loop:
        loop.score([_item(sleep_s=0)])
        (pid,) = loop.sync_worker_pids()
        os.kill(pid, signal.SIGKILL)
        while _pid_running(pid):
            time.sleep(0.01)
        looked_alive = []
        real_exited = pool._exited

        def not_noticed_yet(process) -> bool:
            if process.pid == pid and not looked_alive:
                looked_alive.append(pid)
                return False
            return real_exited(process)

        monkeypatch.setattr(pool, "_exited", not_noticed_yet)
        assert loop.score([_item(sleep_s=0)]) == [RewardResult(1.0, None, {"sleep_then_one": 1.0})]
        assert looked_alive == [pid]
        assert len(loop.sync_worker_pids()) == 1 and loop.sync_worker_pids() != [pid]


def test_hung_async_function_is_cancelled():
    cancelled = []

    async def hangs(inp: RewardInput) -> float:
        if inp.info.get("hang"):
            try:
                await asyncio.sleep(1000)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
        return 1.0

    start = time.monotonic()
    results = score_inputs_sync([_item(hang=True), _item()], [(hangs, 1.0)], concurrency=2, timeout_s=0.2)
    assert time.monotonic() - start < 5
    assert cancelled == [True]
    assert results[0] == RewardResult(
        None, "TimeoutError: reward fn 'test_hung_async_function_is_cancelled.<locals>.hangs' exceeded 0.2s",
        {"test_hung_async_function_is_cancelled.<locals>.hangs": None},
    )
    assert results[1].reward == 1.0


def test_exceptions_and_bad_values_become_missing_rewards_with_the_error():
    async def returns_nan(inp):
        return math.nan

    async def returns_text(inp):
        return "1.0"

    with RewardLoop([(example_rewards.always_fails, 1.0)], concurrency=2, timeout_s=30) as loop:
        (failed,) = loop.score([_item("abc")])
    assert failed.reward is None
    assert failed.error == "ValueError: reward fn 'always_fails': cannot score completion of length 3"

    results = score_inputs_sync([_item()], [(returns_nan, 1.0), (returns_text, 1.0)], concurrency=1, timeout_s=5)
    assert results[0].reward is None
    assert "ValueError: reward fn " in results[0].error and "not finite" in results[0].error
    assert "TypeError: reward fn " in results[0].error and "got str" in results[0].error


def test_a_crashing_worker_is_a_missing_reward_not_a_crashed_step():
    with RewardLoop(
        [(example_rewards.crash_worker, 1.0)], concurrency=1, timeout_s=30, sync_workers=1
    ) as loop:
        results = loop.score([_item(), _item()])
    assert [r.reward for r in results] == [None, None]
    assert all("RewardWorkerError" in r.error and "exit code 3" in r.error for r in results)


def test_concurrency_bound_is_respected():
    in_flight = 0
    peak = 0

    async def counts(inp: RewardInput) -> float:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return 1.0

    results = score_inputs_sync([_item() for _ in range(40)], [(counts, 1.0)], concurrency=4, timeout_s=5)
    assert all(r.reward == 1.0 for r in results)
    assert peak == 4


_longest_calls: list[list[str]] = []


async def longest(items: list[RewardInput]) -> list[float]:
    """A group function: 1 for the group's longest completion (the first on a tie), else 0."""
    _longest_calls.append([item.completion_text for item in items])
    lengths = [len(item.completion_text) for item in items]
    return [float(k == lengths.index(max(lengths))) for k in range(len(items))]


async def picky(items: list[RewardInput]) -> list[float]:
    """A group function that fails as its group's example id says."""
    how = items[0].example_id
    if how == "raises":
        raise RuntimeError("picky broke")
    if how == "slow":
        await asyncio.sleep(30)
    return {"short": [1.0] * (len(items) - 1), "nan": [1.0, math.nan][:len(items)]}.get(how, [0.0] * len(items))


longest.scores_group = picky.scores_group = True


def test_a_group_function_scores_each_group_whole_in_row_order_and_its_failure_fails_the_group():
    calls = _longest_calls

    def group(example_id, *texts, **state):
        return [RewardInput([], text, env="e", example_id=example_id, state=state) for text in texts]

    good = group("a", "x", "xyz", "xy")
    failed = group("f", "abc", "a") + group("f", "ab", episode_error="the env broke")
    failing = [item for how in ("raises", "slow", "short", "nan") for item in group(how, "p", "q")]
    with RewardLoop([(_async_one, 1.0), (longest, 2.0), (picky, 0.0)], concurrency=8, timeout_s=0.5) as loop:
        interleaved = [good[0], failed[0], *failing, good[1], failed[1], failed[2], good[2]]
        results = dict(zip(map(id, interleaved), loop.score(interleaved)))
        assert [results[id(item)].reward for item in good] == [1.0, 3.0, 1.0]
        assert results[id(good[1])].per_function == {"_async_one": 1.0, "longest": 1.0, "picky": 0.0}
        # a member whose episode failed is missing, and left out of what the group function sees
        assert [results[id(item)].reward for item in failed] == [3.0, 1.0, None]
        assert results[id(failed[2])].error == "episode failed: the env broke"
        assert sorted(calls) == [["abc", "a"], ["p", "q"], ["p", "q"], ["p", "q"], ["p", "q"], ["x", "xyz", "xy"]]
        errors = {item.example_id: results[id(item)].error for item in failing}
        assert all(results[id(item)].reward is None for item in failing)  # the whole group, never 0
        assert errors == {"raises": "RuntimeError: reward fn 'picky': picky broke",
                          "slow": "TimeoutError: reward fn 'picky' exceeded 0.5s",
                          "short": "ValueError: reward fn 'picky': returned 1 scores for a group of 2 rollouts",
                          "nan": "ValueError: reward fn 'picky': reward is not finite: nan"}

        async def handed_over_last_first():  # as a streamed step hands rollouts over: in the order they end
            scoring = loop.grouped(group_size=3)
            calls.clear()
            futures = {position: scoring.add(good[position], position) for position in (2, 1)}
            await asyncio.sleep(0.05)
            assert calls == []  # the group is not whole yet
            futures[0] = scoring.add(good[0], 0)
            return [await futures[position] for position in range(3)]

        assert asyncio.run(handed_over_last_first()) == [results[id(item)] for item in good]
        assert calls == [["x", "xyz", "xy"]]  # once, in row order


def test_non_picklable_sync_function_is_refused_up_front():
    with pytest.raises(TypeError, match="must be picklable"):
        RewardLoop([(lambda inp: 1.0, 1.0)], concurrency=1, timeout_s=1)


# --- step-level summaries ----------------------------------------------------------------------------------------


def test_metrics_and_all_missing():
    results = [RewardResult(1.0), RewardResult(3.0), RewardResult(None, "ValueError: x")]
    assert reward_metrics(results) == {"reward_mean": 2.0, "reward_std": 1.0, "n_missing": 1, "n_total": 3}
    raise_if_all_missing(results)  # some scored: fine
    raise_if_all_missing([])

    failed = [RewardResult(None, "ValueError: a"), RewardResult(None, "ValueError: a"), RewardResult(None, "E: b")]
    assert reward_metrics(failed)["reward_mean"] is None
    with pytest.raises(AllRewardsFailedError, match="all 3 rewards failed") as info:
        raise_if_all_missing(failed)
    assert info.value.errors == ["ValueError: a", "E: b"]


def test_arrow_round_trip():
    prompts = pa.table(
        {
            "example_id": ["e1"],
            "env": ["math"],
            "messages": [[{"role": "user", "content": "2+2?"}]],
            "answer": ["4"],
            "info": [json.dumps({"k": 1})],
            "source_line": [1],
        },
        schema=wire.PROMPTS,
    )
    rollouts = pa.table(
        {
            "sample_id": ["s1", "s2"],
            "example_id": ["e1", "e1"],
            "env": ["math", "math"],
            "group_index": [0, 1],
            "prompt_ids": [[1], [1]],
            "completion_ids": [[2], [3]],
            "sampling_logprobs": [[-0.1], [-0.2]],
            "completion_text": ["it is 4", "it is 5"],
            "answer": ["4", "4"],
            "info": [json.dumps({"k": 1}), None],
            "reward": [None, None],
            "reward_error": [None, None],
            "completion_turns": [None, None],
            "episode": [None, None],
            "sampled_from": [None, None],
            "token_policy_versions": [None, None],  # partial rollouts' columns: null for a whole sample
            "drawn_at_step": [None, None],
            "behaviour_logprobs": [None, None],
            "earlier_sequences": [None, None],  # an agent's split episode's: null for one sequence
        },
        schema=wire.ROLLOUTS,
    )
    inputs = reward_inputs(rollouts, prompts)
    assert inputs[0] == RewardInput([{"role": "user", "content": "2+2?"}], "it is 4", "4", {"k": 1}, "math",
                                    turns=[{"role": "assistant", "content": "it is 4"}], example_id="e1")
    assert inputs[1].info == {}
    scored = apply_rewards(rollouts, [RewardResult(1.0), RewardResult(None, "ValueError: x")])
    assert scored.schema == wire.ROLLOUTS
    assert scored.column("reward").to_pylist() == [1.0, None]
    assert scored.column("reward_error").to_pylist() == [None, "ValueError: x"]


# --- built-ins and resolution ------------------------------------------------------------------------------------


def test_builtin_rule_rewards():
    exact = resolve_reward_function("exact_match")
    assert exact(_item(" 42\n", answer="42")) == 1.0
    assert exact(_item("42.", answer="42")) == 0.0
    assert resolve_reward_function("contains_answer")(_item("so it is 42.", answer="42")) == 1.0

    number = resolve_reward_function("number_match")
    assert number(_item("3 + 4 = 7, then 1,234", answer="1234")) == 1.0
    assert number(_item("the answer is -0.5", answer="-.5")) == 1.0
    assert number(_item("7 then 8", answer="7")) == 0.0  # the last number counts
    assert number(_item("no idea", answer="7")) == 0.0
    with pytest.raises(ValueError, match="needs an answer"):
        number(_item("7"))

    length = resolve_reward_function("target_length", {"target": 4})
    assert length(_item("a b c d")) == 1.0
    assert length(_item("a b")) == 0.5
    assert length(_item(" ".join("x" * 20))) == 0.0  # clipped


def test_builtin_missing_answer_is_a_missing_reward_in_the_loop():
    results = score_inputs_sync(
        [_item("7")], [(resolve_reward_function("exact_match"), 1.0)], concurrency=1, timeout_s=30
    )
    assert results[0].reward is None
    assert results[0].error == (
        "ValueError: reward fn 'exact_match': exact_match needs an answer, but the example has none"
    )


def test_resolution_by_import_path_and_errors():
    assert resolve_reward_function("example_rewards:completion_length") is example_rewards.completion_length
    with pytest.raises(ValueError, match=r"available: \['contains_answer', 'env_score', 'exact_match', 'number_match'"):
        resolve_reward_function("exact")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_reward_function("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute"):
        resolve_reward_function("example_rewards:nope")
    with pytest.raises(ValueError, match="bad kwargs"):
        resolve_reward_function("target_length", {"targte": 3})


def test_reasoning_gym_scores_right_and_wrong_answers():
    import reasoning_gym

    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=0)[0]
    info = {"rg_dataset": "basic_arithmetic", "rg_entry": json.loads(json.dumps(entry))}  # as stored on the wire
    score = resolve_reward_function("reasoning_gym")
    right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
    assert score(_item(f"thinking... <answer>{right}</answer>", **info)) == 1.0
    assert score(_item(right, **info)) == 1.0  # no tags: the whole completion is the answer
    assert score(_item(f"<answer>{wrong}</answer>", **info)) == 0.0
    assert resolve_reward_function("reasoning_gym", {"require_tags": True})(_item(right, **info)) == 0.0
    with pytest.raises(ValueError, match="rg_dataset"):
        score(_item(right))


def test_cancelling_the_step_kills_a_busy_worker():
    async def give_up_early(loop: RewardLoop) -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(loop.ascore([_item(sleep_s=1000)]), 0.3)

    with RewardLoop([(example_rewards.sleep_then_one, 1.0)], concurrency=1, timeout_s=100, sync_workers=1) as loop:
        loop.score([_item(sleep_s=0)])
        (busy_pid,) = loop.sync_worker_pids()
        asyncio.run(give_up_early(loop))
        assert not _pid_exists(busy_pid)  # the abandoned call's worker does not linger
        assert loop.score([_item(sleep_s=0)])[0].reward == 1.0
