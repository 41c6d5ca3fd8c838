"""DAPO dynamic sampling (rollout_lib/rl/dynamic_sampling.py): which groups are uniform, the seeded replacement
draw (deterministic, never a prompt the step drew), the rounds' bookkeeping and metrics, settings errors, and
tiny runs: their kept groups all carry signal, each round is task runs of their own (a kill inside round 2 reruns
from round 2), and streamed, staged and Dask-chunked scoring keep the same tables, to the same checkpoint."""

from __future__ import annotations

import re

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from rollout_lib import wire
from rollout_lib.store import ObjectStore

from rollout_lib.plan_checks import plan_problems
from rollout_lib.identity.training import training_settings
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.identity.training import training_hash
from rollout_lib.plan_checks import validate_config
from rollout_lib.config.loading import read_toml
from rollout_lib.reward.loop import RewardResult
from rollout_lib.rl.dynamic_sampling import Round, kept_rows, next_replacements, replacement_prompts, uniform_groups

ROOT = Path(__file__).resolve().parent.parent
UNIFORM = {"words/0", "words/1", "words/2", "words/3", "words/4"}  # the fake reward's prompts without signal


def resampled(config, prompt_tables, step, first, sample_round):
    """The step's rounds in one process, as flows/rl_rounds.py chains them as tasks: `first`, then a round from
    `sample_round(prompts by env, round index)` while next_replacements draws one, then kept_rows."""
    rounds = [first]
    while chosen := next_replacements(config, prompt_tables, step, rounds):
        rounds.append(sample_round(chosen, len(rounds)))
    return kept_rows(config, rounds)


def raw_config(**env_overrides) -> dict:
    raw = read_toml(ROOT / "configs/rl-tiny.toml")
    raw["algorithm"]["rl"]["envs"][0].update(env_overrides)
    return raw


def prompts(n: int) -> pa.Table:
    return pa.table({"example_id": [f"words/{i}" for i in range(n)]})


def groups(example_ids: list[str], group_size: int = 2) -> Round:
    """A round's rows: `group_size` rollouts per prompt, rewards equal for the UNIFORM prompts, else 0 and 1."""
    rows = [(example_id, 0.5 if example_id in UNIFORM else float(i)) for example_id in example_ids
            for i in range(group_size)]
    return Round(pa.table({"env": ["words"] * len(rows), "example_id": [r[0] for r in rows]}),
                 [RewardResult(r[1]) for r in rows])


def test_uniform_groups_are_those_whose_present_rewards_are_all_equal():
    rollouts = pa.table({"env": ["a"] * 8 + ["b"] * 2, "example_id": ["x", "x", "y", "y", "z", "z", "w", "w",
                                                                      "v", "v"]})
    results = [RewardResult(1.0), RewardResult(1.0),  # x: equal
               RewardResult(0.0), RewardResult(1.0),  # y: signal
               RewardResult(None, "boom"), RewardResult(None, "boom"),  # z: none present
               RewardResult(None, "boom"), RewardResult(0.3),  # w: one present
               RewardResult(2.0), RewardResult(2.0)]  # v: equal, but env b does not resample
    assert uniform_groups(rollouts, results, {"a"}) == {("a", "x"), ("a", "z"), ("a", "w")}


def test_replacements_are_seeded_fresh_and_differ_per_round():
    table = prompts(10)
    drawn = {"words/0", "words/3", "words/7"}

    def draw(round_index: int, count: int = 4, step: int = 2) -> list[str]:
        return replacement_prompts(table, drawn, count, seed=1, step=step, env_index=0,
                                   round_index=round_index).column("example_id").to_pylist()

    assert draw(1) == draw(1)  # a rerun draws the same
    assert len(set(draw(1))) == 4 and not set(draw(1)) & drawn
    assert len({tuple(draw(r)) for r in (1, 2, 3)} | {tuple(draw(1, step=3))}) == 4  # seeded per round and step
    assert sorted(draw(1, count=20)) == sorted(set(table.column("example_id").to_pylist()) - drawn)  # all left


