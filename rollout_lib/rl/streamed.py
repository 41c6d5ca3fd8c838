"""The agent reward loop (seed 004): a step's rollouts scored as they are sampled, not after the last one.

A streamed step's sample stage hands each rollout to StreamedScoring the moment its sampler has it final (a
request back from the engine, a batch of the embedded sampler, an episode that ended: sampling.base.RolloutRows),
and StreamedScoring starts its reward at once, on an event loop in a thread of its own, while the caller's thread
samples on; a group reward function (a verifiers rubric's) runs when its group's last member is in, over the
members in row order (reward/loop.py, GroupedScoring). Every reward depends on its own row (and a group function's
on its group) alone, so the results, put in row order, are the ones the staged score stage gives (rl/score.py) and
the scored table, its id and the step's checkpoint are the same either way; only the time differs (docs/rewards.md,
"Scoring while sampling").

Off-policy, the same hand-over feeds the behaviour logprobs' forwards (rl/behaviour_stream.py), which then run
while the step samples instead of at its advantages stage.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa

from rollout_lib.config.rl import RlConfig
from rollout_lib.reward.loop import GroupedScoring, RewardResult
from rollout_lib.reward.loops import RewardLoops
from rollout_lib.reward.tables import prompt_messages, reward_input
from rollout_lib.rl.behaviour_stream import BehaviourStream, overlaps_behaviour_logprobs
from rollout_lib.rl.sample import sample_rollouts
from rollout_lib.rl.score import env_reward_loop
from rollout_lib.sampling.base import OnRollout


@dataclass(frozen=True)
class StreamedStep:
    """What a streamed sample stage found: sample_rollouts' table and metrics, each row's reward in row order, the
    reward models' counts (as rl.score.reward_results gives them) and when the last rollout and last reward
    came (perf_counter seconds); off-policy, the behaviour logprobs computed meanwhile (wire.BEHAVIOUR_LOGPROBS;
    None when none were) and their metrics."""

    rollouts: pa.Table
    sample_metrics: dict
    results: list[RewardResult]
    reward_model_metrics: dict[str, int]
    sampled_at: float
    scored_at: float
    behaviour: pa.Table | None = None
    behaviour_metrics: dict = field(default_factory=dict)


def sample_and_score(config: RlConfig, samplers: dict, prompt_tables: dict[str, pa.Table], step: int,
                     loops: RewardLoops, curriculum_state: dict | None = None, policy_model=None,
                     policy_state: str | None = None, replacements: dict[str, pa.Table] | None = None,
                     round_index: int = 0) -> StreamedStep:
    """sample_rollouts with every rollout scored as soon as it is sampled. `policy_model`: the sampling state's
    model (`policy_state`), whose behaviour logprobs of the rollouts are computed as they come in when the run
    recomputes them off-policy (rl/behaviour_stream.py). `replacements`, `round_index`: a dynamic-sampling
    round's prompts (sample_rollouts)."""
    behaviour = BehaviourStream(config, policy_model, policy_state) \
        if policy_model is not None and overlaps_behaviour_logprobs(config) else None
    with StreamedScoring(config, loops) as scoring, behaviour or contextlib.nullcontext():
        listeners = [scoring.stream_to] + ([behaviour.stream_to] if behaviour is not None else [])
        rollouts, metrics = sample_rollouts(config, samplers, prompt_tables, step, curriculum_state,
                                            stream_to=_handed_to(listeners), replacements=replacements,
                                            round_index=round_index)
        sampled_at = time.perf_counter()
        results, reward_model_metrics = scoring.results(rollouts, prompt_tables)
        scored_at = time.perf_counter()
        precomputed, behaviour_metrics = behaviour.results() if behaviour is not None else (None, {})
    return StreamedStep(rollouts, metrics, results, reward_model_metrics, sampled_at, scored_at, precomputed,
                        behaviour_metrics)


def _handed_to(listeners: list[Callable[[str, pa.Table], OnRollout | None]]) -> Callable[[str, pa.Table], OnRollout]:
    """One `stream_to` that hands each rollout to every listener's callback (a listener may take none of an env's)."""

    def stream_to(env_name: str, prompts: pa.Table) -> OnRollout:
        callbacks = [callback for listen in listeners if (callback := listen(env_name, prompts)) is not None]

        def on_rollout(index: int, record: dict) -> None:
            for callback in callbacks:
                callback(index, record)

        return on_rollout

    return stream_to


