"""An env's tools, imported: each function with the OpenAI schema the chat template shows the model.

A function named alone gets its schema from transformers' `get_json_schema` (type hints and a Google-style
docstring, as TRL builds its tools'); a schema given in the settings is used as written."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_lib.envs.tools.settings import WHAT, ToolSettings
from rollout_lib.reward.locate import import_reference


class ToolSetupError(ValueError):
    """A tool that cannot be used; `index` is its place in the env's `tools` (for the error's locator)."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {name, description, parameters}}

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.function)


@dataclass(frozen=True)
class Toolbox:
    tools: dict[str, Tool]  # by name, in the settings' order

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema for tool in self.tools.values()]

    @property
    def names(self) -> str:
        """For error messages the model reads: "calculate, search"."""
        return ", ".join(self.tools)


def build_toolbox(entries: Sequence[ToolSettings]) -> Toolbox:
    tools: dict[str, Tool] = {}
    for index, entry in enumerate(entries):
        try:
            function = import_reference(entry.import_path, what=WHAT)
        except ValueError as exc:
            raise ToolSetupError(index, str(exc)) from exc
        if not callable(function):
            raise ToolSetupError(index, f"{WHAT} {entry.import_path!r} is not callable")
        schema = (_schema_of(index, entry, function) if entry.function is None
                  else {"type": "function", "function": entry.function.model_dump(mode="json")})
        name = schema["function"]["name"]
        if name in tools:
            raise ToolSetupError(index, f"a second tool named {name!r}")
        tools[name] = Tool(name, function, schema)
    return Toolbox(tools)


def _schema_of(index: int, entry: ToolSettings, function: Callable) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(function)
    except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException, and others
        raise ToolSetupError(index, f"{WHAT} {entry.import_path!r}: no schema from its signature and docstring "
                                    f"({exc}); give type hints and a Google-style docstring with an Args section, "
                                    "or the schema: { type = \"function\", function = {...}, import_path = ... }"
                             ) from exc
    schema["function"].pop("return", None)  # what the model needs is the arguments; the result is whatever it is
    return schema
