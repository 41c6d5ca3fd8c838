"""A verifiers environment's Rubric as rollout reward functions (`rewards = [{ rubric = "verifiers" }]`).

Every function of the rubric (a RubricGroup's, flattened: a MultiTurnEnv's `num_turns`, a ToolEnv's
`total_tool_calls` and `<tool>_calls` among them) becomes one reward function of rollout's reward loop with the
rubric's weight (times the reward setting's `weight`): the loop runs them concurrently with its timeout (sync ones in
its worker processes, killed when they overrun; async ones cancelled), records a function that raises, times out or
returns a non-finite number as a missing reward with its error (verifiers would score it 0), and counts the step's
missing rewards against its breaker. A weight-0 function (a verifiers metric) is computed and reported in the
step's metrics (`reward/<function>`), never trained on, as in verifiers.

Each function is called as verifiers' Rubric calls it: with the arguments its signature names among those the
rubric's own `score_objects` gives (prompt, completion, answer, state, info, task, the rubric's parser and its other
class objects), from the episode's recorded final state (verifiers_client.state_record) rebuilt as a verifiers State
with pydantic messages. The trajectory it sees holds each turn's completion messages, not their tokens.

A group reward function (verifiers' `_is_group_func`: plural arguments `completions`, `states`, ..., or a list
return) is a group function of the loop (contract.is_group_function): called once per (env, example_id) group with
the rubric's `group_score_objects` of the members' states, in row order, as Rubric.score_group calls it; its scores
enter each member's weighted sum with its weight, as there. Where verifiers scores a raising one 0 for the whole
group, the loop records the group's rewards missing with the error.
"""

from __future__ import annotations

import copy
import inspect
import json

from rollout_lib.envs.verifiers_env import load_verifiers_environment, loaded_environment, verifiers_row
from rollout_lib.reward.contract import RewardInput


def flattened_rubric(rubric) -> list[tuple[object, object, float]]:
    """(the rubric that owns it, function, weight) of every reward function, RubricGroups flattened in order."""
    if hasattr(rubric, "rubrics"):  # a RubricGroup scores its rubrics, not functions of its own
        return [entry for inner in rubric.rubrics for entry in flattened_rubric(inner)]
    return list(zip([rubric] * len(rubric.funcs), rubric.funcs, rubric.weights))


def rubric_functions(settings, weight: float = 1.0) -> list[tuple[object, float]]:
    """(reward function, weight) of each of the environment's rubric functions, for a RewardLoop."""
    environment = load_verifiers_environment(settings)
    args = json.dumps(settings.env_args, sort_keys=True)
    functions = []
    for index, (rubric, function, function_weight) in enumerate(flattened_rubric(environment.rubric)):
        name = getattr(function, "__name__", None) or type(function).__name__
        kind = AsyncRubricFunction if inspect.iscoroutinefunction(function) else SyncRubricFunction
        functions.append((kind(settings.env_id, args, index, name, scores_group=rubric._is_group_func(function)),
                          float(function_weight) * weight))
    if not functions:
        raise ValueError(f"verifiers environment {settings.env_id!r}: its rubric has no reward functions")
    return functions


class SyncRubricFunction:
    """A sync rubric function, by position: picklable (the loop runs it in a worker process, which loads the
    environment once). `scores_group`: a group function, given the group's RewardInputs and returning their scores."""

    def __init__(self, env_id: str, env_args_json: str, index: int, name: str, scores_group: bool = False):
        self.env_id, self.env_args_json, self.index = env_id, env_args_json, index
        self.scores_group = scores_group
        self.__name__ = self.__qualname__ = name  # what the step's metrics and errors call it

    def _bound(self, argument: RewardInput | list[RewardInput]):
        rubric, function, _ = flattened_rubric(loaded_environment(self.env_id, self.env_args_json).rubric)[self.index]
        if self.scores_group:
            return function, _named(function, rubric.group_score_objects([rebuilt_state(item) for item in argument]))
        return function, _named(function, rubric.score_objects(rebuilt_state(argument)))

    def _read(self, value) -> float | list[float]:
        return _as_numbers(value) if self.scores_group else _as_number(value)

    def __call__(self, argument: RewardInput | list[RewardInput]) -> float | list[float]:
        function, kwargs = self._bound(argument)
        return self._read(function(**kwargs))


class AsyncRubricFunction(SyncRubricFunction):
    """An async rubric function: awaited on the reward loop's event loop (cancelled at the timeout)."""

    async def __call__(self, argument: RewardInput | list[RewardInput]) -> float | list[float]:
        function, kwargs = self._bound(argument)
        return self._read(await function(**kwargs))


def _as_numbers(value) -> list[float]:
    """A group function's scores, each read as verifiers reads a reward; the loop checks the count against the
    group's size."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"a group rubric function returns a list of numbers, got {type(value).__name__}: {value!r}")
    return [_as_number(score) for score in value]


def _as_number(value) -> float:
    """verifiers reads a reward as float(value) (a bool or an int too); NaN stays NaN, which the loop refuses."""
    if isinstance(value, dict) or value is None:
        raise TypeError(f"a rubric function returns a number, got {type(value).__name__}: {value!r}")
    return float(value)


def _named(function, objects: dict) -> dict:
    """What verifiers' Rubric._call_individual_reward_func (and _call_group_reward_func) passes `function` of the
    rubric's score objects: all of them to a **kwargs function, else those its signature names."""
    parameters = inspect.signature(function).parameters.values()
    if any(parameter.kind == parameter.VAR_KEYWORD for parameter in parameters):
        return objects
    names = {parameter.name for parameter in parameters}
    return {key: value for key, value in objects.items() if key in names}


def rebuilt_state(item: RewardInput):
    """The environment's final State of the episode, rebuilt from its record: input row, prompt and completion as
    verifiers' message objects, the recorded keys, the trajectory's turns."""
    from verifiers.legacy.types import State, flatten_task_input
    from verifiers.legacy.utils.message_utils import normalize_messages

    record = item.state.get("verifiers")
    if record is None:
        raise ValueError("the episode has no verifiers state (was it sampled by a verifiers environment?)")
    row = verifiers_row({"messages": item.prompt, "info": item.info})
    state = State(input=copy.deepcopy(row))
    state["task"] = flatten_task_input(state["input"])
    state["prompt"] = normalize_messages(row["prompt"], field_name="prompt")
    for key, value in record.items():
        if key not in ("completion", "trajectory"):
            state[key] = copy.deepcopy(value)
    state["completion"] = normalize_messages(record.get("completion") or [], field_name="completion")
    state["trajectory"] = [{**step, "completion": normalize_messages(step["completion"], field_name="completion")}
                           for step in record.get("trajectory", [])]
    return state
