"""The multi-turn toy envs are learnable on CPU, and echo learns the environment's replies while its rl works.

The base is tiny:qwen2 warm-started by train-sft on configs/sft-tools-tiny.toml (the protocols of both envs, taught
imperfectly on purpose), once for the module; the RL configs name it as a checkpoint, runs/tools-tiny/latest. Then:
- echo on the calculator's text protocol (configs/rl-calculator-echo.toml), through `rollout train rl` (the Prefect
  flow): the ce of the tool results' contents falls while the reward (right final answer) rises, and the policy keeps
  calling the tool;
- grpo on guess_number (configs/rl-guess.toml), in-process through the library's stages: the reward rises.
The curves are printed (pytest -s) and in the assertion messages. Both pass with margin on AVX-512 and on AVX2
kernels (`bash scripts/test-learning.sh avx2 -k multiturn`) at the configs' seed; over seeds 1-3 echo passes both ways
and guess_number fails one AVX2 seed: the spreads are at each assertion."""

from __future__ import annotations

import json
import statistics

import pytest

import os

from clirun import ROOT, metrics_table, train_in_process
from inprocess_rl import reward_curve_in_process

pytestmark = pytest.mark.slow

# The spreads below were measured by running the module with ROLLOUT_LEARNING_SEED=1, 2, 3 (both configs' run.seed
# is 1): `ROLLOUT_LEARNING_SEED=2 bash scripts/test-learning.sh avx2 -k multiturn -s`.
SEED_OVERRIDE = [f"run.seed={os.environ['ROLLOUT_LEARNING_SEED']}"] if os.environ.get("ROLLOUT_LEARNING_SEED") else []


@pytest.fixture(scope="module")
def tools_store(prefect_server, tmp_path_factory):
    """A store holding the warm start as runs/tools-tiny/latest (what the RL configs' base_model names)."""
    store = tmp_path_factory.mktemp("tools") / "store"
    train_in_process("train", "sft", "--config", "configs/sft-tools-tiny.toml", "--set", f"run.store={store}")
    return store


def mean(values) -> float:
    return sum(values) / len(values)


def median(values) -> float:
    return statistics.median(values)


@pytest.mark.learning
def test_echo_learns_the_tool_results_while_grpo_raises_the_reward(tools_store):
    # The config's base_model is the checkpoint ref runs/tools-tiny/latest, found in the run's store.
    rewards = train_in_process("train", "rl", "--config", "configs/rl-calculator-echo.toml",
                               "--set", f"run.store={tools_store}",
                               *[arg for setting in SEED_OVERRIDE for arg in ("--set", setting)])["reward_curve"]
    metrics = metrics_table("rl-calculator-echo")
    ce = metrics["loss/ce"]
    print("echo on the calculator, reward per step:", [round(v, 3) for v in rewards])
    print("echo on the calculator, ce of the tool results (alpha 0.02, weighted) per step:", [round(v, 3) for v in ce])
    print("turns per episode:", [round(v, 2) for v in metrics["turns_mean"]])
    # Measured (24 steps, tool results at alpha 0.02, run.seed 1-3, 2026-11-27, each group's prompt trained once),
    # reward over steps 1-3 -> 19-24:
    #   AVX-512 kernels: 0.52 -> 0.84, 0.51 -> 0.88, 0.61 -> 0.85 (gains 0.23-0.37); ce median ratio 0.36-0.41
    #   AVX2 kernels (scripts/test-learning.sh avx2): 0.48 -> 0.88, 0.52 -> 0.81, 0.50 -> 0.85 (gains 0.29-0.40);
    #   ce median ratio 0.34-0.51; turns per episode >= 1.67 at every step of all six runs. (Before the prompt
    #   was shared the rewards were the same to two decimals; ce ratios 0.33-0.50.)
    # At alpha 0.1 the AVX2 kernels collapsed it (reward 0 and one turn from step 5: configs/rl-calculator-echo.toml).
    # Asserted: half the smallest gain; a policy that does not learn gains ~0, one that collapses loses ~0.5.
    assert mean(rewards[-6:]) > mean(rewards[:3]) + 0.11, rewards
    assert median(ce[-6:]) < 0.8 * median(ce[:3]), ce
    assert all(turns > 1.5 for turns in metrics["turns_mean"]), metrics["turns_mean"]  # it keeps calling the tool


@pytest.mark.learning
def test_grpo_learns_to_use_the_feedback_of_guess_number(tools_store):
    # In process, in a store of its own; the base model's checkpoint is in the warm start's store.
    curve, last = reward_curve_in_process("rl-guess.toml", [
        f'algorithm.rl.base_model={{ uri = "runs/tools-tiny/latest", store = "{tools_store}" }}',
        f"algorithm.rl.envs[0].source.path={ROOT / 'data' / 'rl-guess-prompts.jsonl'}", *SEED_OVERRIDE], steps=24)
    print("grpo on guess_number, reward per step:", curve)
    # Measured (2026-11-27, each group's prompt trained once, run.seed 1-3), gain = mean(steps 19-24) - mean(1-3):
    #   AVX-512 kernels: 0.140, 0.204, 0.165 (before the prompt was shared: 0.165-0.204)
    #   AVX2 kernels (scripts/test-learning.sh avx2): 0.122, 0.084, 0.064 -- seed 3 is below the threshold: on AVX2
    #   kernels grpo learns this env about half as fast (least-squares slope x 23 steps: 0.07-0.12 against
    #   0.17-0.20). The suite runs seed 1 (0.140 and 0.122 against 0.08); a policy that does not learn gains ~0.
    #   Not tuned to pass seed 3: the weak AVX2 draw is reported (issue 39's note), not hidden.
    assert mean(curve[-6:]) > mean(curve[:3]) + 0.08, curve
    episodes = [json.loads(text) for text in last.column("episode").to_pylist()]
    assert all(episode["turns"] >= 1 for episode in episodes)
    # Feedback is written by the env as "user" turns, between the policy's turns.
    roles = {turn["role"] for turns in last.column("completion_turns").to_pylist() for turn in turns}
    assert roles <= {"assistant", "user"}
