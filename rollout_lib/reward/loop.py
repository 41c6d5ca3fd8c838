"""The reward loop: score each rollout asynchronously with a weighted sum of reward functions.

As verl's reward loop (seed 004), each sample is scored on its own coroutine, so latency-bound rewards overlap.
Sync functions run in `pool.SyncWorkerPool` (not a thread: a hung thread cannot be stopped), whose worker processes
are killed on timeout; async functions are cancelled on timeout.

Limits of "a timeout that really stops the work":
- an async function that blocks the event loop (time.sleep inside `async def`) stalls everything and cannot be
  interrupted; one that swallows CancelledError is abandoned after `kill_grace_s` (its task keeps running);
- a sync function must be picklable (see functions.py) because it runs in another process;
- the timeout covers running the function, not waiting for a free concurrency slot or worker.

A group function (contract.is_group_function: a verifiers rubric's plural-argument one) scores the rollouts of one
(env, example_id) together, once the group is whole (`GroupedScoring`), under the same timeout; its failure (or a
wrong-length or non-finite return) fails every member of the group. The reward is the weighted sum over every
function, per-rollout and group alike, as verifiers' Rubric.score_group adds them.

Every failure (exception, timeout, dead worker, a non-float return) makes that rollout's reward None with the
error text; it never crashes the step. Use `raise_if_all_missing` to fail a step where nothing scored, and
`raise_if_too_many_missing` (the circuit breaker) to fail one where more than a set share is missing.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
from typing import Any, Callable, Sequence

from rollout_lib.reward.contract import (  # noqa: F401
    RewardInput,
    as_score,
    extra_values,
    function_name,
    is_async_callable,
    is_group_function,
)
from rollout_lib.reward.pool import RewardTimeout, SyncWorkerPool, WorkerFunctionError
from rollout_lib.reward.results import (  # re-exported: the loop's vocabulary
    AllRewardsFailedError,
    RewardResult,
    TooManyRewardsMissingError,
    raise_if_all_missing,
    raise_if_too_many_missing,
    reward_metrics,
)
from rollout_lib.reward.tables import apply_rewards

__all__ = [
    "AllRewardsFailedError",
    "RewardLoop",
    "RewardResult",
    "TooManyRewardsMissingError",
    "apply_rewards",
    "is_async_callable",
    "raise_if_all_missing",
    "raise_if_too_many_missing",
    "reward_metrics",
    "score_inputs",
    "score_inputs_sync",
]

DEFAULT_KILL_GRACE_S = 1.0


def _unique_names(functions: Sequence[Callable[..., Any]]) -> list[str]:
    names: list[str] = []
    for fn in functions:
        base = function_name(fn)
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}#{n}"
        names.append(name)
    return names


class RewardLoop:
    """Owns the sync worker processes across steps. Whoever creates it closes it (close() is idempotent), best
    as a context manager; a closed loop refuses to score.

        with RewardLoop([(number_match, 1.0)], concurrency=32, timeout_s=10) as loop:
            results = loop.score(items)
    """

    def __init__(self, functions: Sequence[tuple[Callable[..., Any], float]], *, concurrency: int = 32,
                 timeout_s: float = 10.0, kill_grace_s: float = DEFAULT_KILL_GRACE_S,
                 sync_workers: int | None = None) -> None:
        if not functions:
            raise ValueError("RewardLoop needs at least one (function, weight)")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        for fn, weight in functions:
            if not callable(fn):
                raise TypeError(f"reward function {fn!r} is not callable")
            if not math.isfinite(weight):
                raise ValueError(f"weight of {function_name(fn)!r} must be finite, got {weight}")
        self._functions = [fn for fn, _ in functions]
        self._weights = [float(weight) for _, weight in functions]
        self._names = _unique_names(self._functions)
        self._is_async = [is_async_callable(fn) for fn in self._functions]
        self._scores_group = [is_group_function(fn) for fn in self._functions]
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        # Sync functions run by index in the pool; only they are pickled, async ones may be closures.
        self._pool_index: dict[int, int] = {}
        sync_functions = []
        for i, fn in enumerate(self._functions):
            if not self._is_async[i]:
                self._pool_index[i] = len(sync_functions)
                sync_functions.append(fn)
        self._pool: SyncWorkerPool | None = None
        self._closed = False
        if sync_functions:
            # Sync reward functions are usually CPU-bound (parsing, verifying): more workers than cores
            # would not go faster. Latency-bound ones should be async, or raise sync_workers.
            size = sync_workers or min(concurrency, os.cpu_count() or 1)
            self._pool = SyncWorkerPool(sync_functions, size=size, kill_grace_s=kill_grace_s)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def __enter__(self) -> RewardLoop:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed and self._pool is not None:
            self._pool.close()
        self._closed = True

    def sync_worker_pids(self) -> list[int]:
        """Pids of the live sync workers (for tests and debugging; started lazily on the first sync call)."""
        return self._pool.pids() if self._pool is not None else []

    # -- scoring --------------------------------------------------------------------------------------------------

    def score(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        """Score from sync code (runs its own event loop; use `ascore` inside a running loop)."""
        return asyncio.run(self.ascore(items))

    async def ascore(self, items: Sequence[RewardInput],
                     slots: asyncio.Semaphore | None = None) -> list[RewardResult]:
        """One RewardResult per item, in order. `slots`: a bound shared with other calls (a streamed step scores
        each rollout in a call of its own), else one of `concurrency` for this call. A group function scores each
        (env, example_id) group of `items` in one call: a caller that splits a step's rollouts keeps groups whole."""
        scoring = self.grouped(slots)
        results = [scoring.add(item, position) for position, item in enumerate(items)]
        scoring.flush()
        return list(await asyncio.gather(*results))

    def grouped(self, slots: asyncio.Semaphore | None = None, group_size: int | None = None) -> GroupedScoring:
        """Scoring of rollouts handed over one at a time (GroupedScoring); call it on the event loop that scores."""
        if self._closed:
            raise RuntimeError("RewardLoop is closed")
        # Bounds function calls in flight, whatever mix of items and functions they belong to.
        return GroupedScoring(self, asyncio.Semaphore(self.concurrency) if slots is None else slots, group_size)

    @property
    def scores_groups(self) -> bool:
        """Whether some function scores a group's rollouts together (contract.is_group_function)."""
        return any(self._scores_group)

    async def _rollout_outcomes(self, item: RewardInput, slots: asyncio.Semaphore) -> dict[int, Outcome] | None:
        """The per-rollout functions' outcomes of one item, by function index; None for a failed episode."""
        if item.state.get("episode_error"):  # an episode that failed (an agent that raised) has no reward to score
            return None
        indices = [i for i, group in enumerate(self._scores_group) if not group]
        outcomes = await asyncio.gather(*(self._call(i, item, slots, _one_score) for i in indices))
        return dict(zip(indices, outcomes))

    async def _group_outcomes(self, items: list[RewardInput], slots: asyncio.Semaphore) -> list[dict[int, Outcome]]:
        """The group functions' outcomes for each item of one group (every item's, by function index): a function
        that fails, times out or returns a wrong length or a non-finite score fails the whole group."""
        indices = [i for i, group in enumerate(self._scores_group) if group]
        if not items or not indices:
            return [{} for _ in items]
        per_function = await asyncio.gather(*(
            self._call(i, items, slots, functools.partial(_group_scores, len(items))) for i in indices))
        outcomes: list[dict[int, Outcome]] = [{} for _ in items]
        for i, (scores, error, _) in zip(indices, per_function):
            for member, outcome in enumerate(scores if error is None else [(None, error, {})] * len(items)):
                outcomes[member][i] = outcome
        return outcomes

    def _result(self, item: RewardInput, outcomes: dict[int, Outcome] | None) -> RewardResult:
        """One item's RewardResult from every function's outcome (None: its episode failed)."""
        if outcomes is None:
            return RewardResult(reward=None, error=f"episode failed: {item.state['episode_error']}",
                                per_function={name: None for name in self._names})
        ordered = [outcomes[i] for i in range(len(self._functions))]
        per_function = {name: score for name, (score, _, _) in zip(self._names, ordered)}
        extra = {f"{name}/{key}": value for name, (_, _, extras) in zip(self._names, ordered)
                 for key, value in extras.items()}
        errors = [error for _, error, _ in ordered if error is not None]
        if errors:
            return RewardResult(reward=None, error="; ".join(errors), per_function=per_function, extra=extra)
        reward = math.fsum(weight * score for weight, (score, _, _) in zip(self._weights, ordered))
        return RewardResult(reward=reward, error=None, per_function=per_function, extra=extra)

    async def _call(self, i: int, argument: Any, slots: asyncio.Semaphore, read: Callable[[Any], Any]) -> Any:
        """read(function i's value on `argument`) as (scores, None, extras), or (None, "Type: reward fn 'name' ...",
        {}) when the call raised, timed out, or its value was not what `read` takes."""
        name = self._names[i]
        async with slots:
            try:
                if self._is_async[i]:
                    value = await self._call_async(self._functions[i], argument)
                else:
                    assert self._pool is not None
                    value = await self._pool.call(self._pool_index[i], argument, self.timeout_s)
                return read(value)
            except RewardTimeout:
                return None, f"TimeoutError: reward fn '{name}' exceeded {self.timeout_s}s", {}
            except WorkerFunctionError as exc:  # already "Type: message" from the worker
                type_name, _, message = str(exc).partition(": ")
                return None, f"{type_name}: reward fn '{name}': {message}", {}
            except Exception as exc:  # noqa: BLE001 - a reward failure must never crash the step
                return None, f"{type(exc).__name__}: reward fn '{name}': {exc}", {}

    async def _call_async(self, fn: Callable[..., Any], item: RewardInput) -> Any:
        task = asyncio.ensure_future(fn(item))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        finally:
            if not task.done():
                task.cancel()  # also when we ourselves are cancelled: never leave the work running
        if task in done:
            return task.result()
        # Give the cancellation a bounded chance to run its cleanup (finally blocks, closing connections).
        await asyncio.wait({task}, timeout=self.kill_grace_s)
        if not task.done():
            task.add_done_callback(_consume_result)  # swallows CancelledError: abandon, don't warn later
        raise RewardTimeout


