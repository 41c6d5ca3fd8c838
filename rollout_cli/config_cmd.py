"""`rollout config show|schema`: the settings an entry point runs with, defaults filled in, and the schema they follow.

Imports only click at module level (`rollout --help` stays instant); the settings classes load inside the commands.
"""

from __future__ import annotations

import json

import click

ENTRY_POINTS = ("rm", "sft", "rl", "rlhf")
ALGORITHM_ENTRY_POINTS = ("rm", "sft", "rl")  # one [algorithm.<kind>] block each; rlhf composes them
CONFIG_KINDS = {"rm": "a train-rm config", "sft": "a train-sft config", "rl": "a train-rl config",
                "rlhf": "an rlhf pipeline config"}  # by the names of their flows
HIDDEN = "<hidden>"  # printed in place of storage_options' values (credentials) unless --show-secrets


def config_class(entry_point: str):
    """The settings class of an entry point (`rollout train <entry_point>`)."""
    from rollout_lib.config import RlConfig, RlhfConfig, RmConfig, SftConfig

    return {"rm": RmConfig, "sft": SftConfig, "rl": RlConfig, "rlhf": RlhfConfig}[entry_point]


def written_for(raw: dict) -> str | None:
    """The entry point a settings file is written for: `[algorithm] kind`, else its one `[algorithm.rm|sft|rl]`
    table; a file of `[sft]`, `[rm]`, `[rl]` stage tables is an rlhf pipeline. None when it cannot tell."""
    from rollout_lib.config.rlhf import STAGES

    algorithm = raw.get("algorithm")
    if isinstance(algorithm, dict):
        if algorithm.get("kind") in ALGORITHM_ENTRY_POINTS:
            return algorithm["kind"]
        named = [kind for kind in ALGORITHM_ENTRY_POINTS if kind in algorithm]
        if len(named) == 1:  # an unknown `kind` beside it is then the schema's error, named by its key
            return named[0]
    elif any(stage in raw for stage in STAGES):
        return "rlhf"
    return None


def load_settings(entry_point: str | None, config_path: str, overrides: list[str], command: str):
    """(entry point, validated settings) of `config_path` with `overrides`, for `command` (`rollout train`, ...).

    The entry point defaults to the one the file is written for; a file written for another one is refused in one
    line naming the command it is for (else the user would read the other schema's errors about every table)."""
    from rollout_lib.config import ConfigError, apply_overrides
    from rollout_lib.plan_checks import validate_config
    from rollout_lib.config.loading import read_toml
    from rollout_lib.errors import FILE
    from rollout_lib.paths import config_base_dir

    raw = read_toml(config_path)
    written = written_for(raw)  # the file as written: a --set (or --max-steps) must not change what it is for
    if entry_point is None and written is None:
        raise ConfigError([("<root>", "cannot tell the entry point: no [algorithm.rm], [algorithm.sft] or "
                                      "[algorithm.rl] table (or more than one), and no rlhf stages ([sft], [rm], "
                                      f"[rl]); name it: {command} {{rm|sft|rl|rlhf}} --config FILE")], config_path)
    if entry_point is not None and written not in (None, entry_point):
        raise ConfigError([(FILE, f"{CONFIG_KINDS[written]}: run {command} {written} --config {config_path}")],
                          config_path)
    entry_point = entry_point or written
    return entry_point, validate_config(config_class(entry_point), apply_overrides(raw, overrides), config_path,
                                        base_dir=config_base_dir(config_path))


@click.group("config")
def config_group() -> None:
    """Settings: resolved (defaults filled in) or their JSON schema."""


@config_group.command("show")
@click.argument("entry_point", required=False, metavar="[rm|sft|rl|rlhf]", type=click.Choice(ENTRY_POINTS))
@click.option("--config", "config_path", required=True, metavar="PATH", help="TOML settings file")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="override one setting (repeatable), as with `rollout train`")
@click.option("--format", "output_format", type=click.Choice(["toml", "json"]), default="toml", show_default=True)
@click.option("--show-secrets", is_flag=True, help="print storage_options' values (credentials) too")
def config_show(entry_point: str | None, config_path: str, overrides: tuple[str, ...], output_format: str,
                show_secrets: bool) -> None:
    """Print the settings `rollout train` runs with: file, overrides, defaults.

    ENTRY_POINT defaults to the one the file is written for. The TOML validates back to the same settings (with
    --show-secrets when storage_options are set); keys whose value is unset (None) are left out, as TOML has no null.
    rlhf prints the pipeline's own settings: `rollout config show --config <stage config>` shows a stage's.
    """
    # The same steps, and so the same errors, as `rollout train --dry-run`.
    entry_point, config = load_settings(entry_point, config_path, list(overrides), "rollout config show")
    settings = config.model_dump(mode="json")
    if not show_secrets:
        settings = _hide_storage_options(settings)
    if output_format == "json":
        print(json.dumps(settings, indent=2))
        return
    import tomli_w

    print(f"# rollout train {entry_point}: {config_path}{' with overrides' if overrides else ''}, defaults filled in")
    print(tomli_w.dumps(_without_none(settings)), end="")


@config_group.command("schema")
@click.argument("entry_point", metavar="{rm|sft|rl|rlhf}", type=click.Choice(ENTRY_POINTS))
def config_schema(entry_point: str) -> None:
    """Print the JSON schema of ENTRY_POINT's settings (pydantic's)."""
    print(json.dumps(config_class(entry_point).model_json_schema(), indent=2))


def _without_none(value):
    if isinstance(value, dict):
        return {key: _without_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_none(item) for item in value]
    return value


def _hide_storage_options(value):
    if isinstance(value, dict):
        return {key: ({name: HIDDEN for name in item} if key == "storage_options" and isinstance(item, dict)
                      else _hide_storage_options(item)) for key, item in value.items()}
    if isinstance(value, list):
        return [_hide_storage_options(item) for item in value]
    return value
