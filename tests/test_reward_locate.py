"""Plan time (`--dry-run`, config validation) checks a user's reward function reference without running the user's
module: found where the import system would find it, its source parsed for the top-level name and its kwargs."""

from __future__ import annotations

import json

import pytest

from clirun import run_rollout
from rollout_lib.reward.functions import check_reward_function
from rollout_lib.reward.locate import check_reference, find_module_spec

# Top-level code that must never run at plan time: it writes a marker file next to the module.
MARKER_CODE = "import pathlib\npathlib.Path(__file__).with_name('{name}.ran').write_text('imported')\n"


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """`marker_rewards` (a module) and `marker_pkg.rewards` (in a package whose __init__ also leaves a marker)."""
    (tmp_path / "marker_rewards.py").write_text(
        MARKER_CODE.format(name="marker_rewards")
        + "\ndef score(inp, *, bonus=0.0):\n    return 1.0 + bonus\n"
        + "\nasync def judge(inp, **options):\n    return 1.0\n"
        + "\ntry:\n    from fast_scores import length as length_score\nexcept ImportError:\n"
        + "    def length_score(inp):\n        return 0.0\n")
    package = tmp_path / "marker_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(MARKER_CODE.format(name="marker_pkg"))
    (package / "rewards.py").write_text(MARKER_CODE.format(name="rewards") + "\nclass Scorer:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    assert not list(tmp_path.rglob("*.ran")), "a user module's top-level code ran at plan time"


def test_a_defined_function_passes_without_running_its_module(user_modules):
    check_reference("marker_rewards:score", {"bonus": 1.0})
    check_reference("marker_rewards:judge", {"anything": 1})  # **options takes any kwarg
    check_reference("marker_rewards:length_score")  # bound in a top-level try/except
    check_reference("marker_pkg.rewards:Scorer")  # the package's __init__ does not run either
    assert find_module_spec("marker_pkg.rewards").origin == str(user_modules / "marker_pkg" / "rewards.py")


def test_what_is_wrong_is_named_with_the_reference(user_modules):
    with pytest.raises(ValueError) as missing:
        check_reference("marker_rewards:nope")
    assert str(missing.value) == (f"reward function 'marker_rewards:nope': 'marker_rewards' "
                                  f"({user_modules / 'marker_rewards.py'}) defines no top-level 'nope'")
    with pytest.raises(ValueError, match=r"^reward function 'marker_rewards:score': bad kwargs \['bonsu'\]: "
                                         r"score\(\) takes no parameter 'bonsu'$"):
        check_reference("marker_rewards:score", {"bonsu": 1.0})
    with pytest.raises(ValueError, match="^reward function 'no_such_module_xyz:f': cannot find module "
                                         "'no_such_module_xyz' on the Python path$"):
        check_reference("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="cannot find module 'marker_rewards.sub'"):
        check_reference("marker_rewards.sub:f")  # a module has no submodules


def test_builtins_are_still_resolved(user_modules):
    check_reward_function("target_length", {"target": 3})
    with pytest.raises(ValueError, match="bad kwargs"):
        check_reward_function("target_length", {"targt": 3})
    check_reward_function("marker_rewards:score")


def rl_dry_run(user_modules, function: str):
    return run_rollout("train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run",
                       "--set", f'algorithm.rl.envs[0].rewards[0].function="{function}"',
                       "--set", "algorithm.rl.envs[0].rewards[0].kwargs={}", PYTHONPATH=str(user_modules))


def test_dry_run_does_not_import_the_reward_module(user_modules):
    done = rl_dry_run(user_modules, "marker_rewards:score")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["envs"][0]["rewards"] == ["marker_rewards:score"]


def test_dry_run_names_a_missing_attribute_by_its_locator(user_modules):
    done = rl_dry_run(user_modules, "marker_rewards:nope")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("rollout: error: configs/rl-tiny.toml: algorithm.rl.envs[0].rewards[0].function: "
                           f"reward function 'marker_rewards:nope': 'marker_rewards' "
                           f"({user_modules / 'marker_rewards.py'}) defines no top-level 'nope'\n")
