"""Config errors that name their place as a dotted locator (`algorithm.rm.optimizer.lr: must be > 0`)."""

from __future__ import annotations

from pydantic import ValidationError


class ConfigError(ValueError):
    """A config problem; `str()` is one line per problem, each starting with its dotted locator."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(f"{prefix}{loc}: {msg}" for loc, msg in problems))


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


def _message(err: dict) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key (check the spelling; keys are never silently ignored)"
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


def from_validation_error(exc: ValidationError, source: str | None = None, prefix: tuple = ()) -> ConfigError:
    return ConfigError([(locator(prefix + tuple(e["loc"])), _message(e)) for e in exc.errors()], source)
