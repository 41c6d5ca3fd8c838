"""Config errors that name their place as a dotted locator (`algorithm.rm.optimizer.lr: must be > 0`)."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

UNKNOWN_KEY = "unknown key (check the spelling; keys are never silently ignored)"
FILE = ""  # the locator of a problem with the file itself (not found, not TOML): the source alone names the place


class ConfigError(ValueError):
    """A config problem; `str()` is one line per problem, each starting with its dotted locator."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(f"{prefix}{loc}: {msg}" if loc else f"{prefix}{msg}" for loc, msg in problems))


def locator(loc: tuple) -> str:
    """`("algorithm", "rl", "envs", 0, "sampling")` -> `algorithm.rl.envs[0].sampling`."""
    # pydantic puts union-member tags (e.g. "function-after[...]", "jsonl_path") into locs; keep only
    # the field names and list indices a user wrote.
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif "[" in str(part) or "(" in str(part):
            continue
        else:
            parts.append(("." if parts else "") + str(part))
    return "".join(parts) or "<root>"


def _message(err: dict, where: str, suggest: Callable[[str], str | None]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        meant = suggest(where)
        return f"unknown key; did you mean {meant}?" if meant else UNKNOWN_KEY
    if kind == "missing":
        return "required key is missing"
    msg = err["msg"]
    if kind == "value_error" and msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if kind == "greater_than":
        msg = f"must be > {err['ctx']['gt']}"
    elif kind == "greater_than_equal":
        msg = f"must be >= {err['ctx']['ge']}"
    elif kind == "less_than_equal":
        msg = f"must be <= {err['ctx']['le']}"
    elif kind == "less_than":
        msg = f"must be < {err['ctx']['lt']}"
    return f"{msg} (got {err['input']!r})" if kind not in ("missing",) and not isinstance(err.get("input"), dict) else msg


def from_validation_error(exc: ValidationError, source: str | None = None, prefix: tuple = (),
                          suggest: Callable[[str], str | None] = lambda key: None) -> ConfigError:
    """`suggest(an unknown key's locator)`: the valid key it most likely meant, or None."""
    problems = []
    for error in exc.errors():
        where = locator(prefix + tuple(error["loc"]))
        problems.append((where, _message(error, where, suggest)))
    return ConfigError(problems, source)
