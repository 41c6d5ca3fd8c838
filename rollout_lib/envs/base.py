"""Multi-turn environments: after each model turn the environment answers (a tool result, feedback) or ends the
episode.

An env of a train-rl run is single-turn unless it names an interaction (`interaction = { type = "calculator",
max_turns = 3 }`): then each sampled completion is an episode that alternates model turns and environment
messages until the interaction says it is done, the model's turn ends without its stop token (cut at
`sampling.max_tokens`), or the model has taken `max_turns` turns. The episode driver (`episodes.py`) keeps the
whole token sequence and says which tokens the policy sampled and which the environment wrote, under which role
(wire.ROLLOUTS `completion_turns`).

An interaction is one class with its settings class, registered by a `type` name like the algorithms (a module
in this package, or `{ type = "custom", import_path = "pkg.module:Class", kwargs = {...} }` for one of the
user's). Its contract (`Interaction` below; docs/environments.md): `start(prompt)` a JSON-serialisable state,
`respond(state, messages)` the next messages or `done`, deterministic in (state, messages), never executing text
the model wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field


class InteractionSettings(BaseModel):
    """Settings of one interaction; subclasses set `type: Literal["<name>"] = "<name>"` and their own knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = Field(4, ge=1)  # model turns per episode; the environment does not answer the last one

    def user_modules(self) -> tuple[str, ...]:
        """Modules outside the project whose source decides the episodes (a user class named by import path)."""
        return ()

    def user_files(self) -> tuple[str, ...]:
        """Files (not modules) whose content decides the episodes: an agent program's script."""
        return ()


@dataclass(frozen=True)
class EnvReply:
    """What the environment writes after a model turn: messages for the model to read before its next turn, or
    `done` to end the episode (then `messages` must be empty).

    A message is {role, content}; a tool result also names its call: {"role": "tool", "tool_call_id", "name",
    "content"}. `assistant`: the model's last turn re-read with the calls it made, {"role": "assistant", "content",
    "tool_calls": [{id, type: "function", function: {name, arguments: {...}}}]}, so the chat template renders that
    turn as a tool-calling one (its tokens stay as sampled: only what follows them is rendered). `tool_errors`: how
    many of the tool messages report a call that failed (counted in the step's metrics)."""

    messages: list[dict[str, str]] = field(default_factory=list)
    done: bool = False
    assistant: dict[str, Any] | None = None
    tool_errors: int = 0

    def __post_init__(self) -> None:
        if self.done and self.messages:
            raise ValueError("an EnvReply that ends the episode writes no messages")
        if not self.done and not self.messages:
            raise ValueError("an EnvReply that continues the episode writes at least one message")
        for message in self.messages:
            _check_message(message)
        if self.assistant is not None:
            _check_assistant(self.assistant)
        if not 0 <= self.tool_errors <= sum(message["role"] == "tool" for message in self.messages):
            raise ValueError(f"tool_errors ({self.tool_errors}) counts some of the reply's tool messages")


_TOOL_KEYS = {"tool_call_id", "name"}


def _check_message(message: Any) -> None:
    allowed = {"role", "content"} | (_TOOL_KEYS if isinstance(message, dict) and message.get("role") == "tool"
                                     else set())
    if (not isinstance(message, dict) or not {"role", "content"} <= set(message) <= allowed
            or not all(isinstance(v, str) for v in message.values())):
        raise ValueError(f"an env message is {{'role': str, 'content': str}} (a tool message may add "
                         f"'tool_call_id' and 'name'), got {message!r}")


def _check_assistant(message: Any) -> None:
    shape = ("{'role': 'assistant', 'content': str, 'tool_calls': [{'id': str, 'type': 'function', 'function': "
             "{'name': str, 'arguments': dict}}]}")
    if (not isinstance(message, dict) or set(message) != {"role", "content", "tool_calls"}
            or message["role"] != "assistant" or not isinstance(message["content"], str)
            or not isinstance(message["tool_calls"], list)):
        raise ValueError(f"EnvReply.assistant is {shape}, got {message!r}")
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(call, dict) or set(call) != {"id", "type", "function"} or not isinstance(call["id"], str)
                or call["type"] != "function"
                or not isinstance(function, dict) or set(function) != {"name", "arguments"}
                or not isinstance(function["name"], str) or not isinstance(function["arguments"], dict)):
            raise ValueError(f"EnvReply.assistant is {shape}, got the call {call!r}")


class Interaction:
    """One env's turn-taking; subclasses set `type_name`, `settings_class` and define `respond` (and `start`)."""

    type_name: ClassVar[str]
    settings_class: ClassVar[type[InteractionSettings]]
    # An interaction that runs its own episodes (an agent: envs/agent.py) defines `run_episodes`, taking what
    # episodes.run_episodes takes after the interaction; the others are driven turn by turn by episodes.py.
    drives_itself: ClassVar[bool] = False
    # True: the driver asks for a turn's replies of all its episodes at once, on threads (an environment whose
    # replies wait on a server or a sleep, each episode its own session: OpenEnv). False: one at a time, in order.
    concurrent_replies: ClassVar[bool] = False

    def __init__(self, settings: InteractionSettings, tools: Any = None):
        if not isinstance(settings, self.settings_class):
            raise TypeError(f"{type(self).__name__} takes {self.settings_class.__name__}, "
                            f"got {type(settings).__name__}")
        self.settings = settings
        self.tools = tools  # the env's tools (envs.tools.Toolbox), or None

    @property
    def tool_schemas(self) -> list[dict] | None:
        """The env's tools as the chat template takes them (`apply_chat_template(tools=...)`); None without tools."""
        return self.tools.schemas if self.tools is not None else None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "type_name" in cls.__dict__:
            declared = cls.settings_class.model_fields.get("type")
            if declared is None or declared.default != cls.type_name:
                raise TypeError(f"{cls.settings_class.__name__} must declare `type: Literal[{cls.type_name!r}] = "
                                f"{cls.type_name!r}`")
            if cls.type_name in INTERACTIONS and INTERACTIONS[cls.type_name] is not cls:
                raise TypeError(f"interaction type {cls.type_name!r} is registered twice")
            INTERACTIONS[cls.type_name] = cls

    @property
    def name(self) -> str:
        """What errors call it."""
        return type(self).__name__

    def start(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """The initial state of an episode on `prompt` (a PROMPTS row: messages, answer, info parsed to a dict)."""
        return {}

    def begin(self, prompt: dict[str, Any], seed: int) -> tuple[dict[str, Any], list[dict[str, str]]]:
        """What the driver calls to open an episode: `start(prompt)`, and the messages the environment writes before
        the model's first turn (an env's first observation; appended to the prompt's messages and rendered with
        them by the chat template). `seed` derives from the step's seed and the example, so every episode of a
        group starts from the same draw and a rerun replays it. Most interactions only define `start`."""
        return self.start(prompt), []

    def end(self, state: dict[str, Any]) -> None:
        """The episode is over, whatever ended it (called once, before it is recorded): release what it holds."""

    def respond(self, state: dict[str, Any], messages: list[dict[str, str]]) -> EnvReply:
        """The environment's answer to the model's last turn (`messages[-1]`), or EnvReply(done=True); it may update
        `state` in place. It sees every turn that ended with the stop token, the last allowed one too (its reply then
        dropped: keep the score in `state`); a turn cut at max_tokens ends the episode unseen."""
        raise NotImplementedError


INTERACTIONS: dict[str, type[Interaction]] = {}
