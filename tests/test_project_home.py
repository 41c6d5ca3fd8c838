"""One project, whatever the working directory: a config's relative paths resolve from its project's root (the
nearest directory above it with a prefect.yaml), rollout's home (the Prefect server, the stack, served models) is
that project's `.rollout` unless ROLLOUT_HOME says otherwise, and where a checkout lives never enters an identity."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from clirun import ROOT, run_cli
from rollout_lib.config import RlConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.paths import config_base_dir, default_home, project_root


def cli(*args: str, cwd, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("ROLLOUT_STATE_DIR", "ROLLOUT_HOME")}
    return run_cli(list(args), cwd=cwd, env={**environment, **env}, stdin=subprocess.DEVNULL, timeout=120)


def test_the_home_is_the_project_s_from_any_directory_inside_it_or_outside(tmp_path):
    assert project_root(ROOT / "configs") == ROOT and config_base_dir(ROOT / "configs/rm-tiny.toml") == ROOT
    assert default_home(ROOT / "rollout_lib" / "config") == ROOT / ".rollout"
    # Outside any project: the checkout rollout runs from.
    assert project_root(tmp_path) is None and default_home(tmp_path) == ROOT / ".rollout"
    # A directory with a prefect.yaml is a project of its own, with its own home.
    (tmp_path / "prefect.yaml").write_text("name: mine\n")
    (tmp_path / "sub").mkdir()
    assert default_home(tmp_path / "sub") == tmp_path / ".rollout"
    # `rollout stack status` names the home it reports on: the same from the project root, from a subdirectory of
    # it and from elsewhere; ROLLOUT_HOME wins.
    homes = [json.loads(cli("stack", "status", cwd=cwd).stdout)["home"] for cwd in (ROOT, ROOT / "configs", "/")]
    assert homes == [str(ROOT / ".rollout")] * 3
    elsewhere = json.loads(cli("stack", "status", cwd="/", ROLLOUT_HOME=str(tmp_path / "h")).stdout)
    assert elsewhere == {"running": False, "home": str(tmp_path / "h"), "server": None}


def test_a_config_given_by_path_from_another_directory_reads_its_project_s_files(tmp_path):
    done = cli("train", "rm", "--config", str(ROOT / "configs/rm-tiny.toml"), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["store"] == str(ROOT / ".rollout/store")  # the default store: the project's
    # A path that names no file says where it looked and why.
    done = cli("train", "rm", "--config", str(ROOT / "configs/rm-tiny.toml"), "--dry-run",
               "--set", "algorithm.rm.dataset.path=data/nope.jsonl", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"rollout: error: {ROOT / 'configs/rm-tiny.toml'}: algorithm.rm.dataset.path: no file {ROOT}/data/nope.jsonl "
        f"(relative paths resolve from {ROOT}, the config's project root (the nearest directory above it with a "
        "prefect.yaml); give an absolute path or one from there) (got 'data/nope.jsonl')")


def test_where_a_checkout_lives_never_enters_the_training_identity(tmp_path):
    """A copy of the project elsewhere (another clone, another machine) trains the same identity: prompt files
    enter by content, not by where they are."""
    copy = tmp_path / "clone"
    (copy / "configs").mkdir(parents=True)
    shutil.copy(ROOT / "prefect.yaml", copy)
    shutil.copy(ROOT / "configs/rl-tiny.toml", copy / "configs")
    shutil.copytree(ROOT / "data", copy / "data")
    here = load_config(RlConfig, ROOT / "configs/rl-tiny.toml")
    there = load_config(RlConfig, copy / "configs/rl-tiny.toml")
    assert here.settings.envs[0].source.path == str(ROOT / "data/rl-tiny-prompts.jsonl")
    assert there.settings.envs[0].source.path == str(copy / "data/rl-tiny-prompts.jsonl")
    assert training_hash(here) == training_hash(there)
    # ... and the content does.
    first_prompt = (ROOT / "data/rl-tiny-prompts.jsonl").read_text().splitlines()[0]
    (copy / "data/rl-tiny-prompts.jsonl").write_text(first_prompt + "\n")
    assert training_hash(load_config(RlConfig, copy / "configs/rl-tiny.toml")) != training_hash(here)
