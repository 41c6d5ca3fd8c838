"""Difficulty-pool curricula (rollout_lib/rl/curriculum.py): state transitions from group rewards, missing rewards,
the weighted, seeded draw (and the uniform draw, bit for bit, without a curriculum), an emptied pool, the sample
stage's wiring, and config errors that name their place."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from rollout_lib.identity.training import training_settings
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.identity.training import training_hash
from rollout_lib.plan_checks import validate_config
from rollout_lib.config.loading import read_toml
from rollout_lib.config.rl import DifficultyPoolsSettings
from rollout_lib.rl.curriculum import draw_weights, initial_state, pool_of, state_json, update_state, weighted_draw
from rollout_lib.rl.prompts import select_prompts
from rollout_lib.rl.sample import sample_rollouts
from rollout_lib.determinism import derived_seed

ROOT = Path(__file__).resolve().parent.parent
POOLS = DifficultyPoolsSettings(type="difficulty_pools")  # easy: every reward >= 1.0; hard: every reward <= 0.0


def scored(*groups: tuple[str, str, list[float | None]]) -> pa.Table:
    """A scored ROLLOUTS slice: the columns update_state reads, one row per sample."""
    rows = [(env, example_id, reward) for env, example_id, rewards in groups for reward in rewards]
    return pa.table({"env": [r[0] for r in rows], "example_id": [r[1] for r in rows],
                     "reward": pa.array([r[2] for r in rows], pa.float64())})


def prompts(n: int, env: str = "e") -> pa.Table:
    return pa.table({"example_id": [f"{env}/{i}" for i in range(n)]})


# --- state --------------------------------------------------------------------------------------------------------


def test_groups_move_their_example_between_pools():
    assert initial_state() == {}
    state, metrics = update_state(initial_state(), scored(
        ("e", "e/0", [1.0, 1.0, 1.0]),   # solved every time: easy
        ("e", "e/1", [0.0, 0.0, 0.0]),   # never: hard
        ("e", "e/2", [1.0, 0.0, 0.5]),   # mixed: normal, not recorded
        ("e", "e/3", [0.5, 0.5, 0.5]),   # unanimous but neither threshold: normal
    ), {"e": POOLS}, num_examples={"e": 10})
    assert state == {"e": {"e/0": "easy", "e/1": "hard"}}
    assert metrics == {"curriculum/e/easy": 1, "curriculum/e/hard": 1, "curriculum/e/moved": 2,
                       "curriculum/e/normal": 8}

    # An example moves with its latest group: easy -> normal drops it, hard -> easy.
    after, metrics = update_state(state, scored(("e", "e/0", [1.0, 0.0]), ("e", "e/1", [1.0, 1.0])), {"e": POOLS})
    assert after == {"e": {"e/1": "easy"}}
    assert metrics == {"curriculum/e/easy": 1, "curriculum/e/hard": 0, "curriculum/e/moved": 2}
    assert state == {"e": {"e/0": "easy", "e/1": "hard"}}  # the input state is not modified


def test_a_group_with_a_missing_reward_leaves_its_example_where_it_was():
    state = {"e": {"e/0": "hard"}}
    after, metrics = update_state(state, scored(
        ("e", "e/0", [1.0, None, 1.0]),          # would be easy, but one reward is missing
        ("e", "e/1", [None, None]),              # nothing scored
        ("e", "e/2", [0.0, float("nan"), 0.0]),  # a non-finite reward counts as missing
    ), {"e": POOLS})
    assert after == state and metrics["curriculum/e/moved"] == 0
    assert pool_of([None, 1.0], POOLS) is None and pool_of([], POOLS) is None


def test_thresholds_are_inclusive_and_configurable():
    settings = DifficultyPoolsSettings(type="difficulty_pools", easy_threshold=0.8, hard_threshold=0.2)
    assert pool_of([0.8, 0.9], settings) == "easy"
    assert pool_of([0.2, 0.0], settings) == "hard"
    assert pool_of([0.79, 0.9], settings) == "normal"


def test_only_envs_with_a_curriculum_are_tracked_and_other_envs_state_is_kept():
    state = {"old": {"old/3": "easy"}}
    after, metrics = update_state(state, scored(("e", "e/0", [1.0, 1.0]), ("plain", "plain/0", [1.0, 1.0])),
                                  {"e": POOLS})
    assert after == {"e": {"e/0": "easy"}, "old": {"old/3": "easy"}}
    assert set(metrics) == {"curriculum/e/easy", "curriculum/e/hard", "curriculum/e/moved"}


def test_the_state_is_plain_json_with_one_byte_string():
    state, _ = update_state(initial_state(), scored(("e", "e/9", [1.0]), ("e", "e/1", [0.0]), ("a", "a/0", [0.0])),
                            {"e": POOLS, "a": POOLS})
    assert json.loads(json.dumps(state)) == state
    assert list(state) == ["a", "e"] and list(state["e"]) == ["e/1", "e/9"]  # sorted, whatever the row order
    assert state_json(state) == b'{"a":{"a/0":"hard"},"e":{"e/1":"hard","e/9":"easy"}}'
    assert state_json({"e": {"e/9": "easy", "e/1": "hard"}, "a": {"a/0": "hard"}}) == state_json(state)


def test_update_state_names_the_columns_it_needs():
    with pytest.raises(ValueError, match=r"missing \['reward'\]"):
        update_state({}, pa.table({"env": ["e"], "example_id": ["e/0"]}), {"e": POOLS})


# --- selection ----------------------------------------------------------------------------------------------------


def test_without_a_curriculum_the_draw_is_todays_bit_for_bit():
    table = prompts(20)
    # Pinned: the prompts step 3 of seed 1 drew before curricula existed (so checkpoint ids do not move).
    assert select_prompts(table, 4, seed=1, step=3, env_index=0).column("example_id").to_pylist() == [
        "e/2", "e/18", "e/3", "e/0"]
    assert select_prompts(table, 4, seed=7, step=1, env_index=1).column("example_id").to_pylist() == [
        "e/13", "e/17", "e/10", "e/18"]
    for step in range(1, 30):
        today = np.random.default_rng(derived_seed(1, "prompts", step, 0)).choice(20, size=4, replace=False)
        drawn = select_prompts(table, 4, seed=1, step=step, env_index=0).column("example_id").to_pylist()
        assert drawn == [f"e/{i}" for i in today]
        # A curriculum with nothing to prefer yet (the initial state) draws the same prompts.
        assert select_prompts(table, 4, seed=1, step=step, env_index=0, difficulty={},
                              curriculum=POOLS).column("example_id").to_pylist() == drawn


def test_the_weighted_draw_is_deterministic_distinct_and_seeded_per_step():
    table, difficulty = prompts(20), {f"e/{i}": "easy" for i in range(10)}

    def draw(step: int) -> list[str]:
        return select_prompts(table, 6, seed=1, step=step, env_index=0, difficulty=difficulty,
                              curriculum=POOLS).column("example_id").to_pylist()

    assert draw(5) == draw(5) and len(set(draw(5))) == 6
    assert draw(5) != draw(6)
    with pytest.raises(ValueError, match="curriculum's weights"):
        select_prompts(table, 4, seed=1, step=1, env_index=0, difficulty=difficulty)


def test_easy_and_hard_examples_are_drawn_less_often_in_proportion_to_their_weights():
    # 30 prompts: 10 easy (weight 0.1), 10 hard (0.3), 10 normal (1.0); 4 drawn per step over 3000 steps.
    table = prompts(30)
    difficulty = {**{f"e/{i}": "easy" for i in range(10)}, **{f"e/{i}": "hard" for i in range(10, 20)}}
    counts = Counter()
    for step in range(1, 3001):
        for example_id in select_prompts(table, 4, seed=3, step=step, env_index=0, difficulty=difficulty,
                                         curriculum=POOLS).column("example_id").to_pylist():
            counts[difficulty.get(example_id, "normal")] += 1
    total = sum(counts.values())
    assert total == 12000
    # Successive sampling of 4 from weights 10 x {0.1, 0.3, 1.0}: inclusion rates ~ 0.029, 0.089, 0.283 per draw
    # slot share (exactly proportional to weight for the first slot: 1/14, 3/14, 10/14).
    shares = {pool: counts[pool] / total for pool in ("easy", "hard", "normal")}
    assert 0.05 < shares["easy"] < 0.10
    assert 0.18 < shares["hard"] < 0.26
    assert 0.66 < shares["normal"] < 0.75
    assert 2.3 < shares["hard"] / shares["easy"] < 3.7


def test_an_emptied_pool_still_draws_a_full_step():
    table = prompts(10)
    zero_easy = DifficultyPoolsSettings(type="difficulty_pools", easy_weight=0.0, hard_weight=0.0)
    # Every example easy at weight 0: nothing to prefer, so the uniform draw.
    every_easy = {f"e/{i}": "easy" for i in range(10)}
    assert select_prompts(table, 4, seed=1, step=2, env_index=0, difficulty=every_easy, curriculum=zero_easy) \
        .column("example_id").to_pylist() == select_prompts(table, 4, seed=1, step=2, env_index=0) \
        .column("example_id").to_pylist()
    # Two examples left with weight > 0: both drawn, the other two from the zero-weight pools, uniformly.
    mostly_done = {**every_easy, "e/8": "hard"}
    del mostly_done["e/3"], mostly_done["e/7"]
    seen = Counter()
    for step in range(1, 200):
        drawn = select_prompts(table, 4, seed=1, step=step, env_index=0, difficulty=mostly_done,
                               curriculum=zero_easy).column("example_id").to_pylist()
        assert len(set(drawn)) == 4 and {"e/3", "e/7"} <= set(drawn)
        seen.update(drawn)
    assert set(seen) == {f"e/{i}" for i in range(10)}  # the filler reaches every zero-weight example
    # Weights > 0 draw from every pool, however few normal examples are left.
    assert len(select_prompts(table, 9, seed=1, step=1, env_index=0, difficulty=mostly_done,
                              curriculum=POOLS)) == 9


def test_draw_weights_and_a_state_naming_an_unknown_pool():
    assert draw_weights(["a", "b", "c"], {"a": "easy", "c": "hard"}, POOLS).tolist() == [0.1, 1.0, 0.3]
    with pytest.raises(ValueError, match=r"pools \['normal'\]"):
        draw_weights(["a"], {"a": "normal"}, POOLS)
    with pytest.raises(ValueError, match="cannot draw 3 distinct prompts from 2"):
        weighted_draw(np.random.default_rng(0), np.array([1.0, 0.5]), 3)


# --- the sample stage ---------------------------------------------------------------------------------------------


def raw_config(**env_overrides) -> dict:
    raw = read_toml(ROOT / "configs/rl-tiny.toml")
    raw["algorithm"]["rl"]["envs"][0].update(env_overrides)
    return raw


class RecordingSampler:
    """Stands in for a sampler: one rollout of one token per prompt, and the example ids it was given."""

    def __init__(self):
        self.drawn: list[list[str]] = []

    def sample(self, chosen: pa.Table, sampling, seed, interaction=None, context_limit=None) -> pa.Table:
        ids = chosen.column("example_id").to_pylist()
        self.drawn.append(ids)
        return pa.table({"env": ["words"] * len(ids), "example_id": ids, "completion_ids": [[1]] * len(ids),
                         "sampling_logprobs": pa.array([[-0.5]] * len(ids), pa.list_(pa.float32())),
                         "episode": pa.array([None] * len(ids), pa.string()),
                         "completion_turns": pa.array([None] * len(ids), pa.list_(pa.int32()))})


def test_sample_rollouts_draws_each_env_with_its_curriculum_state():
    plain = validate_config(RlConfig, raw_config())
    curriculum = validate_config(RlConfig, raw_config(curriculum={"type": "difficulty_pools", "easy_weight": 0.0}))
    table = prompts(20, "words")
    state = {"words": {f"words/{i}": "easy" for i in range(18)}}

    sampler = RecordingSampler()
    _, metrics = sample_rollouts(plain, {"words": sampler}, {"words": table}, 3)
    _, with_none = sample_rollouts(curriculum, {"words": sampler}, {"words": table}, 3)  # the state not wired in
    _, ignored = sample_rollouts(plain, {"words": sampler}, {"words": table}, 3, curriculum_state=state)
    assert sampler.drawn[0] == sampler.drawn[1] == sampler.drawn[2] == select_prompts(
        table, 4, seed=1, step=3, env_index=0).column("example_id").to_pylist()
    assert not any(key.startswith("curriculum/") for key in {**metrics, **with_none, **ignored})
    assert metrics["sampled_entropy"] == 0.5  # every sampled token's -logprob

    _, metrics = sample_rollouts(curriculum, {"words": sampler}, {"words": table}, 3, curriculum_state=state)
    assert {"words/18", "words/19"} <= set(sampler.drawn[3])  # the only normal ones, at easy_weight 0
    assert metrics["curriculum/words/drawn_easy"] == 2 and metrics["curriculum/words/drawn_hard"] == 0


# --- config -------------------------------------------------------------------------------------------------------


def error_of(raw) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(RlConfig, raw)
    return str(info.value)


def test_curriculum_settings_are_checked_with_locators():
    def curriculum(**knobs) -> dict:
        return raw_config(curriculum={"type": "difficulty_pools", **knobs})

    assert "algorithm.rl.envs[0].curriculum.easy_weight: must be <= 1.0 (got 1.5)" in error_of(
        curriculum(easy_weight=1.5))
    assert "algorithm.rl.envs[0].curriculum.hard_weight: must be >= 0.0 (got -0.1)" in error_of(
        curriculum(hard_weight=-0.1))
    assert ("algorithm.rl.envs[0].curriculum: hard_threshold (0.5) must be < easy_threshold (0.5): a group would be "
            "easy and hard at once") in error_of(curriculum(easy_threshold=0.5, hard_threshold=0.5))
    assert "algorithm.rl.envs[0].curriculum.easy_fraction: unknown key" in error_of(curriculum(easy_fraction=0.1))
    assert "algorithm.rl.envs[0].curriculum.type: " in error_of(raw_config(curriculum={"type": "replay"}))
    settings = validate_config(RlConfig, curriculum()).settings.envs[0].curriculum
    assert settings == DifficultyPoolsSettings(type="difficulty_pools", easy_threshold=1.0, hard_threshold=0.0,
                                               easy_weight=0.1, hard_weight=0.3)
    assert "algorithm.rl.envs[0].curriculum.type: required key is missing" in error_of(
        raw_config(curriculum={"easy_weight": 0.2}))


def test_no_curriculum_leaves_the_training_identity_as_it_was():
    plain = validate_config(RlConfig, raw_config())
    assert plain.settings.envs[0].curriculum is None
    assert all("curriculum" not in env for env in training_settings(plain)["envs"])  # absent, not null
    with_curriculum = validate_config(RlConfig, raw_config(curriculum={"type": "difficulty_pools"}))
    assert training_settings(with_curriculum)["envs"][0]["curriculum"]["easy_weight"] == 0.1
    assert training_hash(with_curriculum) != training_hash(plain)


# --- in the flow: the pools are a cached result of each step --------------------------------------------------

CURRICULUM_RUN = ["train", "rl", "--config", "configs/rl-tiny.toml", "--max-steps", "6", "--name", "curriculum",
                  "--set", "algorithm.rl.checkpoint_interval=2", "--set", "algorithm.rl.max_off_policy_steps=1",
                  "--set", 'algorithm.rl.envs[0].curriculum={ type = "difficulty_pools", easy_threshold = 0.3, '
                           'hard_threshold = 0.1, easy_weight = 0.0, hard_weight = 0.5 }']


@pytest.mark.slow
def test_the_pools_feed_back_into_the_draw_and_a_killed_run_reruns_to_the_same_checkpoint(prefect_server, tmp_path):
    """rl-tiny (8 prompts, 4 a step) at k = 1 with easy examples never drawn (easy_weight 0): examples become
    easy as groups score >= 0.3, no example easy in the pools a step draws with is drawn, and a run SIGKILLed
    after step 3 trained reruns
    to the uninterrupted run's checkpoint with the same pools every step (they are results of cached tasks)."""
    from clirun import final_result, run_rollout, run_until_then_kill, train_in_process

    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.store import ObjectStore

    reference = train_in_process(*CURRICULUM_RUN, "--store", str(tmp_path / "uninterrupted"))  # no CLI start
    steps = read_metrics(ObjectStore(str(tmp_path / "uninterrupted")), "curriculum")
    # Pools after each step; a step draws with those after step n-2 (k = 1), never an example easy there, so an
    # example that turned easy one step ago can still be drawn once more (and leave the pool).
    assert max(m["curriculum/words/easy"] for m in steps) >= 1
    assert all(m["curriculum/words/drawn_easy"] == 0 for m in steps)
    assert all(m["curriculum/words/easy"] + m["curriculum/words/hard"] + m["curriculum/words/normal"] == 8
               for m in steps)

    args = [*CURRICULUM_RUN, "--store", str(tmp_path / "interrupted")]
    run_until_then_kill(args, "train-step-3' - Finished", tmp_path / "killed.log")
    rerun = run_rollout(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert final_result(rerun)["checkpoint"] == reference["checkpoint"]
    resumed = read_metrics(ObjectStore(str(tmp_path / "interrupted")), "curriculum")
    assert [{k: v for k, v in m.items() if k.startswith("curriculum/")} for m in resumed] == \
        [{k: v for k, v in m.items() if k.startswith("curriculum/")} for m in steps]
