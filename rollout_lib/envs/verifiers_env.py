"""A verifiers environment as an env: `interaction = { type = "verifiers", env_id = "my_env", env_args = {...} }`.

The environment (verifiers 0.3.x's v0 API) is loaded as verifiers loads it (`env_id`'s `load_environment(**env_args)`,
docs/environments.md) and runs unchanged: its own rollout loop decides each turn, and every model call goes through
a rollout-implemented `vf.Client` (envs/verifiers_client.py) answered by the agent driver's in-process endpoint
(envs/agent_episodes.py), so the policy sampler samples each turn, seeded, its tokens and logprobs kept as sampled.

With it, the env's prompts are the environment's dataset (`source = { type = "verifiers" }`, drawn per step by
rollout's content-seeded draw) and its rewards the environment's Rubric (`rewards = [{ rubric = "verifiers" }]`,
scored by rollout's reward loop: envs/verifiers_rubric.py); both are filled in when left out (config/rl.py).

Needs the `verifiers` extra (`pip install 'rollout[verifiers]'`, verifiers 0.3.x): checked when the config is read,
as is the env module (found and read, never imported then).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rollout_lib.envs.agent import AgentDriven
from rollout_lib.envs.base import InteractionSettings
from rollout_lib.envs.tools.parsers import ParserName
from rollout_lib.reward.locate import check_reference, import_reference
from rollout_lib.settings_base import StrictModel

EXTRA = "the `verifiers` extra (pip install 'rollout[verifiers]', verifiers>=0.3.1,<0.4)"
MODEL_NAME = "policy"  # the model name the environment's requests carry (every request is the policy's)


def env_module(env_id: str) -> str:
    """The module verifiers imports for `env_id` (verifiers.legacy.utils.env_utils.load_environment's rule)."""
    return env_id.replace("-", "_").split("/")[-1]


def verifiers_problem() -> str | None:
    """Why verifiers' v0 API cannot be used here, or None: the package missing, or a version without it."""
    try:
        version = importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        return f"verifiers is not installed: install {EXTRA}"
    major_minor = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if major_minor != (0, 3):
        return (f"verifiers {version} is installed, and rollout runs verifiers' v0 environments (SingleTurnEnv, "
                f"MultiTurnEnv, ToolEnv), which only 0.3.x has (0.4 dropped them): install {EXTRA}")
    return None


class VerifiersSource(StrictModel):
    """An env's prompts from its verifiers environment's dataset (`split = "eval"`: its eval_dataset)."""

    type: Literal["verifiers"] = "verifiers"
    split: Literal["train", "eval"] = "train"


class VerifiersSettings(InteractionSettings):
    type: Literal["verifiers"] = "verifiers"
    max_turns: int = Field(4, ge=1, exclude=True)  # inherited, unused and refused as a key (_turns_are_the_envs)
    env_id: str = Field(min_length=1)  # the module to import: "my_env", "my-env", "owner/my-env"
    env_args: dict[str, Any] = Field(default_factory=dict)  # load_environment(**env_args)
    timeout_s: float = Field(120.0, gt=0)  # per episode: past it the episode fails (counted), the step goes on
    max_requests: int = Field(16, ge=1)  # model calls per episode (the env's own max_turns usually ends it first)
    parser: ParserName = "hermes"  # how tool calls are read from sampled text (a ToolEnv's tools)

    @model_validator(mode="before")
    @classmethod
    def _turns_are_the_envs(cls, value: Any) -> Any:
        if isinstance(value, dict) and "max_turns" in value:
            raise ValueError("a verifiers environment ends its episodes itself (its own max_turns and stop "
                             "conditions); bound them here with max_requests and timeout_s")
        return value

    @field_validator("env_id")
    @classmethod
    def _env_module_found(cls, env_id: str) -> str:
        problem = verifiers_problem()
        if problem is not None:
            raise ValueError(problem)
        module = env_module(env_id)
        try:  # found and read, never imported while the config is read
            check_reference(f"{module}:load_environment", what="verifiers environment")
        except ValueError as exc:
            raise ValueError(f"{exc} (env_id {env_id!r}: install the environment's package, or put its module on "
                             "the Python path)") from None
        return env_id

    @model_validator(mode="after")
    def _args_are_json(self) -> "VerifiersSettings":
        try:  # they key the loaded environment and enter the identity
            json.dumps(self.env_args)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"env_args must be JSON values (strings, numbers, booleans, lists, tables): {exc}") \
                from None
        return self

    def user_modules(self) -> tuple[str, ...]:
        return (env_module(self.env_id),)


@functools.lru_cache(maxsize=8)
def loaded_environment(env_id: str, env_args_json: str):
    """The environment of (env_id, env_args as sorted JSON), loaded once per process."""
    problem = verifiers_problem()
    if problem is not None:
        raise ValueError(problem)
    import verifiers as vf

    load = import_reference(f"{env_module(env_id)}:load_environment", what="verifiers environment")
    environment = load(**json.loads(env_args_json))
    if not isinstance(environment, vf.Environment):
        raise TypeError(f"verifiers environment {env_id!r}: load_environment returned {type(environment).__name__}, "
                        "not a verifiers Environment")
    return environment


def load_verifiers_environment(settings: VerifiersSettings):
    """The environment, loaded once per process for each (env_id, env_args)."""
    return loaded_environment(settings.env_id, json.dumps(settings.env_args, sort_keys=True))


class VerifiersInteraction(AgentDriven):
    """Each episode is the environment's own rollout, in process, its model calls answered by the step's sampler."""

    type_name = "verifiers"
    settings_class = VerifiersSettings
    in_process: ClassVar[bool] = True

    def __init__(self, settings: VerifiersSettings, tools=None):
        super().__init__(settings, tools)
        if tools is not None:
            raise ValueError("a verifiers environment brings its own tools (a ToolEnv's); the env's `tools` are "
                             "not used")
        self.environment = load_verifiers_environment(settings)

    @property
    def name(self) -> str:
        return f"verifiers environment {self.settings.env_id!r}"

    async def agent(self, endpoint, task: dict) -> None:
        """One episode: the environment's rollout of the task's row, its final state left for the rubric."""
        from rollout_lib.envs.verifiers_client import RolloutClient, state_record

        row = verifiers_row(task)
        state = await self.environment.rollout(row, RolloutClient(endpoint), MODEL_NAME, {"logprobs": True})
        endpoint.state["verifiers"] = state_record(state)
        return None


def verifiers_row(task: dict) -> dict:
    """The environment's dataset row a PROMPTS row was made from (envs/verifiers_data.py keeps it in `info`)."""
    info = task.get("info") or {}
    if isinstance(info, str):
        info = json.loads(info)
    if "verifiers" not in info:
        raise ValueError(f"example {task.get('example_id')!r} did not come from a verifiers environment's dataset "
                         '(source = { type = "verifiers" })')
    return {**info["verifiers"], "prompt": [dict(message) for message in task["messages"]]}
