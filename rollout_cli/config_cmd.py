"""`rollout config show|schema`: the settings an entry point runs with, defaults filled in, and the schema they follow.

Imports only click at module level (`rollout --help` stays instant); the settings classes load inside the commands.
"""

from __future__ import annotations

import json

import click

ENTRY_POINTS = ("rm", "sft", "rl", "rlhf")
ALGORITHM_ENTRY_POINTS = ("rm", "sft", "rl")  # one [algorithm.<kind>] block each; rlhf composes them
HIDDEN = "<hidden>"  # printed in place of storage_options' values (credentials) unless --show-secrets


def config_class(entry_point: str):
    """The settings class of an entry point (`rollout train <entry_point>`)."""
    from rollout_lib.config import RlConfig, RlhfConfig, RmConfig, SftConfig

    return {"rm": RmConfig, "sft": SftConfig, "rl": RlConfig, "rlhf": RlhfConfig}[entry_point]


def infer_entry_point(raw: dict, source: str) -> str:
    """The entry point a settings file is written for: `[algorithm] kind`, else its one `[algorithm.rm|sft|rl]`
    table; a file of `[sft]`, `[rm]`, `[rl]` stage tables is an rlhf pipeline."""
    from rollout_lib.config import ConfigError
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
    problem = ("cannot tell the entry point: no [algorithm.rm], [algorithm.sft] or [algorithm.rl] table (or more "
               "than one), and no rlhf stages ([sft], [rm], [rl]); name it: rollout config show {rm|sft|rl|rlhf} "
               "--config FILE")
    raise ConfigError([("<root>", problem)], source)


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
    from rollout_lib.config import apply_overrides, validate_config
    from rollout_lib.config.loading import read_toml

    # The same steps, and so the same errors, as `rollout train --dry-run` (load_config), with the entry point
    # read off the overridden file when not given.
    raw = apply_overrides(read_toml(config_path), list(overrides))
    entry_point = entry_point or infer_entry_point(raw, config_path)
    config = validate_config(config_class(entry_point), raw, source=config_path)
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