def _consume_result(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


# (score, None, the reward dict's other numbers) or (None, "Type: reward fn 'name': ...", {}).
Outcome = tuple[float | None, str | None, dict[str, float]]


def _one_score(value: Any) -> Outcome:
    return as_score(value), None, extra_values(value)


def _group_scores(size: int, value: Any) -> tuple[list[Outcome], None, dict]:
    """A group function's value read as one Outcome per member: a list (or tuple) of `size` scores."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"a group reward function returns a list of one score per rollout, got "
                        f"{type(value).__name__}: {value!r}")
    if len(value) != size:
        raise ValueError(f"returned {len(value)} scores for a group of {size} rollouts")
    return [_one_score(score) for score in value], None, {}


class GroupedScoring:
    """A RewardLoop's rollouts handed over one at a time (`add`, a streamed step's as each ends): each one's
    per-rollout functions start at once; the group functions of its (env, example_id) group once the group's
    `group_size`-th member is in, or at `flush` (None: only at flush), over the members in position order, so the
    order they came in never shows. A member whose episode failed is left out of what group functions see (its
    reward is missing anyway). Without group functions each rollout's result is ready as its functions end."""

    def __init__(self, loop: RewardLoop, slots: asyncio.Semaphore, group_size: int | None):
        self._loop, self._slots, self._group_size = loop, slots, group_size
        # group -> (position, item, its per-rollout functions' task, its result), until the group is complete
        self._waiting: dict[tuple[str, str], list[tuple[int, RewardInput, asyncio.Task, asyncio.Future]]] = {}
        self._groups: set[asyncio.Task] = set()  # running: referenced so they are not collected mid-flight

    def add(self, item: RewardInput, position: int) -> asyncio.Future:
        """Start scoring `item` (`position`: its place among the rollouts); the future of its RewardResult."""
        result = asyncio.get_running_loop().create_future()
        rollout = asyncio.ensure_future(self._loop._rollout_outcomes(item, self._slots))
        members = self._waiting.setdefault(item.group, [])
        members.append((position, item, rollout, result))
        if not self._loop.scores_groups or len(members) == self._group_size:
            self._start(item.group)
        return result

    def flush(self) -> None:
        """Score every group still short of `group_size` members with the members it has."""
        for group in list(self._waiting):
            self._start(group)

    def _start(self, group: tuple[str, str]) -> None:
        task = asyncio.ensure_future(self._score(sorted(self._waiting.pop(group), key=lambda member: member[0])))
        self._groups.add(task)
        task.add_done_callback(self._groups.discard)

    async def _score(self, members: list) -> None:
        try:
            scored = [member for member in members if not member[1].state.get("episode_error")]
            group = await self._loop._group_outcomes([item for _, item, _, _ in scored], self._slots)
            by_position = {member[0]: outcomes for member, outcomes in zip(scored, group)}
            for position, item, rollout, result in members:
                outcomes = await rollout
                if outcomes is not None:
                    outcomes = {**outcomes, **by_position[position]}
                result.set_result(self._loop._result(item, outcomes))
        except BaseException as exc:  # cancelled with the step (or a bug): no member waits forever
            for _, _, rollout, result in members:
                rollout.cancel()
                if result.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    result.cancel()
                else:
                    result.set_exception(exc)
            raise


async def score_inputs(items: Sequence[RewardInput], functions: Sequence[tuple[Callable[..., Any], float]],
                       **loop_settings: Any) -> list[RewardResult]:
    """Score items once with a throwaway RewardLoop(functions, **loop_settings) (its workers shut down on return)."""
    with RewardLoop(functions, **loop_settings) as loop:
        return await loop.ascore(items)


def score_inputs_sync(items: Sequence[RewardInput], functions: Sequence[tuple[Callable[..., Any], float]],
                      **loop_settings: Any) -> list[RewardResult]:
    """`score_inputs` from sync code."""
    return asyncio.run(score_inputs(items, functions, **loop_settings))
