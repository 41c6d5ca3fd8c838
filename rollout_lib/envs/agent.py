"""An agent as an env: `interaction = { type = "agent", import_path = "pkg.module:function", kwargs = {...},
timeout_s = 60, max_requests = 16 }`, or a program in place of the function: `command = ["prog", "arg", ...]`
(agent_program.py: its endpoint in OPENAI_BASE_URL, the task on stdin, its reward on stdout).

The function is called once per episode as `function(base_url, task, **kwargs)` (sync or async): `base_url` is an
OpenAI-compatible endpoint served by rollout for the step (agent_server.py) and backed by the step's sampler, `task`
the prompt row (example_id, messages, answer, info). It talks to the policy through chat completions as many times
as it likes (at most `max_requests`), and returns a float reward, or None to leave scoring to the env's reward
functions (they read the episode's conversation and its state). The env's rewards are still required: with an agent
that scores, name `rollout_lib.envs.agent:agent_reward`, which reads the reward the agent returned.

An agent that raises, runs past `timeout_s`, or returns something else fails its episode (a missing reward, never
0). Seeds derive from (step seed, example, group index, request index), so a deterministic agent replays on a
rerun; its module's source enters the sample stage's cache key. In full: docs/environments.md.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rollout_lib.envs.agent_program import AgentProgram
from rollout_lib.envs.base import Interaction, InteractionSettings
from rollout_lib.envs.tools.parsers import ParserName
from rollout_lib.reward.locate import check_reference, import_reference

WHAT = "agent function"


class AgentSettings(InteractionSettings):
    type: Literal["agent"] = "agent"
    max_turns: int = Field(4, ge=1, exclude=True)  # inherited, unused and refused as a key (_no_turn_limit)
    # Exactly one of: a function, "package.module:function"; a program, its arguments (never run through a shell).
    import_path: str | None = Field(None, min_length=1, exclude_if=lambda value: value is None)
    command: list[str] | None = Field(None, min_length=1, exclude_if=lambda value: value is None)
    kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to the function after (base_url, task)
    timeout_s: float = Field(60.0, gt=0)  # per episode: past it the episode fails (counted), the step goes on
    max_requests: int = Field(16, ge=1)  # chat completions per episode; more are refused (HTTP 429)
    parser: ParserName = "hermes"  # how tool calls are read from sampled text when a request gives `tools`

    @model_validator(mode="before")
    @classmethod
    def _no_turn_limit(cls, value: Any) -> Any:
        if isinstance(value, dict) and "max_turns" in value:  # inherited, but the agent decides its own turns
            raise ValueError("an agent's episodes are bounded by max_requests (and timeout_s), not max_turns")
        return value

    @model_validator(mode="after")
    def _found_without_running_it(self) -> "AgentSettings":
        if (self.import_path is None) == (self.command is None):
            raise ValueError("an agent is a function (import_path = \"pkg.module:function\") or a program "
                             "(command = [\"program\", \"arg\", ...]): give exactly one")
        if self.command is not None:
            check_program(self.command)
        else:
            check_reference(self.import_path, self.kwargs, what=WHAT)  # found and read, never imported at plan time
        return self

    def user_modules(self) -> tuple[str, ...]:
        return () if self.import_path is None else (self.import_path.partition(":")[0],)

    def user_files(self) -> tuple[str, ...]:
        """The files a program's arguments name (its script, say): their content decides the episodes. The program
        itself counts when it is a script (`#!`); an interpreter or a compiled program is named, not read."""
        if self.command is None:
            return ()
        return tuple(argument for index, argument in enumerate(self.command)
                     if Path(argument).is_file() and (index > 0 or _is_script(Path(argument))))


def check_program(command: list[str]) -> None:
    """The program can be run (an executable file, or a name on PATH), checked without running it."""
    if shutil.which(command[0]) is None:
        raise ValueError(f"agent program {command[0]!r} cannot be run: not an executable file"
                         f"{'' if os.sep in command[0] else ' nor a name on PATH'} (command[0])")


def _is_script(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            return file.read(2) == b"#!"
    except OSError:  # unreadable: named by its path only (running it would report what is wrong)
        return False


class AgentDriven(Interaction):
    """An interaction whose episodes the agent driver runs (agent_episodes.py), its `agent` deciding each turn
    rather than the turn-by-turn driver."""

    drives_itself: ClassVar[bool] = True

    def run_episodes(self, generate, tokenizer, prompt_rows, prompt_ids, params, seed, stop_ids,
                     context_limit=None, on_end=None):
        from rollout_lib.envs.agent_episodes import run_agent_episodes

        return run_agent_episodes(self, generate, tokenizer, prompt_rows, prompt_ids, params, seed, stop_ids,
                                  context_limit, on_end)


class AgentInteraction(AgentDriven):
    """A user's agent function, called once per episode."""

    type_name = "agent"
    settings_class = AgentSettings

    def __init__(self, settings: AgentSettings, tools=None):
        super().__init__(settings, tools)
        if tools is not None:
            raise ValueError("an agent sends its own `tools` with each request; the env's `tools` are not used")
        if settings.command is not None:
            self.agent = AgentProgram(settings.command).run
            return
        self.agent = import_reference(settings.import_path, what=WHAT)
        if not callable(self.agent):
            raise TypeError(f"{WHAT} {settings.import_path!r} is not callable")

    @property
    def name(self) -> str:
        if self.settings.command is not None:
            return " ".join(self.settings.command)
        return getattr(self.agent, "__name__", self.settings.import_path)


def agent_reward(item: Any) -> float:
    """The reward the episode's agent returned: a reward function (RewardInput), named in an env's rewards as
    `function = "rollout_lib.envs.agent:agent_reward"`. Raises when the agent left scoring to the env (returned
    None): then name reward functions of your own."""
    reward = item.state.get("agent_reward")
    if reward is None:
        raise ValueError("the agent returned no reward (None): score its episodes with reward functions of "
                         "the env's own")
    return float(reward)
