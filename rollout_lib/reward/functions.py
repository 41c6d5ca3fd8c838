"""Reward functions: the built-ins, and resolving a function from its config name.

The contract (one RewardInput in; a float, or a dict whose "score" is the reward and whose other numbers become
`reward/<function>/<key>` metrics, out; sync ones run in worker processes, so everything here is module-level):
docs/rewards.md. A function that cannot score
(no answer to compare with, a malformed entry) raises: the loop records a missing reward, never a silent 0.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
from typing import Any, Callable

from rollout_lib.reward.contract import RewardInput, as_score  # noqa: F401  (the contract, re-exported)
from rollout_lib.reward.locate import check_reference, function_signature, import_reference
from rollout_lib.reward.verl import (adapt_verl_function, is_verl_signature, is_verl_style, reward_server_problem,
                                     verl_arguments_taken, verl_kwargs_problem)


# --- built-ins -----------------------------------------------------------------------------------------------


def _require_answer(inp: RewardInput, function_name: str) -> str:
    if inp.answer is None:
        raise ValueError(f"{function_name} needs an answer, but the example has none")
    return inp.answer


def exact_match(inp: RewardInput) -> float:
    """1.0 when the stripped completion equals the stripped answer, else 0.0."""
    return float(inp.completion_text.strip() == _require_answer(inp, "exact_match").strip())


def contains_answer(inp: RewardInput) -> float:
    """1.0 when the stripped answer occurs anywhere in the completion, else 0.0."""
    return float(_require_answer(inp, "contains_answer").strip() in inp.completion_text)


# Thousands separators only in proper groups ("1,234"), so "3,4" reads as two numbers, not 34.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


def _parse_number(text: str) -> float:
    return float(text.replace(",", ""))


def number_match(inp: RewardInput, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1.0 when the last number in the completion equals the numeric answer, else 0.0 (also when no number)."""
    answer = _require_answer(inp, "number_match").strip()
    try:
        expected = _parse_number(answer)
    except ValueError:
        raise ValueError(f"number_match: answer {answer!r} is not a number") from None
    numbers = _NUMBER.findall(inp.completion_text)
    if not numbers:
        return 0.0
    return float(math.isclose(_parse_number(numbers[-1]), expected, rel_tol=rel_tol, abs_tol=abs_tol))


def target_length(inp: RewardInput, *, target: int = 20, unit: str = "words") -> float:
    """Toy learnable reward: 1 - |length - target| / target, clipped to [0, 1]; length in words or chars."""
    if target <= 0:
        raise ValueError(f"target_length: target must be > 0, got {target}")
    if unit == "words":
        length = len(inp.completion_text.split())
    elif unit == "chars":
        length = len(inp.completion_text)
    else:
        raise ValueError(f"target_length: unit must be 'words' or 'chars', got {unit!r}")
    return max(0.0, 1.0 - abs(length - target) / target)


@functools.lru_cache(maxsize=64)
def _reasoning_gym_dataset(name: str, config_json: str):
    # Datasets are cheap to build but some load word lists etc.; one per (name, config) per process.
    import reasoning_gym  # imported here: ~1 s, and only this built-in needs it

    return reasoning_gym.create_dataset(name, **json.loads(config_json))


def reasoning_gym_score(inp: RewardInput, *, require_tags: bool = False) -> float:
    """reasoning_gym's own `score_answer` for info["rg_dataset"] on info["rg_entry"] (the generated item).

    The answer is the last `<answer>...</answer>` block (reasoning_gym's prompt convention); without one the
    whole stripped completion is scored, unless `require_tags`, in which case it scores 0.0.
    `info["rg_config"]` (optional) is the dataset config the entry was generated with.
    """
    from reasoning_gym.utils import extract_answer

    name = inp.info.get("rg_dataset")
    entry = inp.info.get("rg_entry")
    if not name or not isinstance(entry, dict):
        raise ValueError("reasoning_gym needs info['rg_dataset'] (a name) and info['rg_entry'] (the item dict)")
    config_json = json.dumps(inp.info.get("rg_config") or {}, sort_keys=True)
    dataset = _reasoning_gym_dataset(name, config_json)
    extracted = extract_answer(inp.completion_text)
    if extracted is None:
        if require_tags:
            return 0.0
        extracted = inp.completion_text.strip()
    return float(dataset.score_answer(extracted, entry))


def env_score(inp: RewardInput, *, key: str = "score") -> float:
    """The score a multi-turn environment kept in its episode state (state[key]), e.g. guess_number's."""
    if key not in inp.state:
        raise ValueError(f"env_score: the episode state has no {key!r} (keys: {sorted(inp.state)}); is this env "
                         "multi-turn, with an interaction that keeps a score?")
    return as_score(inp.state[key])


