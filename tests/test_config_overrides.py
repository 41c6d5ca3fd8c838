"""Overrides reach list items by index (`algorithm.rl.envs[0].sampling.group_size=4`), with `--set` and as a
deployment's `overrides`; errors inside lists name their index, and a bad index is an error naming the path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clirun import run_rollout
from rollout_lib.config import ConfigError, RlConfig, RmConfig, apply_overrides
from rollout_lib.plan_checks import load_config
from rollout_lib.config.keys import closest_key, key_paths
from rollout_lib.config.loading import parse_override

ROOT = Path(__file__).resolve().parent.parent
RL_TINY = ROOT / "configs/rl-tiny.toml"
RAW = {"a": {"envs": [{"s": {"g": 1}}, {"s": {"g": 2}}], "x": 3}}


def override_error(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        apply_overrides(RAW, list(overrides))
    return str(info.value)


def test_an_index_reaches_the_item_and_the_key_is_kept_as_typed():
    assert parse_override("a.envs[1].s.g=4") == (["a", "envs[1]", "s", "g"], 4)
    assert apply_overrides(RAW, ["a.envs[1].s.g=4"]) == {"a": {"envs": [{"s": {"g": 1}}, {"s": {"g": 4}}], "x": 3}}
    assert apply_overrides(RAW, {"a.envs[0].s": {"g": 9}})["a"]["envs"][0] == {"s": {"g": 9}}  # dict form
    assert RAW["a"]["envs"][1] == {"s": {"g": 2}}  # the input is never changed


def test_bad_paths_are_errors_naming_them():
    assert override_error("a.envs[2].s.g=1") == "a.envs[2]: index out of range: a.envs has 2 item(s)"
    assert override_error("a.envs.s=1") == "a.envs: is a list; name an item first, e.g. a.envs[0].s"
    assert override_error("a.x[0]=1") == "a.x: is not a list; [index] can only name a list item"
    assert override_error("a.nope[0].g=1") == ("a.nope: is not in the config: [index] can only reach an existing "
                                               "list item")
    assert override_error("a.x.y=1") == "a.x: is a value, not a table; cannot override inside it"
    for key in ("a.envs[-1]", "a.envs[x]", "a.envs[0]b", "a..b"):
        assert override_error(f"{key}=1").startswith(f"{key}: override key must be a dotted path")


def test_set_reaches_an_env_and_validation_names_the_index():
    config = load_config(RlConfig, RL_TINY, ["algorithm.rl.envs[0].sampling.group_size=4"])
    assert config.settings.envs[0].sampling.group_size == 4
    with pytest.raises(ConfigError) as info:
        load_config(RlConfig, RL_TINY, ["algorithm.rl.envs[0].sampling.group_size=0",
                                        "algorithm.rl.envs[0].rewards[0].weight=\"heavy\""])
    assert str(info.value).splitlines() == [
        f"{RL_TINY}: algorithm.rl.envs[0].rewards[0].weight: Input should be a valid number, unable to parse string "
        "as a number (got 'heavy')",
        f"{RL_TINY}: algorithm.rl.envs[0].sampling.group_size: must be >= 1 (got 0)",
    ]


def test_a_deployment_override_reaches_an_env():
    from flows.common import load_run_config  # what every flow calls with its `overrides` parameter

    config = load_run_config(RlConfig, str(RL_TINY), ["algorithm.rl.envs[0].sampling.group_size=3"], 5,
                             "algorithm.rl.budget.max_steps")
    assert (config.settings.envs[0].sampling.group_size, config.settings.budget.max_steps) == (3, 5)
    config = load_run_config(RlConfig, str(RL_TINY), {"algorithm.rl.envs[0].sampling.group_size": 2}, None,
                             "algorithm.rl.budget.max_steps")
    assert config.settings.envs[0].sampling.group_size == 2


def test_the_cli_dry_run_takes_an_index_and_names_a_bad_one():
    done = run_rollout("train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run",
                       "--set", "algorithm.rl.envs[0].sampling.group_size=4")
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)
    assert plan["envs"][0]["sampling"]["group_size"] == 4 and plan["envs"][0]["rollouts_per_step"] == 16

    failed = run_rollout("train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run",
                         "--set", "algorithm.rl.envs[1].sampling.group_size=4")
    assert (failed.returncode, failed.stdout) == (2, "")
    assert failed.stderr == ("rollout: error: algorithm.rl.envs[1]: index out of range: algorithm.rl.envs has "
                             "1 item(s)\n")


# --- an unknown key names the key it most likely meant --------------------------------------------------------


def unknown_key_error(cls, config: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cls, config, list(overrides))
    return str(info.value)


def test_a_misspelled_set_key_suggests_the_closest_key_path():
    rm_tiny = ROOT / "configs/rm-tiny.toml"
    # A bare last key finds its full path; a typo finds its sibling; a misspelled table, the table.
    assert unknown_key_error(RmConfig, rm_tiny, "lr=1e-4") == (
        f"{rm_tiny}: lr: unknown key; did you mean algorithm.rm.optimizer.lr?")
    assert unknown_key_error(RmConfig, rm_tiny, "algorithm.rm.optimizer.lrr=1e-4") == (
        f"{rm_tiny}: algorithm.rm.optimizer.lrr: unknown key; did you mean algorithm.rm.optimizer.lr?")
    assert unknown_key_error(RmConfig, rm_tiny, "algorithm.rm.optimiser.lr=1e-4").endswith(
        "algorithm.rm.optimiser: unknown key; did you mean algorithm.rm.optimizer?")
    # Inside a list, the suggestion keeps the item the user named.
    assert unknown_key_error(RlConfig, RL_TINY, "algorithm.rl.envs[0].sampling.group_sise=2").endswith(
        "algorithm.rl.envs[0].sampling.group_sise: unknown key; did you mean algorithm.rl.envs[0].sampling.group_size?")
    # Nothing close: the plain message, still one line naming the key.
    assert unknown_key_error(RmConfig, rm_tiny, "frobnicate=1") == (
        f"{rm_tiny}: frobnicate: unknown key (check the spelling; keys are never silently ignored)")


def test_key_paths_reach_through_lists_and_unions_and_a_suggestion_is_never_the_key_itself():
    paths = key_paths(RlConfig)
    assert {"run.store", "algorithm.rl.optimizer.lr", "algorithm.rl.envs[i].sampling.group_size"} <= set(paths)
    assert not any(path.startswith("run.storage_options.") for path in paths)  # a dict's keys are free-form
    assert closest_key("group_size", paths) == "algorithm.rl.envs[0].sampling.group_size"  # an index filled in
    assert closest_key("algorithm.rl.envs[2].sampling.group_size", paths) is None  # valid elsewhere: no advice
