"""One entry of an env's `tools`: a Python function by import path, its schema made from its signature and
Google-style docstring (`"pkg.module:function"`), or an OpenAI function schema with the function implementing it
(`{ type = "function", function = { name, description, parameters }, import_path = "pkg.module:function" }`).

Checked at plan time without importing the function's module (reward/locate.py: found, its top-level `def` seen);
imported, and its schema made, when the env's episodes first run (toolbox.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_lib.reward.locate import check_reference

WHAT = "tool function"
_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$"  # what OpenAI accepts as a function name


class FunctionSchema(BaseModel):
    """The `function` part of an OpenAI tool schema: what the model is shown."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_NAME)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    @model_validator(mode="after")
    def _parameters_are_an_object(self) -> "FunctionSchema":
        if self.parameters.get("type") != "object":
            raise ValueError('parameters is a JSON schema of the arguments object: { type = "object", properties '
                             '= {...}, required = [...] }')
        return self


class ToolSettings(BaseModel):
    """A tool: `import_path` alone (written as a string), or with the schema (`type = "function"`, `function`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] | None = Field(None, exclude_if=lambda value: value is None)
    function: FunctionSchema | None = Field(None, exclude_if=lambda value: value is None)
    import_path: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _a_string_is_an_import_path(cls, value: Any) -> Any:
        return {"import_path": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _found_without_running_it(self) -> "ToolSettings":
        if (self.type is None) != (self.function is None):
            raise ValueError('a tool schema is { type = "function", function = { name, description, parameters }, '
                             'import_path = "pkg.module:function" }')
        check_reference(self.import_path, what=WHAT)
        return self

    @property
    def name(self) -> str:
        """What the model calls it: the schema's name, else the function's."""
        return self.function.name if self.function is not None else self.import_path.rpartition(":")[2].split(".")[-1]

    @property
    def module(self) -> str:
        return self.import_path.partition(":")[0]
