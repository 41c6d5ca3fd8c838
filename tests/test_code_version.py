"""The code version in cache keys covers the code a task can run, and only that: editing RL code leaves reward-model
caches alone, editing a user's reward function re-scores."""

from __future__ import annotations

import sys

from rollout_lib.identity.code import PROJECT_ROOT, import_closure


def closure(module: str) -> set[str]:
    return {path.relative_to(PROJECT_ROOT).as_posix() for path in import_closure(module)}


def test_a_reexporting_package_leads_only_to_the_modules_whose_names_are_used():
    rm = closure("tasks.rm")
    # `from rollout_lib.config import RmConfig` reaches config/rm.py through the package's __init__ ...
    assert {"rollout_lib/config/__init__.py", "rollout_lib/config/rm.py", "rollout_lib/rm/trainer.py",
            "rollout_lib/store.py", "rollout_lib/trainer/segment.py"} <= rm
    # ... but not the RL and SFT settings that __init__ also imports, nor any RL code.
    assert not {path for path in rm if path.startswith(("rollout_lib/config/rl", "rollout_lib/config/sft",
                                                        "rollout_lib/rl", "rollout_lib/sft", "rollout_lib/algo",
                                                        "rollout_lib/sampling", "rollout_lib/reward"))}


def test_the_rl_closure_has_the_reward_worker_that_the_pool_starts_by_name():
    expected = {"rollout_lib/reward/pool.py", "rollout_lib/reward/worker.py", "rollout_lib/config/rl.py"}
    assert expected <= closure("tasks.rl")


def test_a_name_defined_in_a_package_init_brings_in_everything_that_init_imports(tmp_path, monkeypatch):
    monkeypatch.setattr("rollout_lib.identity.code.PROJECT_ROOT", tmp_path)
    monkeypatch.setattr("rollout_lib.identity.code.PROJECT_PACKAGES", ("probe_pkg", "probe_user"))
    package = tmp_path / "probe_pkg"
    package.mkdir()
    (package / "sub.py").write_text("X = 1\n")
    (package / "other.py").write_text("Y = 2\n")
    (package / "__init__.py").write_text("from probe_pkg.sub import X\nfrom .other import Y\n\n"
                                         "def helper():\n    return Y\n")
    user = tmp_path / "probe_user.py"

    user.write_text("from probe_pkg import X\n")  # a re-export: only where X comes from
    assert {p.name for p in import_closure("probe_user")} == {"probe_user.py", "__init__.py", "sub.py"}
    user.write_text("from probe_pkg import helper\n")  # defined in __init__: all it imports
    assert {p.name for p in import_closure("probe_user")} == {"probe_user.py", "__init__.py", "sub.py", "other.py"}
    user.write_text("import probe_pkg.other\n")  # a submodule: its parent's __init__ text, not its imports
    assert {p.name for p in import_closure("probe_user")} == {"probe_user.py", "__init__.py", "other.py"}


def test_editing_a_user_reward_function_changes_the_score_key(tmp_path, monkeypatch):
    from rollout_lib.config import RlConfig
    from rollout_lib.plan_checks import load_config
    from rollout_lib.identity.sources import reward_sources

    (tmp_path / "my_rewards.py").write_text("def score(inp):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    builtin = 'function = "target_length"\nkwargs = { target = 12, unit = "words" }'
    toml = (PROJECT_ROOT / "configs/rl-tiny.toml").read_text().replace(builtin, 'function = "my_rewards:score"')
    assert "my_rewards:score" in toml
    (tmp_path / "rl.toml").write_text(toml.replace('"data/', f'"{PROJECT_ROOT}/data/'))
    config = load_config(RlConfig, str(tmp_path / "rl.toml"))
    before = reward_sources(config)
    assert set(before["reward_sources"]) == {"my_rewards:score"}
    (tmp_path / "my_rewards.py").write_text("def score(inp):\n    return 0.5\n")
    after = reward_sources(config)
    assert after != before
    sys.modules.pop("my_rewards", None)