def test_rounds_replace_uniform_groups_until_the_batch_is_full():
    config = validate_config(RlConfig, raw_config(dynamic_sampling={"max_rounds": 3}))
    table, calls = prompts(12), []

    def sample_round(chosen, round_index):
        calls.append((round_index, chosen["words"].column("example_id").to_pylist()))
        return groups(chosen["words"].column("example_id").to_pylist())

    first = groups(["words/0", "words/5", "words/1", "words/6"])  # two uniform, two with signal
    kept, metrics = resampled(config, {"words": table}, 4, first, sample_round)
    drawn = [example_id for _, ids in calls for example_id in ids]
    assert len(drawn) == len(set(drawn)) and not set(drawn) & {"words/0", "words/5", "words/1", "words/6"}
    kept_ids = list(dict.fromkeys(kept.rollouts.column("example_id").to_pylist()))
    assert len(kept_ids) == 4 and not set(kept_ids) & UNIFORM  # full, every kept group with signal
    assert kept_ids[:2] == ["words/5", "words/6"]  # the first round's kept groups first, in order
    assert [r.reward for r in kept.results] == [0.0, 1.0] * 4  # the rewards follow their rows
    assert metrics["dynamic_sampling/kept_groups"] == 4 and metrics["dynamic_sampling/short_by"] == 0
    assert metrics["dynamic_sampling/rounds"] == len(calls) >= 1
    assert metrics["dynamic_sampling/dropped_groups"] == 2 + sum(len(set(ids) & UNIFORM) for _, ids in calls)
    again, _ = resampled(config, {"words": table}, 4, first, lambda chosen, r: groups(
        chosen["words"].column("example_id").to_pylist()))
    assert again.rollouts.equals(kept.rollouts)  # deterministic: a rerun keeps the same groups


def test_rounds_run_out_and_the_step_trains_on_what_it_kept():
    config = validate_config(RlConfig, raw_config(dynamic_sampling={"max_rounds": 2}))
    table = prompts(7)  # words/0-4 uniform: the 3 left after the first draw can fill one group at most
    first = groups(["words/0", "words/1", "words/5", "words/2"])
    rounds = []
    kept, metrics = resampled(config, {"words": table}, 1, first,
                              lambda chosen, r: rounds.append(r) or groups(chosen["words"].column("example_id")
                                                                           .to_pylist()))
    assert set(kept.rollouts.column("example_id").to_pylist()) == {"words/5", "words/6"}
    assert metrics == {"dynamic_sampling/rounds": 1, "dynamic_sampling/dropped_groups": 5,
                       "dynamic_sampling/kept_groups": 2, "dynamic_sampling/short_by": 2}
    assert rounds == [1]  # round 1 drew all 3 prompts left: round 2 has none to draw

    nothing, metrics = resampled(config, {"words": prompts(4)}, 1, groups(["words/0", "words/1", "words/2",
                                                                            "words/3"]), None)
    assert nothing.rollouts.num_rows == 8 and metrics["dynamic_sampling/kept_groups"] == 0  # the step still exists
    assert metrics["dynamic_sampling/short_by"] == 4 and metrics["dynamic_sampling/rounds"] == 0


def error_of(raw) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(RlConfig, raw)
    return str(info.value)


def test_settings_are_checked_and_absent_leaves_the_identity_as_it_was():
    assert "algorithm.rl.envs[0].dynamic_sampling.max_rounds: must be >= 1 (got 0)" in error_of(
        raw_config(dynamic_sampling={"max_rounds": 0}))
    assert "algorithm.rl.envs[0].dynamic_sampling.rounds: unknown key" in error_of(
        raw_config(dynamic_sampling={"rounds": 2}))
    plain = validate_config(RlConfig, raw_config())
    assert all("dynamic_sampling" not in env for env in training_settings(plain)["envs"])
    on = validate_config(RlConfig, raw_config(dynamic_sampling={}))
    assert on.settings.envs[0].dynamic_sampling.max_rounds == 3
    assert training_hash(on) != training_hash(plain)
    assert plan_problems(on) == []
    staged = raw_config(dynamic_sampling={})  # every scoring runs the rounds (flows/rl_rounds.py)
    staged["algorithm"]["rl"]["reward_loop"] = {"streamed": False}
    staged["run"]["task_runner"] = {"type": "dask"}
    assert plan_problems(validate_config(RlConfig, staged)) == []
    single = raw_config(dynamic_sampling={}, sampling={"group_size": 1, "max_tokens": 16})
    assert "algorithm.rl.envs[0].dynamic_sampling: with sampling.group_size = 1 every group is uniform" \
        in error_of(single)


def test_bad_settings_are_one_line_and_exit_2():
    from clirun import run_rollout

    for setting in ("algorithm.rl.envs[0].dynamic_sampling={ max_rounds = 0 }",
                    "algorithm.rl.envs[0].sampling={ group_size = 1, max_tokens = 16 }"):
        done = run_rollout("train", "rl", "--config", "configs/rl-tiny.toml", "--dry-run", "--set",
                           "algorithm.rl.envs[0].dynamic_sampling={}", "--set", setting)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "algorithm.rl" in lines[0] and "dynamic_sampling" in lines[0], done.stderr


