"""Distillation from a teacher rollout trained itself: train-sft makes the teacher (the tiny model, 16 steps toward
one fixed 12-word answer: shifted, not collapsed, so a student from the same base has a reachable target), `rollout serve start <checkpoint id>` serves it, and train-rl distils it into the untrained tiny
model, by opd (the student samples, the teacher scores: reverse KL) and by sft-distill (the teacher samples, the
student learns its text: ce). Both learn within a few steps on CPU; a SIGKILLed opd run resumes to the same
checkpoint."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from clirun import (
    final_result,
    metrics_table,
    run_and_act_at,
    run_rollout,
    run_until_then_kill,
    task_run_states,
    train_in_process,
)

from rollout_lib.checkpoint import read_manifest
from rollout_lib.store import ObjectStore

pytestmark = pytest.mark.slow

TEACHER_TEXT = "the sea is calm and the sky is blue and the sun"  # 12 words: target_length(12) scores it 1.0
STAGES = ("sample-and-score", "score-merge", "advantages", "pack", "train")  # streamed scoring


@pytest.fixture(scope="module")
def teacher(prefect_server, tmp_path_factory):
    """A teacher trained by train-sft on the rl-tiny prompts, each answered with TEACHER_TEXT (the shipped
    configs/sft-teacher-tiny.toml), served by `rollout serve` from its checkpoint id (one replica, kept for the
    module, stopped at its end)."""
    workdir = tmp_path_factory.mktemp("distill")
    store = workdir / "store"
    # The shipped teacher config (configs/sft-teacher-tiny.toml: data/sft-teacher-tiny.jsonl, 16 adamw steps).
    checkpoint = train_in_process("train", "sft", "--config", "configs/sft-teacher-tiny.toml",
                                  "--set", f"run.store={store}")["checkpoint"]
    served = run_rollout("serve", "start", checkpoint, "--store", str(store), "--name", "distill-teacher")
    assert served.returncode == 0, served.stderr[-3000:]
    try:
        yield SimpleNamespace(store=store, checkpoint=checkpoint, workdir=workdir)
    finally:
        run_rollout("serve", "stop", "distill-teacher")


def distill_args(teacher, run_name: str, algo: str, source: str = '"policy"', steps: int = 12,
                 store=None) -> list[str]:
    return ["train", "rl", "--config", "configs/rl-tiny.toml", "--set", f"run.name={run_name}",
            "--set", f"run.store={store or teacher.store}", "--set", f"algorithm.rl.budget.max_steps={steps}",
            "--set", "algorithm.rl.checkpoint_interval=4", "--set", "algorithm.rl.envs[0].sampling.max_tokens=24",
            "--set", f"algorithm.rl.envs[0].algo={algo}", "--set", f"algorithm.rl.envs[0].sampler.source={source}"]


def checkpoint_of_step(store: ObjectStore, checkpoint: str, step: int) -> str:
    """The snapshot at `step` among `checkpoint`'s ancestors (itself included)."""
    while checkpoint is not None:
        manifest = read_manifest(store, checkpoint)
        if manifest["step"] == step:
            return checkpoint
        checkpoint = manifest["parent"]
    raise AssertionError(f"no snapshot at step {step}")


def head_tail(values: list[float], window: int = 3) -> tuple[float, float]:
    return sum(values[:window]) / window, sum(values[-window:]) / window


@pytest.mark.learning
def test_opd_pulls_the_student_to_the_teacher_and_a_killed_run_resumes_to_the_same_checkpoint(teacher, tmp_path):
    # Teacher scoring one sequence at a time: the engine's logprob bits depend on batch composition, and the
    # resumed run must end byte-identical.
    opd = f'{{ type = "opd", teacher = {{ model = "{teacher.checkpoint}", concurrency = 1 }} }}'
    result = train_in_process(*distill_args(teacher, "opd", opd, steps=14))
    table = metrics_table("opd")
    kl, rewards = table["ref_kl/kl"], result["reward_curve"]
    print("opd reverse KL to the teacher per step:", [round(v, 3) for v in kl])
    print("opd task reward per step:", [round(v, 3) for v in rewards])
    kl_first, kl_last = head_tail(kl)
    assert kl_last < 0.6 * kl_first, kl  # measured: 3.5 -> 1.2 over 12 steps
    reward_first, reward_last = head_tail(rewards)
    assert reward_last > reward_first, rewards  # toward the teacher's (~0.65: the sft-distill run's rewards)

    # The same run to step 8 (max_steps is in no identity: its first 8 steps are the run above's, whose step-8
    # snapshot it must end on), SIGKILLed after step 5; the rerun takes steps 1-5 from cache, and while it trains
    # on, the teacher's only replica is SIGKILLed after step 6: the run restarts it (rollout serves it), sends the
    # same requests again, and ends on the uninterrupted run's checkpoint of step 8.
    from rollout_lib.serving import engine

    def kill_the_teacher():
        victim = engine.find_deployment("distill-teacher").replicas[0]
        os.killpg(victim.pid, signal.SIGKILL)

    uninterrupted = checkpoint_of_step(ObjectStore(str(teacher.store)), result["checkpoint"], 8)
    args = distill_args(teacher, "opd", opd, steps=8, store=tmp_path / "interrupted")
    run_until_then_kill(args, "train-step-5' - Finished", tmp_path / "killed.log")
    rerun = run_and_act_at(args, "train-step-6' - Finished", kill_the_teacher, tmp_path / "rerun.log")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = final_result(rerun)
    states = task_run_states(resumed["flow_run_id"])
    assert all(states[f"{stage}-step-{k}"] == "Cached" for stage in STAGES for k in range(1, 6)), states
    assert all(states[f"train-step-{k}"] == "Completed" for k in range(6, 9)), states
    assert "restarted the dead ones" in rerun.stdout + rerun.stderr
    assert resumed["checkpoint"] == uninterrupted
    assert engine.find_deployment("distill-teacher").replicas[0].alive  # left running for the module


@pytest.mark.learning
def test_sft_distill_teaches_the_student_the_teachers_text(teacher):
    source = f'{{ model = "{teacher.checkpoint}" }}'
    train_in_process(*distill_args(teacher, "sft-distill", '{ type = "sft" }', source=source, steps=10))
    nll = metrics_table("sft-distill")["loss/ce"]
    print("sft-distill student's nll of the teacher's tokens per step:", [round(v, 3) for v in nll])
    first, last = head_tail(nll)
    assert last < 0.6 * first, nll  # measured: 6.1 -> 2.5 (the teacher's own entropy bounds it below)


def test_sft_with_the_policy_as_its_source_is_refused_in_one_line(teacher):
    refused = run_rollout(*distill_args(teacher, "sft-self", '{ type = "sft" }'), "--dry-run")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "rollout: error: configs/rl-tiny.toml: algorithm.rl.envs[0].sampler.source: sft")