BUILTIN_REWARD_FUNCTIONS: dict[str, Callable[..., float]] = {
    "env_score": env_score,
    "exact_match": exact_match,
    "contains_answer": contains_answer,
    "number_match": number_match,
    "target_length": target_length,
    "reasoning_gym": reasoning_gym_score,
}


# --- resolution ----------------------------------------------------------------------------------------------


def resolve_reward_function(spec: str, kwargs: dict | None = None, *, filled: tuple[str, ...] = (),
                            reward_server: Callable[[frozenset[str]], Any] | None = None) -> Callable[..., Any]:
    """A built-in name ("number_match") or an import path ("package.module:attr"), with kwargs bound.

    kwargs are bound with `functools.partial`, which stays picklable for the sync worker processes. A verl-style
    function (first parameters data_source, solution_str, ground_truth, or verl's bare solution_str, ground_truth)
    comes back wrapped by `verl.py`, handed `reward_server(taken)` (its judge's router and tokenizer, verl.py) when
    its reward names a judge. `filled`: keyword arguments the caller passes at each call (`judge`); a function that
    cannot be called so is refused (`reward_call_problem`).
    """
    if ":" in spec:
        target: Any = import_reference(spec, what="reward function")
    else:
        if spec not in BUILTIN_REWARD_FUNCTIONS:
            raise ValueError(
                f"unknown built-in reward function {spec!r}; available: {sorted(BUILTIN_REWARD_FUNCTIONS)} "
                "(or an import path 'package.module:attr')"
            )
        target = BUILTIN_REWARD_FUNCTIONS[spec]
    if not callable(target):
        raise ValueError(f"reward function {spec!r} is not callable: {type(target).__name__}")
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        signature = None  # no introspectable signature (some C callables): let the call itself complain
    if kwargs and signature is not None:
        # A misspelt kwarg is a config error: fail here, not once per rollout inside the loop.
        try:
            signature.bind_partial(**kwargs)
        except TypeError as exc:
            raise ValueError(f"reward function {spec!r}: bad kwargs {sorted(kwargs)}: {exc}") from None
    if signature is not None and not isinstance(target, type):  # calling a class constructs: nothing to check
        problem = reward_call_problem(getattr(target, "__name__", spec), signature,
                                      {**(kwargs or {}), **dict.fromkeys(filled)})
        if problem:
            raise ValueError(f"reward function {spec!r}: {problem}")
    if ":" in spec and is_verl_style(target):  # verl's compute_score(data_source, solution_str, ground_truth, ...)
        return adapt_verl_function(target, kwargs, spec, reward_server)
    return functools.partial(target, **kwargs) if kwargs else target


def check_reward_function(spec: str, kwargs: dict | None = None, *, filled: tuple[str, ...] = ()) -> None:
    """What plan time checks (config validation, `--dry-run`): a built-in is resolved; a user's import path is
    found and read without running its module (`locate.py`), which happens only when the reward loop starts, and
    a top-level `def` must be callable as the loop calls it (`reward_call_problem`)."""
    if ":" not in spec:
        resolve_reward_function(spec, kwargs, filled=filled)
        return
    definition = check_reference(spec, kwargs, what="reward function")
    if definition is not None:
        problem = reward_call_problem(definition.name, function_signature(definition),
                                      {**(kwargs or {}), **dict.fromkeys(filled)})
        if problem:
            raise ValueError(f"reward function {spec!r}: {problem}")


def reward_call_problem(name: str, signature: inspect.Signature, bound: dict) -> str | None:
    """Why the loop cannot call a function of this signature, or None. The loop calls `fn(inp, **bound)` (one
    RewardInput), or a verl-style one with the verl arguments it takes by name (verl.py); `bound`: the configured
    kwargs and what the caller fills (`judge`: a verl-style function gets its judge as reward_router_address and
    reward_model_tokenizer instead)."""
    try:
        if is_verl_signature(signature):
            judged = "judge" in bound
            bound = {key: value for key, value in bound.items() if key != "judge"}
            problem = verl_kwargs_problem(bound) or reward_server_problem(signature, judged=judged)
            if problem:
                return problem
            signature.bind(**dict.fromkeys(verl_arguments_taken(signature, judged=judged)), **bound)
        else:
            signature.bind(None, **bound)
    except TypeError as exc:
        return (f"{name}{signature} cannot be called as a reward ({exc}): a reward function takes one RewardInput, "
                f"`def {name}(inp)`, or is verl's `compute_score(data_source, solution_str, ground_truth, "
                f"extra_info=None)` or bare `compute_score(solution_str, ground_truth)`; else write a wrapper, e.g. "
                f"`def reward(inp): return {name}(inp.completion_text, inp.answer)`")
    return None