DYNAMIC_RUN = ["train", "rl", "--config", "configs/rl-tiny.toml", "--max-steps", "2", "--name", "dapo",
               "--set", "algorithm.rl.envs[0].rewards=[{ function = "
                        '"example_rewards:words_unless_prompt_words_even" }]',
               "--set", "algorithm.rl.envs[0].dynamic_sampling={ max_rounds = 2 }"]


@dataclass(frozen=True)
class StreamedRun:
    result: dict  # train_in_process's
    store: ObjectStore
    steps: list[dict]  # its metrics, step by step
    resampled: int  # a step that ran both rounds


@pytest.fixture(scope="module")
def streamed_run(prefect_server, tmp_path_factory) -> StreamedRun:
    """The reference: DYNAMIC_RUN scored streamed (the default), uninterrupted."""
    from clirun import train_in_process

    from rollout_lib.runlog.metrics_file import read_metrics

    store = tmp_path_factory.mktemp("streamed") / "store"
    result = train_in_process(*DYNAMIC_RUN, "--store", str(store))
    steps = read_metrics(ObjectStore(str(store)), "dapo")
    resampled = [m["step"] for m in steps if m["dynamic_sampling/rounds"] == 2]
    assert resampled, steps  # a step ran both rounds (the seed decides which: the tests below need one)
    return StreamedRun(result, ObjectStore(str(store)), steps, resampled[0])


def kept_tables(store: ObjectStore, steps=(1, 2)) -> list[str]:
    """The ids of each step's scored (kept) table."""
    from rollout_lib.runlog.step_tables import read_step_tables

    return [read_step_tables(store, "dapo", step)["scored"] for step in steps]


def assert_every_group_has_signal(store: ObjectStore) -> None:
    for scored_id in kept_tables(store):
        scored = store.get_table(scored_id, wire.ROLLOUTS)
        rewards: dict[str, set] = {}
        for example_id, reward in zip(scored.column("example_id").to_pylist(), scored.column("reward").to_pylist()):
            rewards.setdefault(example_id, set()).add(reward)
        assert all(len(values) > 1 for values in rewards.values()), rewards  # no uniform group trained


@pytest.mark.slow
def test_a_tiny_run_trains_on_groups_with_signal_and_reruns_to_the_same_checkpoint(streamed_run):
    """rl-tiny with a reward that is 0 for every completion of 3 of its 8 prompts: each step's kept groups all
    carry signal, the metrics count the rounds, each round is task runs of its own, and a rerun of the same command
    ends on the same checkpoint with every round from cache."""
    from clirun import task_run_states, train_in_process

    first, step = streamed_run.result, streamed_run.resampled
    for m in streamed_run.steps:
        assert m["dynamic_sampling/kept_groups"] + m["dynamic_sampling/short_by"] == 4
        assert m["rollouts"] == 8 * m["dynamic_sampling/kept_groups"]
    assert sum(m["dynamic_sampling/dropped_groups"] for m in streamed_run.steps) >= 1  # some groups were uniform
    assert_every_group_has_signal(streamed_run.store)
    rounds = [f"{stage}-step-{step}-round-{r}" for r in (1, 2) for stage in ("draw", "sample-and-score")]
    states = task_run_states(first["flow_run_id"])
    assert {states[name] for name in [*rounds, f"dynamic-sampling-step-{step}"]} == {"Completed"}

    again = train_in_process(*DYNAMIC_RUN, "--store", streamed_run.store.root)
    assert again["checkpoint"] == first["checkpoint"]
    states = task_run_states(again["flow_run_id"])
    assert {states[name] for name in [*rounds, *(f"{stage}-step-{done}" for stage in ("sample-and-score", "train")
                                                 for done in (1, 2))]} == {"Cached"}


