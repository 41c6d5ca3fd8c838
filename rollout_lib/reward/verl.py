"""verl-style reward functions, run unchanged through an adapter.

verl calls a custom reward function as `compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=..., **reward_kwargs)` (`verl/workers/reward_manager/naive.py`, `verl/trainer/ppo/reward.py`), `def` or
`async def`, and reads a float, or a dict whose "score" is the reward (the loop reads "score"; the dict's other
numbers, verl's reward_extra_info, become the step's `reward/<function>/<key>` means). verl's own scorers (`verl/utils/reward_score/gsm8k.py`) are bare:
`compute_score(solution_str, ground_truth, ...)`, and users name them as the reward directly.
`resolve_reward_function` recognises either by its first parameters, with no config flag, and wraps it here, so it
takes one `RewardInput` like ours; each argument (the table in docs/rewards.md, "verl-style functions") is passed
by name, when the function takes it. Without a judge, `reward_router_address` and `reward_model_tokenizer` are None
(as in verl) for a function with a default for them, and refused at plan time for one that requires them.

The adapters are module-level classes, so a sync one pickles by reference into the worker processes (the user's
function must be importable there, as any sync reward function). This module imports nothing heavy: every worker
imports it when it unpickles an adapter.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

from rollout_lib.reward.contract import RewardInput, is_async_callable
from rollout_lib.reward.servers import RewardServer

# How a verl-style function is recognised: its first positional parameters are one of these.
VERL_SIGNATURES = (("data_source", "solution_str", "ground_truth"), ("solution_str", "ground_truth"))
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")  # what the adapter passes by name
REWARD_SERVER_ARGUMENTS = ("reward_router_address", "reward_model_tokenizer")  # and these, from the reward's judge


def is_verl_signature(signature: inspect.Signature) -> bool:
    """True when a function's positional parameters start as verl's compute_score or one of its bare scorers."""
    names = tuple(p.name for p in signature.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    return any(names[:len(start)] == start for start in VERL_SIGNATURES)


def verl_arguments_taken(signature: inspect.Signature, *, judged: bool = False) -> frozenset[str]:
    """The verl arguments a function takes: those it names; with **kwargs every one (the reward-server ones only
    when its reward names a judge: `judged`)."""
    parameters = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return frozenset(VERL_ARGUMENTS + (REWARD_SERVER_ARGUMENTS if judged else ()))
    return frozenset(p.name for p in parameters if p.name in VERL_ARGUMENTS + REWARD_SERVER_ARGUMENTS)


def reward_server_problem(signature: inspect.Signature, *, judged: bool) -> str | None:
    """Why a function cannot get the reward-server arguments it requires, or None: without a judge there is no
    router and no tokenizer to hand it, and a required one would only get None."""
    required = [p.name for p in signature.parameters.values()
                if p.name in REWARD_SERVER_ARGUMENTS and p.default is inspect.Parameter.empty]
    if required and not judged:
        return (f"it requires {', '.join(required)}, and this reward names no judge: add `judge = {{ model = "
                f"\"<ref>\" }}` or `judge = {{ base_url = [...], name = \"...\" }}` (the model it asks)")
    return None


def verl_kwargs_problem(kwargs: dict) -> str | None:
    """Why configured kwargs cannot go to a verl-style function, or None: the adapter fills its arguments."""
    taken = sorted(set(kwargs) & set(VERL_ARGUMENTS + REWARD_SERVER_ARGUMENTS))
    if taken:
        return f"kwargs {taken} are filled from each rollout for a verl-style compute_score; they cannot be set"
    return None


def is_verl_style(fn: Any) -> bool:
    """A callable whose first parameters are verl's (through partials and `__call__`). A class is not: calling it
    constructs."""
    if isinstance(fn, type):
        return False
    try:
        return is_verl_signature(inspect.signature(fn))
    except (TypeError, ValueError):  # no introspectable signature: not something we can recognise
        return False


def adapt_verl_function(compute_score: Callable[..., Any], kwargs: dict | None, spec: str,
                        reward_server: Callable[[frozenset[str]], RewardServer] | None = None) -> Callable[..., Any]:
    """compute_score wrapped to take one RewardInput: a sync or an async adapter, as compute_score is.
    `reward_server`: for a reward that names a judge, what makes its RewardServer, given the arguments the function
    takes (so that a tokenizer is loaded only for a function that takes it)."""
    kwargs = dict(kwargs or {})
    problem = verl_kwargs_problem(kwargs)
    if problem:
        raise ValueError(f"reward function {spec!r}: {problem}")
    taken = verl_arguments_taken(inspect.signature(compute_score), judged=reward_server is not None)
    server = reward_server(taken) if reward_server is not None else RewardServer()
    adapter = AsyncVerlRewardFunction if is_async_callable(compute_score) else VerlRewardFunction
    return adapter(compute_score, kwargs, taken, server)


def verl_arguments(inp: RewardInput, taken: frozenset[str] = frozenset(VERL_ARGUMENTS),
                   server: RewardServer | None = None) -> dict[str, Any]:
    """The keyword arguments verl would pass for this rollout (the mapping in the module docstring), of those in
    `taken`; the reward-server ones from `server` (None without one)."""
    ground_truth = inp.answer if inp.answer is not None else inp.info.get("ground_truth")
    if ground_truth is None:
        # verl data always carries reward_model.ground_truth; passing None would let a comparison score 0.
        raise ValueError("a verl-style compute_score needs a ground truth: the row has no answer and its info no "
                         "'ground_truth'")
    arguments = {"data_source": inp.info.get("data_source", inp.env), "solution_str": inp.completion_text,
                 "ground_truth": ground_truth}
    if "extra_info" in taken:
        arguments["extra_info"] = dict(inp.info)  # a copy: verl's own reward managers write into extra_info
    server = server or RewardServer()
    arguments["reward_router_address"] = server.router_address
    arguments["reward_model_tokenizer"] = server.tokenizer
    return {name: value for name, value in arguments.items() if name in taken}


def verl_score(value: Any) -> Any:
    """compute_score's return value as our loop reads it (`functions.as_score`); a bool becomes 1.0 / 0.0, as verl's
    default_compute_score makes it (our own reward functions may not return a bool: there it is usually a bug)."""
    if isinstance(value, dict) and isinstance(value.get("score"), bool):
        return {**value, "score": float(value["score"])}
    return float(value) if isinstance(value, bool) else value


class VerlRewardFunction:
    """A sync verl-style compute_score as a reward function (runs in a worker process)."""

    def __init__(self, compute_score: Callable[..., Any], kwargs: dict, taken: frozenset[str],
                 server: RewardServer | None = None) -> None:
        self.compute_score = compute_score
        self.kwargs = kwargs
        self.taken = taken  # the verl arguments it is passed (verl_arguments_taken)
        self.server = server or RewardServer()
        # Metrics and errors name the user's function, not the adapter.
        self.__name__ = getattr(compute_score, "__name__", type(compute_score).__name__)
        self.__qualname__ = getattr(compute_score, "__qualname__", self.__name__)

    def __call__(self, inp: RewardInput) -> Any:
        arguments = verl_arguments(inp, self.taken, self.server)
        with self._explained():
            return verl_score(self.compute_score(**arguments, **self.kwargs))

    @contextlib.contextmanager
    def _explained(self):
        """An error the reward's judge server explains (RewardServer.explained) is raised as that explanation."""
        try:
            yield
        except Exception as exc:
            explained = self.server.explained(exc)
            if explained is None:
                raise
            raise explained from exc


class AsyncVerlRewardFunction(VerlRewardFunction):
    """An `async def` verl-style compute_score as a reward function (awaited on the loop, cancelled on timeout)."""

    async def __call__(self, inp: RewardInput) -> Any:
        arguments = verl_arguments(inp, self.taken, self.server)
        with self._explained():
            return verl_score(await self.compute_score(**arguments, **self.kwargs))
