"""An OpenEnv environment as an env: `interaction = { type = "openenv", environment = "pkg.module:EnvClass" }`
(in-process) or `{ type = "openenv", url = "http://127.0.0.1:8000" }` (a served one, over its WebSocket session).

Each episode gets an environment of its own (an instance of the class, or a WebSocket session on the server),
reset with a seed derived from the step's seed and the example; the reset observation is the first message the
model reads. After each model turn its action is parsed (`action = "json"`: the first JSON object; `"tool_call"`:
a call of the one tool `tool_name`) and stepped; an unparseable or refused action is answered `error: ...` and
counted in `action_errors`, never the episode's failure. Each observation's reward is summed into the state's
`env_reward` (the `env_reward` reward function reads it). An environment that raises, or a server that dies
mid-episode, fails that episode: its reward is missing, never 0. The contract in full: docs/environments.md.

Needs `openenv-core` (checked at plan time): scripts/setup.sh --test installs it (docs/environments.md)."""

from __future__ import annotations

import importlib.util
import json
import logging
from typing import Any, Literal

from pydantic import Field, model_validator

from rollout_lib.envs.base import EnvReply, Interaction, InteractionSettings
from rollout_lib.envs.openenv_sessions import (INSTALL, WHAT, InProcessEnvs, InvalidAction, OpenEnvFailure,
                                               ServedEnvs)
from rollout_lib.envs.tools.parsers import PARSERS, ParserName
from rollout_lib.reward.locate import check_reference

log = logging.getLogger(__name__)


def openenv_missing() -> str | None:
    """Why OpenEnv cannot be used here (a package looked for, not imported: the import takes seconds), or None."""
    for package, name in (("openenv", "openenv-core"), ("fastmcp", "fastmcp (openenv-core imports it)")):
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"OpenEnv environments need {name}, which is not installed: {INSTALL}"
    return None


class OpenEnvSettings(InteractionSettings):
    type: Literal["openenv"] = "openenv"
    max_turns: int = Field(4, ge=1)
    environment: str | None = None  # in-process: "package.module:EnvironmentClass" (an openenv Environment)
    kwargs: dict[str, Any] = Field(default_factory=dict)  # the class's constructor arguments (one per episode)
    url: str | None = None  # served: the env server's base URL ("http://127.0.0.1:8000"); its /ws is used
    action: Literal["json", "tool_call"] = "json"  # where the action is read from in the model's turn
    tool_name: str = Field("step", min_length=1)  # action = "tool_call": the tool the model calls
    parser: ParserName = "hermes"  # action = "tool_call": how calls are written (envs/tools/parsers)
    observation_field: str | None = None  # the observation field whose text is the message; None: all, as JSON
    timeout_s: float = Field(30.0, gt=0)  # per reset/step (served: per message); past it the episode fails

    @model_validator(mode="after")
    def _one_place_and_the_package(self) -> "OpenEnvSettings":
        if (self.environment is None) == (self.url is None):
            raise ValueError("an OpenEnv env names either `environment` (a class run in-process) or `url` (a "
                             "served one), not both or neither")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r}: the env server's http(s):// base URL (its WebSocket is <url>/ws)")
        if self.url is not None and self.kwargs:
            raise ValueError("kwargs are the constructor arguments of an in-process environment; a served one "
                             "was built by its server")
        missing = openenv_missing()
        if missing is not None:
            raise ValueError(missing)
        if self.environment is not None:
            check_reference(self.environment, what=WHAT)  # found and read, never imported at plan time
        return self

    def user_modules(self) -> tuple[str, ...]:
        return (self.environment.partition(":")[0],) if self.environment is not None else ()