class StreamedScoring:
    """Scores rollouts as they are handed over (`stream_to`), each env with its own reward loop and its own bound
    of `reward_loop.concurrency` calls in flight, as the staged stage's. Leaving the `with` block before
    `results` (sampling failed) cancels the rewards in flight; the thread always ends there.

    The sampler's thread only queues each record and, when the scoring thread has none waiting, wakes it: the
    record's RewardInput is built and its reward started on the scoring thread, so the hand-over costs the
    sampler's event loop (which sends the next request as one returns) a list append per rollout. Whatever the
    scoring thread owns (the queue's drain, the rewards started) it alone reads and writes."""

    def __init__(self, config: RlConfig, loops: RewardLoops):
        self.loops = loops
        # Built here, outside the event loop: building one may connect a judge.
        self._env_loops = {env.name: env_reward_loop(loops, config, env) for env in config.settings.envs}
        self._group_sizes = {env.name: env.sampling.group_size for env in config.settings.envs}
        # (env name, index among the env's rows, record, its env's prompt messages), appended by the sampler's
        # thread, drained by the scoring thread's `_start_handed`; `_wake_pending` while a drain is scheduled.
        self._handed: collections.deque = collections.deque()
        self._wake_pending = False
        self._scoring: dict[tuple[str, int], tuple[str, asyncio.Future]] = {}  # the scoring thread's
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._streams: dict[str, GroupedScoring] = {}
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), name="streamed-scoring", daemon=True)
        self._thread.start()
        started.wait()
        if self._event_loop is None:
            raise RuntimeError("the streamed scoring thread did not start")

    # -- the scoring thread ---------------------------------------------------------------------------------------

    def _serve(self, started: threading.Event) -> None:
        # asyncio.run: at the end it cancels what is left (a failed stage's rewards in flight) and closes the loop's
        # clients, as a staged score's does.
        asyncio.run(self._until_stopped(started))

    async def _until_stopped(self, started: threading.Event) -> None:
        try:
            self._stop = asyncio.Event()
            # Each env with its own bound of `concurrency` calls in flight; a group's functions once it is whole.
            self._streams = {name: loop.grouped(group_size=self._group_sizes[name])
                             for name, loop in self._env_loops.items()}
            self._event_loop = asyncio.get_running_loop()
        finally:
            started.set()
        await self._stop.wait()

    def _start_handed(self) -> None:
        """Start the reward of every record queued so far. The flag drops before the queue is read, so a record
        queued meanwhile is either taken here or schedules a drain of its own."""
        self._wake_pending = False
        while self._handed:
            env_name, index, record, messages = self._handed.popleft()
            self._start(env_name, index, record["sample_id"], record, messages)

    def _start(self, env_name: str, index: int, sample_id: str, record: dict, messages: dict) -> None:
        try:
            item = reward_input(record, messages, f"rollout {sample_id!r}")
        except Exception as exc:  # noqa: BLE001 - a row its prompts lack: raised where the results are collected
            result = asyncio.get_running_loop().create_future()
            result.set_exception(exc)
        else:
            result = self._streams[env_name].add(item, index)
        self._scoring[(env_name, index)] = (sample_id, result)

    async def _collect(self, envs: list[str], sample_ids: list[str], rollouts: pa.Table,
                       prompt_tables: dict[str, pa.Table]) -> list[RewardResult]:
        self._start_handed()  # nothing is left once the drains the sampler scheduled ran; cheap to be sure
        seen: Counter = Counter()
        keys, messages_by_env = [], {}
        example_ids = rollouts.column("example_id").to_pylist()  # only the prompts these rows name become objects
        for row, (env_name, sample_id) in enumerate(zip(envs, sample_ids)):
            key = (env_name, seen[env_name])  # the env's rows are contiguous, in the order its sampler indexed them
            seen[env_name] += 1
            keys.append(key)
            if key not in self._scoring:  # a backend that does not stream: scored now
                if env_name not in messages_by_env:
                    messages_by_env[env_name] = prompt_messages(
                        prompt_tables[env_name], [eid for eid, name in zip(example_ids, envs) if name == env_name])
                self._start(env_name, key[1], sample_id, rollouts.slice(row, 1).to_pylist()[0],
                            messages_by_env[env_name])
            handed, _ = self._scoring[key]
            if handed != sample_id:
                raise AssertionError(f"streamed scoring: row {row} is {sample_id!r}, its sampler handed over "
                                     f"{handed!r} at that index")
        if len(keys) != len(self._scoring):
            raise AssertionError(f"streamed scoring: {len(self._scoring)} rollouts handed over, {len(keys)} in "
                                 "the table")
        for stream in self._streams.values():  # groups short of group_size members: scored with those they have
            stream.flush()
        return list(await asyncio.gather(*(self._scoring[key][1] for key in keys)))

    # -- the sampling thread --------------------------------------------------------------------------------------

    def stream_to(self, env_name: str, prompts: pa.Table) -> OnRollout:
        """The callback an env's sampler tells of each row (by its index among the env's rows); `prompts`: the
        env's PROMPTS rows the step drew (their messages are the rewards' prompt)."""
        messages = prompt_messages(prompts)
        event_loop = self._event_loop
        assert event_loop is not None

        def on_rollout(index: int, record: dict) -> None:
            self._handed.append((env_name, index, record, messages))
            if not self._wake_pending:
                self._wake_pending = True
                event_loop.call_soon_threadsafe(self._start_handed)

        return on_rollout

    def results(self, rollouts: pa.Table, prompt_tables: dict[str, pa.Table]) -> tuple[list[RewardResult],
                                                                                        dict[str, int]]:
        """Each row's RewardResult, row for row, once all are in, and the reward models' counts. A row no sampler
        handed over (a backend that does not stream) is scored now; a row handed over under another sample id
        than the table's is a bug in a sampler's indices, and fails loudly."""
        assert self._event_loop is not None
        collected = asyncio.run_coroutine_threadsafe(
            self._collect(rollouts.column("env").to_pylist(), rollouts.column("sample_id").to_pylist(), rollouts,
                          prompt_tables), self._event_loop)
        return collected.result(), self.loops.take_reward_model_metrics()

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """End the scoring thread; asyncio.run cancels the rewards still in flight (none, once all are in)."""
        if self._thread.is_alive():
            assert self._event_loop is not None and self._stop is not None
            self._event_loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()

    def __enter__(self) -> StreamedScoring:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
