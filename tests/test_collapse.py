"""The collapse guard (rollout_lib/rl/collapse.py) on synthetic step metrics: the calculator collapse of issue 39
said once, in one line naming the step it began; patience, recovery, the entropy symptom, "fail" and "off"; a
guard rebuilt from the same steps says the same; its settings never enter the training identity; and the sampled
entropy metric it reads. The run that really collapses: tests/test_collapse_run.py."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from rollout_lib.identity.training import training_settings
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.config.rl import CollapseSettings
from rollout_lib.rl.collapse import CollapseGuard, RlCollapseError
from rollout_lib.rl.sample import sampled_entropy
from rollout_lib.trainer.base import deterministic_metrics

ROOT = Path(__file__).resolve().parent.parent

# Issue 39: echo on the calculator env, on a CPU where it collapses. From step 5 every reward is 0, so every group's
# rewards are equal and every rl sample's advantage is 0.
CALCULATOR_REWARDS = [0.469, 0.453, 0.469, 0.156, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
CALCULATOR_TURNS = [2.0, 1.98, 2.0, 1.95, 1.02, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def step(number: int, reward: float, *, zero_advantage: float | None = None, turns: float | None = None,
         entropy: float = 0.8, rl_tokens: int = 640) -> dict:
    """One step's metrics as train-rl records them (the ones the guard reads, and a few it does not)."""
    metrics = {"step": number, "reward_mean": reward, "reward_std": 0.0 if reward == 0 else 0.4, "loss": 0.01,
               "zero_advantage_fraction": (1.0 if reward == 0 else 0.25) if zero_advantage is None else zero_advantage,
               "rl_tokens": rl_tokens, "sampled_entropy": entropy, "sample_s": 1.5}
    if turns is not None:
        metrics["turns_mean"] = turns
    return metrics


def calculator_steps() -> list[dict]:
    return [step(n, reward, turns=turns)
            for n, (reward, turns) in enumerate(zip(CALCULATOR_REWARDS, CALCULATOR_TURNS), start=1)]


def said(steps: list[dict], **settings) -> list[tuple[int, str]]:
    """(step, line) of every line a fresh guard says over `steps`."""
    guard = CollapseGuard(CollapseSettings(**settings))
    return [(metrics["step"], line) for metrics in steps if (line := guard.check(metrics)) is not None]


def test_the_calculator_collapse_is_said_once_naming_the_step_it_began():
    lines = said(calculator_steps())
    assert lines == [(7, "rl collapsed at step 5: reward 0.0 and 1.0 turns per episode for 3 steps (was 0.156 and "
                         "1.95 at step 4): every group's rewards are equal, no rl signal; try a lower "
                         "algorithm.rl.optimizer.lr, from a checkpoint before step 5 (docs/runs.md, \"When RL "
                         "collapses\")")]


def test_fail_raises_the_same_line_saying_the_run_stopped_and_how_to_go_on():
    guard = CollapseGuard(CollapseSettings(action="fail"))
    for metrics in calculator_steps()[:6]:
        assert guard.check(metrics) is None
    with pytest.raises(RlCollapseError) as raised:
        guard.check(calculator_steps()[6])
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("rl collapsed at step 5: reward 0.0 and 1.0 turns per episode for 3 steps (was 0.156 "
                              "and 1.95 at step 4)")
    assert 'stopped by algorithm.rl.collapse.action = "fail": the trained steps are kept, a rerun with action ' \
           '"warn" trains on' in message


def test_off_says_nothing():
    assert said(calculator_steps(), action="off") == []


def test_patience_is_the_number_of_steps_in_a_row():
    dip = [step(1, 0.5), step(2, 0.0), step(3, 0.0), step(4, 0.5), step(5, 0.0), step(6, 0.0), step(7, 0.4)]
    assert said(dip) == []  # two steps without signal, twice: never three in a row
    assert [at for at, _ in said(dip, patience=2)] == [3, 6]  # a new collapse after a step with signal: said again
    assert said(dip, patience=2)[1][1].startswith("rl collapsed at step 5: reward 0.0 for 2 steps (was 0.5 at step 4)")
    assert [at for at, _ in said(dip, patience=1)] == [2, 5]


def test_a_collapse_from_the_first_step_blames_the_reward():
    lines = said([step(n, 0.0) for n in range(1, 6)])
    assert lines == [(3, "rl collapsed at step 1: reward 0.0 for 3 steps: every group's rewards are equal, no rl "
                         "signal; check the reward and the prompts' difficulty (docs/runs.md, \"When RL collapses\")")]


def test_equal_rewards_at_the_best_the_run_reached_are_a_solved_task_not_a_collapse():
    solved = [step(1, 0.4), step(2, 0.7)] + [step(n, 1.0, zero_advantage=1.0) for n in range(3, 8)]
    assert said(solved) == []  # every group saturated at the run's best: nothing to warn about
    fell = solved + [step(n, 0.0) for n in range(8, 11)]  # then every reward 0: below the best, a collapse
    assert said(fell)[0][1].startswith("rl collapsed at step 8: reward 0.0 for 3 steps (was 1.0 at step 7)")


def test_a_share_of_zero_advantages_under_the_threshold_is_signal():
    steps = [step(n, 0.3, zero_advantage=0.9) for n in range(1, 6)]
    assert said(steps) == []
    assert [at for at, _ in said(steps, zero_advantage_fraction=0.9)] == [3]