class OpenEnvInteraction(Interaction):
    type_name = "openenv"
    settings_class = OpenEnvSettings
    concurrent_replies = True  # each episode steps its own environment (instance or WebSocket session)

    def __init__(self, settings: OpenEnvSettings, tools=None):
        super().__init__(settings, tools)
        if tools is not None:
            raise ValueError("an OpenEnv env's tool is its action (action = \"tool_call\"); the env's `tools` are "
                             "not used")
        self.envs = InProcessEnvs(settings) if settings.url is None else ServedEnvs(settings)
        self.parse_calls = PARSERS[settings.parser]
        self._tool_schemas = ([action_tool(settings.tool_name, self.envs.action_schema())]
                              if settings.action == "tool_call" else None)
        # id(state) -> the episode's environment, and its example (an episode's state dict is its identity here)
        self._sessions: dict[int, Any] = {}
        self._examples: dict[int, Any] = {}

    @property
    def name(self) -> str:
        return self.envs.where

    @property
    def tool_schemas(self) -> list[dict] | None:
        return self._tool_schemas

    def begin(self, prompt: dict[str, Any], seed: int) -> tuple[dict[str, Any], list[dict[str, str]]]:
        state: dict[str, Any] = {"env_reward": None, "steps": 0, "action_errors": 0, "observation": None}
        self._examples[id(state)] = prompt.get("example_id")
        try:
            session = self._sessions[id(state)] = self.envs.open()
            observation, reward, _ = session.reset(seed)
            opening = self._render(observation)
        except OpenEnvFailure as exc:  # the model still takes its first turn; the episode then ends, failed
            self._fail(state, exc)
            return state, []
        self._observe(state, observation, reward)
        return state, [{"role": "user", "content": opening}]

    def respond(self, state: dict[str, Any], messages: list[dict]) -> EnvReply:
        if state.get("episode_error"):
            return EnvReply(done=True)
        session = self._sessions[id(state)]
        text = messages[-1]["content"]
        try:
            if self.settings.action == "json":
                return self._json_turn(state, session, text)
            return self._tool_turn(state, session, text, sum(m["role"] == "assistant" for m in messages))
        except OpenEnvFailure as exc:
            self._fail(state, exc)
            return EnvReply(done=True)

    def end(self, state: dict[str, Any]) -> None:
        self._examples.pop(id(state), None)
        session = self._sessions.pop(id(state), None)
        if session is not None:
            session.close()

    # -- one turn ---------------------------------------------------------------------------------------------

    def _json_turn(self, state: dict, session, text: str) -> EnvReply:
        action = first_json_object(text)
        if action is None:
            return self._refused(state, "error: no action: write one JSON object, the action")
        answer = self._step(state, session, action)
        if answer is None:
            return EnvReply(done=True)
        return EnvReply(messages=[{"role": "user", "content": answer[0]}])

    def _tool_turn(self, state: dict, session, text: str, turn: int) -> EnvReply:
        parsed = self.parse_calls(text)
        if not parsed.calls:
            return self._refused(state, f"error: no action: call the tool {self.settings.tool_name!r}")
        replies, structured, errors = [], [], 0
        for index, call in enumerate(parsed.calls):
            call_id = f"call_{turn}_{index}"
            if call.problem is None:
                structured.append({"id": call_id, "type": "function",
                                   "function": {"name": call.name, "arguments": call.arguments}})
            if call.problem is not None:
                state["action_errors"] += 1
                content, failed = f"error: {call.problem}", True
            elif call.name != self.settings.tool_name:
                state["action_errors"] += 1
                content = f"error: unknown tool {call.name!r}; the action is the tool {self.settings.tool_name!r}"
                failed = True
            else:
                answer = self._step(state, session, call.arguments)
                if answer is None:
                    return EnvReply(done=True)
                content, failed = answer
            errors += failed
            named = {"name": call.name} if call.name is not None else {}
            replies.append({"role": "tool", "tool_call_id": call_id, **named, "content": content})
        assistant = {"role": "assistant", "content": parsed.content, "tool_calls": structured}
        return EnvReply(messages=replies, assistant=assistant, tool_errors=errors)

    def _step(self, state: dict, session, action: dict) -> tuple[str, bool] | None:
        """(the observation's message, False) after stepping `action`; (an `error: ...` text, True) for an action
        the environment refuses; None when the episode is done."""
        try:
            observation, reward, done = session.step(action)
        except InvalidAction as refused:
            state["action_errors"] += 1
            return f"error: invalid action: {refused}", True
        state["steps"] += 1
        self._observe(state, observation, reward)
        return None if done else (self._render(observation), False)

    def _refused(self, state: dict, message: str) -> EnvReply:
        state["action_errors"] += 1
        return EnvReply(messages=[{"role": "user", "content": message}])

    def _observe(self, state: dict, observation: dict, reward: float | None) -> None:
        state["observation"] = observation
        if reward is not None:
            state["env_reward"] = (state["env_reward"] or 0.0) + float(reward)

    def _render(self, observation: dict) -> str:
        field = self.settings.observation_field
        if field is None:
            return json.dumps(observation, sort_keys=True)
        if field not in observation:
            raise OpenEnvFailure(f"{self.envs.where}: the observation has no field {field!r} "
                                 f"(interaction.observation_field); fields: {sorted(observation)}")
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    def _fail(self, state: dict, exc: OpenEnvFailure) -> None:
        state["episode_error"] = str(exc)
        log.warning("%s (example %r): the episode fails, its reward is missing", exc, self._examples.get(id(state)))


def first_json_object(text: str) -> dict | None:
    """The first JSON object written in `text` (`{"guess": 3}`, also inside prose or a code fence), or None."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start >= 0:
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            value = None
        if isinstance(value, dict):
            return value
        start = text.find("{", start + 1)
    return None


def action_tool(name: str, schema: dict) -> dict:
    """The action as one OpenAI function tool: its parameters the action's JSON schema, without OpenEnv's own
    `metadata` field (the model does not write it)."""
    properties = {key: value for key, value in schema.get("properties", {}).items() if key != "metadata"}
    parameters = {"type": "object", "properties": properties,
                  "required": [key for key in schema.get("required", []) if key in properties]}
    if "$defs" in schema:
        parameters["$defs"] = schema["$defs"]
    description = schema.get("description") or f"Act in the environment ({schema.get('title', 'action')})."
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def env_reward(item: Any) -> float:
    """The sum of the rewards the episode's environment gave (a reward function: RewardInput), named in an env's
    rewards as `function = "rollout_lib.envs.openenv_env:env_reward"`: 0.0 when the model never wrote an action the
    environment took (nothing earned); raises when the environment took actions and gave no reward for any."""
    reward = item.state.get("env_reward")
    if reward is None and item.state.get("steps") == 0:
        return 0.0
    if reward is None:
        raise ValueError("the OpenEnv environment gave no reward in this episode (every observation's reward was "
                         "None): score its episodes with reward functions of the env's own")
    return float(reward)
