"""train-rm end to end through the CLI and a real Prefect server: training, scoring, resume after SIGKILL, and
bad input that fails with one line naming its place while losing nothing already stored."""

from __future__ import annotations

from pathlib import Path

import pytest

from clirun import cli_env, final_result, run_rollout, run_until_then_kill, task_run_states, train_in_process
from rollout_lib.store import ObjectStore

pytestmark = pytest.mark.slow

RESUME_STEPS = ["--set", "algorithm.rm.budget.max_steps=12", "--set", "algorithm.rm.checkpoint_interval=4"]


def store_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in (root / "objects").rglob("*") if p.is_file()}


def test_train_rm_tiny_then_score_and_export(prefect_server, tmp_path):
    store = tmp_path / "store"
    done = run_rollout("train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={store}")
    assert done.returncode == 0, done.stderr[-3000:]
    result = final_result(done)
    checkpoint = result["checkpoint"]
    assert f"final checkpoint: {checkpoint}" in done.stderr.splitlines()  # the summary; stdout is the JSON alone
    assert ObjectStore(str(store)).get_ref("runs/rm-tiny/latest") == checkpoint

    states = task_run_states(result["flow_run_id"])
    # rm-tiny snapshots every step: one segment per step.
    assert {"load-pairs-train", "tokenize-pairs-train", "init-model", "train-steps-1-1",
            "train-steps-2-2"} <= set(states)
    assert set(states.values()) == {"Completed"}

    data = tmp_path / "responses.jsonl"
    data.write_text('{"prompt": "What is 2+2?", "response": "4"}\n{"prompt": "What is 2+2?", "response": "5"}\n')
    scored = run_rollout("score", "--checkpoint", checkpoint, "--data", str(data), "--store", str(store),
                         "--max-seq-len", "64")
    assert scored.returncode == 0, scored.stderr[-2000:]
    lines = [line for line in scored.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 2 and all('"reward": ' in line for line in lines)

    exported = run_rollout("export", "--checkpoint", "runs/rm-tiny/latest", "--out", str(tmp_path / "hf"),
                           "--store", str(store))
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()


def test_sigkill_mid_training_then_rerun_matches_uninterrupted_run(prefect_server, tmp_path):
    expected = train_in_process("train", "rm", "--config", "configs/rm-tiny.toml", *RESUME_STEPS,
                                "--set", f"run.store={tmp_path / 'uninterrupted'}")["checkpoint"]

    store = tmp_path / "interrupted"
    args = ["train", "rm", "--config", "configs/rm-tiny.toml", *RESUME_STEPS, "--set", f"run.store={store}"]
    log_path = tmp_path / "killed.log"
    # Kill inside the second segment (steps 5-8), after its step 6 (ROLLOUT_LOG_LEVEL=DEBUG logs every step).
    killed_log = run_until_then_kill(args, "step 6: ", log_path, env=cli_env(ROLLOUT_LOG_LEVEL="DEBUG"))
    assert "train-steps-1-4' - Finished" in killed_log and "train-steps-5-8' - Finished" not in killed_log

    rerun = run_rollout(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    result = final_result(rerun)
    assert result["checkpoint"] == expected  # byte-identical final checkpoint

    states = task_run_states(result["flow_run_id"])
    for name in ["load-pairs-train", "tokenize-pairs-train", "init-model", "train-steps-1-4"]:
        assert states[name] == "Cached", (name, states[name])
    # Only the interrupted segment and the ones after it ran again, the interrupted one from its checkpoint.
    assert states["train-steps-5-8"] == "Completed" and states["train-steps-9-12"] == "Completed"


def test_bad_inputs_fail_with_one_line_naming_the_place(prefect_server, tmp_path):
    store = tmp_path / "store"
    ok = run_rollout("train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={store}")
    assert ok.returncode == 0, ok.stderr[-3000:]
    checkpoint = final_result(ok)["checkpoint"]
    before = store_files(store)

    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    cases = {
        "data": (["--set", f"algorithm.rm.dataset.path={bad_data}"], f"{bad_data}:2: missing field 'rejected'"),
        "config": (["--set", "algorithm.rm.optimizer.lrr=0.1"], "algorithm.rm.optimizer.lrr: unknown key"),
        "model": (["--set", "algorithm.rm.base_model=./models/nope"], "'./models/nope': no such local directory"),
    }
    for name, (extra, expected) in cases.items():
        failed = run_rollout("train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={store}", *extra)
        assert failed.returncode != 0, name
        error_lines = [line for line in failed.stderr.splitlines() if line.startswith("rollout: error:")]
        assert len(error_lines) == 1 and expected in error_lines[0], (name, failed.stderr[-2000:])
        assert "Traceback" not in failed.stderr, name

    # A corrupted object: the weights of the final checkpoint.
    weights = ObjectStore(str(store)).get_json(checkpoint)["weights"]
    weights_path = store / "objects" / weights[:2] / weights
    weights_path.write_bytes(weights_path.read_bytes()[:-8] + b"garbage!")
    scored = run_rollout("export", "--checkpoint", checkpoint, "--out", str(tmp_path / "x"), "--store", str(store))
    assert scored.returncode != 0
    assert f"object {weights} in {store} is corrupted" in scored.stderr.strip().splitlines()[-1]

    after = store_files(store)
    assert set(before) <= set(after)  # nothing already stored was lost
    assert all(after[name] == data for name, data in before.items() if not name.endswith(weights))
