"""Parsers of the tool calls a model writes, one module per template family, registered by name (the `tools`
interaction's `parser`). A parser reads a model turn's decoded text (tool-call markup kept) and returns the turn's
content without its calls and each call: a well-formed one (a name and an arguments object) or the reason it is
not (its text is bad JSON, it has no name...), which the model is told as a tool error."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

from pydantic import AfterValidator


@dataclass(frozen=True)
class ParsedCall:
    name: str | None = None
    arguments: dict[str, Any] | None = None
    problem: str | None = None  # why the call is malformed (then name/arguments may be missing)


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the turn's text without its well-formed calls
    calls: list[ParsedCall] = field(default_factory=list)


Parser = Callable[[str], ParsedTurn]
PARSERS: dict[str, Parser] = {}


def register(name: str) -> Callable[[Parser], Parser]:
    def add(parser: Parser) -> Parser:
        if name in PARSERS and PARSERS[name] is not parser:
            raise TypeError(f"tool-call parser {name!r} is registered twice")
        PARSERS[name] = parser
        return parser

    return add


def known_parser(name: str) -> str:
    """`name`, when a parser is registered under it (a settings validator: ParserName)."""
    if name not in PARSERS:
        raise ValueError(f"no tool-call parser {name!r} (known: {', '.join(sorted(PARSERS))})")
    return name


ParserName = Annotated[str, AfterValidator(known_parser)]  # a `parser` setting


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
