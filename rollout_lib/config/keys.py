"""Every key path an entry point's settings take (`algorithm.rm.optimizer.lr`), and the one an unknown key most
likely meant: `--set lr=1e-4` on an RM config is answered with `did you mean algorithm.rm.optimizer.lr?`."""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Sequence

from pydantic import BaseModel

ITEM = "[i]"  # a list item in a key path; a suggestion gets the user's own index back
_INDEX = re.compile(r"\[\d+\]")
LEAF_CUTOFF = 0.7  # difflib ratio a last key must reach: "lrr" -> "lr" is 0.8, "learning_rate" -> "lr" 0.27


def key_paths(cls: type[BaseModel], prefix: str = "") -> list[str]:
    """The dotted paths of every field of `cls` and of the settings classes below it (through optional, list and
    union fields; every member of a tagged union, so a key of another `type` is found too). Dicts are free-form."""
    paths = []
    for name, field in cls.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        paths.append(path)
        for model, in_list in _settings_classes(field.annotation):
            paths += key_paths(model, path + ITEM if in_list else path)
    return paths


def _settings_classes(annotation, in_list: bool = False) -> list[tuple[type[BaseModel], bool]]:
    """The settings classes an annotation holds, each with whether it is reached through a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, in_list)]
    origin = typing.get_origin(annotation)
    if origin is dict:
        return []
    if origin is typing.Annotated:
        return _settings_classes(typing.get_args(annotation)[0], in_list)
    listed = in_list or (isinstance(origin, type) and issubclass(origin, Sequence) and origin is not str)
    nested = origin in (typing.Union, types.UnionType)
    return [found for arg in typing.get_args(annotation)
            for found in _settings_classes(arg, in_list if nested else listed)]


def closest_key(unknown: str, paths: list[str]) -> str | None:
    """The valid path `unknown` most likely meant: among the paths whose last key is close to its last key, the one
    closest as a whole (so `lr` at the top finds `algorithm.rm.optimizer.lr`, and `optimizer.lrr` its sibling)."""
    typed = _INDEX.sub(ITEM, unknown)
    if typed in paths:  # a key of another union member (another algorithm `type`): its spelling is not the problem
        return None
    scored = sorted((_similarity(_leaf(typed), _leaf(path)), _similarity(typed, path), path) for path in paths)
    leaf_score, _, best = scored[-1] if scored else (0.0, 0.0, "")
    if leaf_score < LEAF_CUTOFF:
        return None
    indices = iter(_INDEX.findall(unknown))
    return re.sub(re.escape(ITEM), lambda _: next(indices, "[0]"), best)


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()