@pytest.mark.slow
def test_staged_scoring_killed_inside_round_2_reruns_from_round_2_to_the_streamed_runs_checkpoint(streamed_run,
                                                                                                 tmp_path):
    """The same run scored staged, SIGKILLed while round 2 samples (its prompts drawn): the rerun takes rounds 0 and
    1 and round 2's draw from cache, samples and scores round 2, and keeps the tables the streamed run kept. (The kill
    waits for round 2's draw, not its sample: a round's scores take milliseconds, so a kill sent when the sample
    finished could land after they were stored, as it once did in the suite.)"""
    from clirun import cli_env, run_until_then_kill, task_run_states, train_in_process

    from rollout_lib.runlog.metrics_file import read_metrics

    step = streamed_run.resampled
    killed = [*DYNAMIC_RUN, "--store", str(tmp_path / "killed"), "--set", "algorithm.rl.reward_loop.streamed=false"]
    env = cli_env(PYTHONPATH=str(ROOT / "tests"))  # where example_rewards lives, outside the library
    log = run_until_then_kill(killed, f"draw-step-{step}-round-2' - Finished", tmp_path / "killed.log", env=env)
    finished = set(re.findall(r"'([\w-]+)' - Finished in state Completed", log))
    assert f"sample-step-{step}-round-2" not in finished, "the kill landed after round 2's sample"
    resumed = train_in_process(*killed)  # the rerun in this process: a CLI start (a plain interpreter) saved
    assert resumed["checkpoint"] == streamed_run.result["checkpoint"]
    states = task_run_states(resumed["flow_run_id"])
    cached = [f"{stage}-step-{step}{suffix}" for stage, suffix in (
        ("sample", ""), ("score", ""), ("draw", "-round-1"), ("sample", "-round-1"), ("score", "-round-1"),
        ("draw", "-round-2"))]
    assert {name: states[name] for name in cached} == dict.fromkeys(cached, "Cached")
    rerun = [f"sample-step-{step}-round-2", f"score-step-{step}-round-2", f"dynamic-sampling-step-{step}"]
    assert {name: states[name] for name in rerun} == dict.fromkeys(rerun, "Completed")
    staged = ObjectStore(str(tmp_path / "killed"))
    assert kept_tables(staged) == kept_tables(streamed_run.store)
    assert read_metrics(staged, "dapo")[-1]["dynamic_sampling/kept_groups"] == \
        streamed_run.steps[-1]["dynamic_sampling/kept_groups"]


@pytest.mark.slow
def test_chunked_scoring_on_a_dask_cluster_ends_on_the_streamed_runs_checkpoint(streamed_run, tmp_path):
    """Scored on a Dask LocalCluster (one worker, 2 chunks a round): every round's chunks run on it, and the run
    keeps the same tables, to the same checkpoint."""
    from clirun import task_run_states, train_in_process

    step = streamed_run.resampled
    on_dask = [*DYNAMIC_RUN, "--store", str(tmp_path / "dask"), "--set", "run.task_runner.type=dask",
               "--set", "run.task_runner.n_workers=1", "--set", "run.task_runner.chunks=2"]
    chunked = train_in_process(*on_dask)
    assert chunked["checkpoint"] == streamed_run.result["checkpoint"]
    states = task_run_states(chunked["flow_run_id"])
    assert {states[f"score-step-{step}{r}-chunk-{chunk}"] for r in ("", "-round-1", "-round-2")
            for chunk in (0, 1)} == {"Completed"}
    assert kept_tables(ObjectStore(str(tmp_path / "dask"))) == kept_tables(streamed_run.store)


@pytest.mark.slow
def test_off_policy_rounds_sample_the_state_their_step_samples(streamed_run, tmp_path):
    """k = 1, scored staged: step 1 samples the initial policy as on-policy, so it keeps the same rows; step 2
    samples the initial policy too (one step stale), its rounds included, and keeps only groups with signal."""
    from clirun import train_in_process

    from rollout_lib.runlog.metrics_file import read_metrics

    store = ObjectStore(str(tmp_path / "k1"))
    train_in_process(*DYNAMIC_RUN, "--store", store.root, "--set", "algorithm.rl.max_off_policy_steps=1",
                     "--set", "algorithm.rl.reward_loop.streamed=false")
    def step_1(run_store: ObjectStore) -> pa.Table:
        """Step 1's kept rows but what says which copy of the initial weights sampled them: the state's id (k is in
        the chain's identity) and the logprobs' last bits (off-policy, a frozen copy samples)."""
        scored = run_store.get_table(kept_tables(run_store, (1,))[0], wire.ROLLOUTS)
        return scored.drop_columns(["sampled_from", "sampling_logprobs"])

    assert step_1(store).equals(step_1(streamed_run.store))
    assert_every_group_has_signal(store)
    steps = read_metrics(store, "dapo")
    assert [m["off_policy_lag"] for m in steps] == [0, 1]
    sampled_from = set(store.get_table(kept_tables(store, (2,))[0], wire.ROLLOUTS).column("sampled_from").to_pylist())
    assert sampled_from == set(store.get_table(kept_tables(store, (1,))[0], wire.ROLLOUTS)
                               .column("sampled_from").to_pylist())  # both steps: the initial state