def test_steps_that_train_no_rl_or_lack_the_metrics_never_count():
    distillation = [step(n, 0.0, rl_tokens=0) for n in range(1, 6)]  # sft / opd envs: no rl samples
    assert said(distillation) == []
    bare = [{"step": n, "reward_mean": 0.0, "loss": 0.1} for n in range(1, 6)]
    assert said(bare) == []


def test_entropy_collapse_is_its_own_symptom_and_min_entropy_0_turns_it_off():
    entropies = [0.9, 0.6, 0.3, 0.004, 0.002, 0.001, 0.001]
    steps = [step(n, 0.5, entropy=value) for n, value in enumerate(entropies, start=1)]
    assert said(steps) == [(6, "rl collapsed at step 4: sampled entropy 0.001 for 3 steps (was 0.3 at step 3): under "
                               "min_entropy 0.01, the policy samples one answer; try a lower "
                               "algorithm.rl.optimizer.lr, from a checkpoint before step 4 (docs/runs.md, \"When RL "
                               "collapses\")")]
    assert said(steps, min_entropy=0) == []


def test_one_answer_sampled_at_the_runs_best_reward_is_convergence_not_a_collapse():
    # rl-smollm2-tools from its warm start: reward 0.375, then every sample calls the tool and answers (1.2), the
    # entropy of the sampled tokens ~1e-5: nothing left to learn, nothing gone wrong.
    converged = [step(1, 0.375, entropy=0.236)] + [step(n, 1.2, zero_advantage=1.0, entropy=1.7e-5)
                                                   for n in range(2, 7)]
    assert said(converged) == []
    # The same entropy below the best reward is still a collapse.
    stuck = [step(1, 0.375, entropy=0.236), step(2, 0.9, entropy=0.2)] + [
        step(n, 0.5, entropy=1.7e-5, zero_advantage=0.5) for n in range(3, 6)]
    assert said(stuck)[0][1].startswith("rl collapsed at step 3: sampled entropy 1.7e-05 for 3 steps")


def test_two_symptoms_of_one_collapse_make_one_line():
    steps = [step(1, 0.5), step(2, 0.0, entropy=0.001), step(3, 0.0, entropy=0.001), step(4, 0.0, entropy=0.001)]
    (at, line), = said(steps)
    assert at == 4 and line.startswith("rl collapsed at step 2: reward 0.0 for 3 steps (was 0.5 at step 1): every "
                                       "group's rewards are equal, no rl signal; sampled entropy 0.001 for 3 steps "
                                       "(was 0.8 at step 1)")


def test_a_guard_rebuilt_from_the_recorded_steps_says_the_same_at_the_same_step():
    """A rerun reports every step again (from cache): the guard it builds reaches the same verdict. Records read
    back from the metrics file carry a wall time and the eval metrics too: neither changes it."""
    steps = calculator_steps()
    first = said(steps)
    recorded = [{**metrics, "wall_time": 1.76e9 + n} for n, metrics in enumerate(steps)]
    assert said(recorded) == first
    assert said(steps[:7]) == first  # a run killed at step 7 said it there; its rerun says it at step 7 again


def test_collapse_settings_are_checked_and_never_part_of_the_training_identity():
    def config(*overrides: str) -> RlConfig:
        return load_config(RlConfig, ROOT / "configs/rl-tiny.toml", list(overrides))

    base = config()
    assert base.settings.collapse == CollapseSettings(action="warn", patience=3, zero_advantage_fraction=1.0,
                                                      min_entropy=0.01)
    changed = config("algorithm.rl.collapse.action=fail", "algorithm.rl.collapse.patience=1",
                     "algorithm.rl.collapse.min_entropy=0.5", "algorithm.rl.collapse.zero_advantage_fraction=0.5")
    assert changed.settings.collapse.action == "fail"
    assert training_hash(changed) == training_hash(base)
    assert "collapse" not in training_settings(base)
    with pytest.raises(ConfigError, match=r"algorithm\.rl\.collapse\.actoin: unknown key"):
        config("algorithm.rl.collapse.actoin=fail")
    with pytest.raises(ConfigError, match=r"algorithm\.rl\.collapse\.action: "):
        config("algorithm.rl.collapse.action=stop")
    with pytest.raises(ConfigError, match=r"algorithm\.rl\.collapse\.patience: must be >= 1"):
        config("algorithm.rl.collapse.patience=0")


def test_sampled_entropy_is_the_mean_minus_logprob_of_the_policys_own_tokens():
    rollouts = pa.table({
        "env": ["words", "words", "teacher"],
        # null: a token the environment wrote; the teacher env's rows were sampled by a frozen model
        "sampling_logprobs": pa.array([[-0.5, -1.5], [None, -1.0], [-9.0]], pa.list_(pa.float32())),
    })
    assert sampled_entropy(rollouts, {"words"}) == pytest.approx(1.0)
    assert sampled_entropy(rollouts, {"words", "teacher"}) == pytest.approx(3.0)
    assert sampled_entropy(rollouts, set()) is None


def test_sampled_entropy_stays_out_of_checkpoint_manifests():
    """An engine's logprobs vary ~1e-5 with batch composition: a step sampled again after a kill would otherwise
    name another checkpoint id for the same weights."""
    assert deterministic_metrics({"step": 1, "reward_mean": 0.5, "sampled_entropy": 0.7}) == {"step": 1,
                                                                                            "reward_mean": 0.5}
