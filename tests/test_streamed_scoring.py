"""Scoring while sampling (`algorithm.rl.reward_loop.streamed`, seed 004's agent reward loop): each rollout's reward
starts as soon as the rollout is sampled, and the step's tables, metrics and checkpoint are the staged path's.

In process: a streamed sample stage gives the staged stages' tables and metrics, for a single-turn and a multi-turn
env; rewards start before the last completion is sampled; an episode is told as soon as the turn it ended in is
done. On the session's Prefect server: streamed and staged runs end on the same checkpoint with a multi-turn env,
and (through the CLI) a streamed run SIGKILLed inside a sample-and-score stage reruns to it."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pytest

import streamed_rewards
from rollout_lib import wire
from rollout_lib.config import RlConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.envs import build_interaction
from rollout_lib.envs.calculator import CalculatorSettings
from rollout_lib.envs.episodes import run_episodes
from rollout_lib.identity.training import training_identity
from rollout_lib.rl.policy import initial_policy, policy_at, policy_inputs
from rollout_lib.rl.prompts import load_prompts
from rollout_lib.rl.sample import build_samplers, sample_rollouts
from rollout_lib.rl.score import run_reward_loops, score_rollouts, scored_rollouts
from rollout_lib.rl.streamed import sample_and_score
from rollout_lib.sampling import SamplingParams
from rollout_lib.sampling.base import encode_prompt
from rollout_lib.sampling.hf import HfSampler
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.resident import ResidentTrainer

from clirun import ROOT, task_run_states, train_in_process

TINY = str(ROOT / "configs/rl-tiny.toml")
# Batches of 8 sequences: the embedded sampler's completions come back a batch at a time, so they stream.
EMBEDDED_IN_BATCHES = 'algorithm.rl.policy_sampler={ type = "hf", batch_size = 8 }'
CALCULATOR_ENV = {
    "name": "calculator", "source": {"type": "jsonl_path", "path": str(ROOT / "data/rl-calculator-prompts.jsonl")},
    "prompts_per_step": 2, "sampling": {"group_size": 4, "max_tokens": 12},
    "interaction": {"type": "calculator", "max_turns": 3}, "algo": {"type": "echo"},
    "rewards": [{"function": "env_score"}],
}


def config(*overrides: str, calculator: bool = False) -> RlConfig:
    """rl-tiny (and a multi-turn calculator env beside it), in an in-memory store."""
    extra = [f"algorithm.rl.envs={json_to_toml([*rl_tiny_envs(), CALCULATOR_ENV])}"] if calculator else []
    return load_config(RlConfig, TINY, ["run.store=memory://streamed", EMBEDDED_IN_BATCHES, *extra, *overrides])


def rl_tiny_envs() -> list[dict]:
    return [{"name": "words", "source": {"type": "jsonl_path", "path": str(ROOT / "data/rl-tiny-prompts.jsonl")},
             "prompts_per_step": 4, "sampling": {"group_size": 8, "temperature": 1.0, "max_tokens": 16},
             "algo": {"type": "grpo"}, "rewards": [{"function": "target_length",
                                                     "kwargs": {"target": 12, "unit": "words"}}]}]


def json_to_toml(value) -> str:
    """An inline TOML value (what `--set key=value` takes) from JSON-like data."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {json_to_toml(item)}" for key, item in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(json_to_toml(item) for item in value) + "]"
    return json.dumps(value)


@pytest.fixture
def policy_run():
    """(config -> (samplers, prompt tables, reward loops)) at the initial policy; everything closed after."""
    opened = []

    def at_start(cfg: RlConfig):
        store = ObjectStore(cfg.run.store)
        prompts = {env.name: load_prompts(env) for env in cfg.settings.envs}
        run = policy_inputs(store, cfg, {name: store.put_table(table) for name, table in prompts.items()})
        resident, loops = ResidentTrainer(), run_reward_loops(cfg)
        opened.extend([resident, loops])
        policy = policy_at(run, initial_policy(run, resident), resident)
        return lambda: build_samplers(cfg, policy.model, policy.tokenizer), prompts, loops

    yield at_start
    for thing in opened:
        thing.close()


@pytest.mark.parametrize("calculator", [False, True], ids=["single-turn", "with-multi-turn"])
def test_a_streamed_sample_stage_gives_the_staged_tables_and_metrics(policy_run, calculator):
    cfg = config(calculator=calculator)
    samplers, prompts, loops = policy_run(cfg)
    rollouts, sample_metrics = sample_rollouts(cfg, samplers(), prompts, 1)
    scored, score_metrics = score_rollouts(cfg, rollouts, prompts, loops)

    streamed = sample_and_score(cfg, samplers(), prompts, 1, loops)
    assert streamed.rollouts.equals(rollouts) and streamed.sample_metrics == sample_metrics
    streamed_scored, streamed_metrics = scored_rollouts(cfg, streamed.rollouts, streamed.results,
                                                        streamed.reward_model_metrics)
    assert streamed_scored.equals(scored) and streamed_metrics == score_metrics
    if calculator:  # both envs scored, episodes included
        assert set(scored.column("env").to_pylist()) == {"words", "calculator"}
        assert scored.filter(pa.compute.equal(scored["env"], "calculator"))["episode"].null_count == 0
    assert streamed.sampled_at <= streamed.scored_at


def test_rewards_start_before_the_last_completion_is_sampled(policy_run, monkeypatch):
    """4 batches of 8 completions: the first batch's rewards start while the later batches sample."""
    cfg = config('algorithm.rl.envs[0].rewards=[{ function = "streamed_rewards:recorded_target_length" }]')
    samplers, prompts, loops = policy_run(cfg)
    batch_ends = []
    generate = HfSampler._generate

    def timed(self, *args, **kwargs):
        completions = generate(self, *args, **kwargs)
        batch_ends.append(time.monotonic())
        return completions

    monkeypatch.setattr(HfSampler, "_generate", timed)
    streamed_rewards.STARTED.clear()
    streamed = sample_and_score(cfg, samplers(), prompts, 1, loops)
    assert len(batch_ends) == 4 and len(streamed_rewards.STARTED) == 32
    # Every batch but the last was being scored before the last batch was sampled.
    assert sum(start < batch_ends[-1] for start in streamed_rewards.STARTED) >= 24, (streamed_rewards.STARTED,
                                                                                   batch_ends)
    assert all(result.reward is not None for result in streamed.results)


def test_a_served_models_rows_are_handed_over_as_their_requests_return():
    """Per request (the frozen sampler's, as the engine's policy sampler's): rows come in the order requests finish,
    and the table is the one sampled without the callback."""
    import asyncio
    from types import SimpleNamespace

    from rollout_lib.model.loading import load_tokenizer, resolve_model
    from rollout_lib.sampling.frozen import FrozenSampler

    class SlowFirstPool:  # the first requests take longest
        async def generate(self, prompt_ids, *, seed, **_):
            await asyncio.sleep(0.05 if seed % 3 == 0 else 0.0)
            return SimpleNamespace(token_ids=[11 + seed % 50, 12], logprobs=[-1.0, -0.5])

    prompts = pa.Table.from_pylist([{"example_id": f"p{i}", "env": "words", "answer": None, "info": None,
                                     "source_line": i + 1,
                                     "messages": [{"role": "user", "content": f"Say {i} words."}]}
                                    for i in range(3)], schema=wire.PROMPTS)
    sampler = FrozenSampler(SlowFirstPool(), load_tokenizer(resolve_model("tiny:qwen2")), 8, "frozen:test")
    params = SamplingParams(group_size=2, max_tokens=2)
    handed = []
    table = sampler.sample(prompts, params, 7, on_rollout=lambda index, row: handed.append((index, row["sample_id"])))
    assert table.equals(sampler.sample(prompts, params, 7))
    assert sorted(handed) == list(enumerate(table.column("sample_id").to_pylist()))
    assert [index for index, _ in handed] != sorted(index for index, _ in handed)  # in the order they returned


def test_the_hand_over_only_queues_the_row_and_scores_as_staged(monkeypatch):
    """Rows handed over out of order by a served model's requests: the sampler's thread only queues each, the
    reward inputs are built on the scoring thread (not a 1-row table per rollout in the sampler's event loop), and
    the results are the staged score stage's, row for row."""
    import asyncio
    import threading
    from types import SimpleNamespace

    import rollout_lib.rl.streamed as streamed_module
    from rollout_lib.model.loading import load_tokenizer, resolve_model
    from rollout_lib.sampling.frozen import FrozenSampler

    class SlowFirstPool:
        async def generate(self, prompt_ids, *, seed, **_):
            await asyncio.sleep(0.02 if seed % 3 == 0 else 0.0)
            return SimpleNamespace(token_ids=[11 + seed % 50, 12, 13 + seed % 7], logprobs=[-1.0, -0.5, -0.25])

    built_on, reward_input = set(), streamed_module.reward_input
    monkeypatch.setattr(streamed_module, "reward_input", lambda *args: built_on.add(threading.current_thread().name)
                        or reward_input(*args))
    cfg = load_config(RlConfig, TINY, ["run.store=memory://handed-over"])
    samplers = {"words": FrozenSampler(SlowFirstPool(), load_tokenizer(resolve_model("tiny:qwen2")), 8, "frozen:t")}
    prompts = {env.name: load_prompts(env) for env in cfg.settings.envs}
    with run_reward_loops(cfg) as loops:
        rollouts, _ = sample_rollouts(cfg, samplers, prompts, 1)
        scored, metrics = score_rollouts(cfg, rollouts, prompts, loops)
        streamed = sample_and_score(cfg, samplers, prompts, 1, loops)
    assert built_on == {"streamed-scoring"}
    assert streamed.rollouts.equals(rollouts)
    assert scored_rollouts(cfg, streamed.rollouts, streamed.results, streamed.reward_model_metrics) == (scored, metrics)


def test_an_episode_is_handed_over_when_the_turn_it_ended_in_is_done():
    """Episode 0 answers at once, episode 1 calls the calculator first: 0 is told before turn 2 is sampled."""
    from rollout_lib.model.loading import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("tiny:qwen2"))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    events = []

    def generate(sequences, params, seed):
        events.append(("turn", len(sequences)))
        outputs = []
        for sequence in sequences:
            text = tokenizer.decode(sequence)
            turn = text.count("<|im_start|>assistant") - 1
            answer = "It is 2." if "1 + 1" in text else ["calc: 3 * 5", "It is 15."][turn]
            ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [end]
            outputs.append((ids, [-0.5] * len(ids)))
        return outputs

    questions = ["What is 1 + 1?", "What is 3 * 5?"]
    rows = [{"example_id": f"q{i}", "env": "calc", "messages": [{"role": "user", "content": q}], "answer": answer,
             "info": {}} for i, (q, answer) in enumerate(zip(questions, ["2", "15"]))]
    prompt_ids = [encode_prompt(tokenizer, row["messages"]) for row in rows]
    episodes = run_episodes(generate, tokenizer, build_interaction(CalculatorSettings(max_turns=3)), rows, prompt_ids,
                            SamplingParams(group_size=1, max_tokens=16), 0, [end], 256,
                            on_end=lambda index, episode: events.append(("ended", index, episode.end)))
    assert events == [("turn", 2), ("ended", 0, "env"), ("turn", 1), ("ended", 1, "env")]
    assert [episode.model_turns for episode in episodes] == [1, 2]


def test_the_streamed_tasks_return_the_staged_tasks_ids(tmp_path):
    """sample-and-score then score-merge (streamed) give the ids sample then score (staged) give."""
    from tasks.rl import (
        RunResources,
        init_policy_task,
        sample_and_score_task,
        sample_task,
        score_merge_task,
        score_task,
    )

    cfg = config(f"run.store={tmp_path / 'store'}", calculator=True)
    store = ObjectStore(cfg.run.store)
    prompts = {env.name: store.put_table(load_prompts(env)) for env in cfg.settings.envs}
    with ResidentTrainer() as resident, run_reward_loops(cfg) as loops:
        state = init_policy_task.fn(cfg, prompts, resident)["checkpoint"]
        inputs = {"prompts_ids": prompts, "policy_state": state, "step": 1,
                  "resources": RunResources(resident, None, loops)}
        sampled = sample_task.fn(cfg, **inputs)
        scored = score_task.fn(cfg, prompts, sampled["rollouts"], 1, loops)
        streamed = sample_and_score_task.fn(cfg, **inputs)
        merged = score_merge_task.fn(cfg, streamed["rollouts"], 1, [streamed["rewards"]])

    def untimed(metrics: dict) -> dict:
        return {name: value for name, value in metrics.items() if not name.endswith("_s")}

    assert streamed["rollouts"] == sampled["rollouts"] and untimed(streamed["metrics"]) == untimed(sampled["metrics"])
    assert merged["rollouts"] == scored["rollouts"] and untimed(merged["metrics"]) == untimed(scored["metrics"])
    assert streamed["metrics"]["score_tail_s"] >= 0


def test_streaming_is_the_default_and_in_no_identity():
    streamed = load_config(RlConfig, TINY)
    staged = load_config(RlConfig, TINY, ["algorithm.rl.reward_loop.streamed=false"])
    assert streamed.settings.reward_loop.streamed and not staged.settings.reward_loop.streamed
    assert training_hash(streamed) == training_hash(staged)
    assert training_identity(streamed) == training_identity(staged)


# --- on the session's Prefect server ------------------------------------------------------------------------------

def test_streamed_and_staged_runs_end_on_the_same_checkpoint(prefect_server, tmp_path):
    """rl-tiny, 2 steps, with a multi-turn env beside it (synchronous), the flow in this process. (rl-tiny alone,
    synchronous, is the first case without its second env: the in-process tests above cover it; one step
    off-policy is tests/test_behaviour_overlap.py's k = 1 run, streamed against staged.)"""
    from flows.train_rl import train_rl

    # A multi-turn env beside rl-tiny's, sampled in batches of 8 so that completions and episodes stream.
    settings = ["algorithm.rl.budget.max_steps=2", EMBEDDED_IN_BATCHES,
                f"algorithm.rl.envs={json_to_toml([*rl_tiny_envs(), CALCULATOR_ENV])}"]
    run = train_rl(config=TINY, overrides=[*settings, f"run.store={tmp_path / 'streamed'}"], return_state=True)
    streamed = run.result()
    staged = train_rl(config=TINY, overrides=[*settings, f"run.store={tmp_path / 'staged'}",
                                              "algorithm.rl.reward_loop.streamed=false"])
    assert streamed["checkpoint"] == staged["checkpoint"] and streamed["reward_curve"] == staged["reward_curve"]
    states = task_run_states(str(run.state_details.flow_run_id))
    assert {f"{stage}-step-{k}" for stage in ("sample-and-score", "score-merge", "train")
            for k in (1, 2)} <= set(states)


@pytest.mark.slow
def test_a_streamed_run_killed_inside_a_sample_and_score_stage_reruns_to_its_checkpoint(prefect_server, tmp_path):
    """2 steps whose reward takes 0.1 s a call; SIGKILLed once step 2's rewards are 8 in (its stage a quarter done),
    the rerun takes step 1 from cache, samples and scores step 2 again and ends on the uninterrupted run's
    checkpoint (the CLI is the killed run's; the uninterrupted run and the rerun are the flow in this process)."""
    import signal

    from clirun import cli_env, start_rollout

    slow = ["--set", 'algorithm.rl.envs[0].rewards=[{ function = "streamed_rewards:slow_target_length", '
                     'kwargs = { sleep_s = 0.1, target = 12 } }]']
    calls = tmp_path / "reward-calls"
    env = cli_env(PYTHONPATH="tests", STREAMED_REWARD_CALLS=str(calls))
    args = ["train", "rl", "--config", "configs/rl-tiny.toml", "--set", "algorithm.rl.budget.max_steps=2", *slow]

    expected = train_in_process(*args, "--set", f"run.store={tmp_path / 'whole'}")

    interrupted = [*args, "--set", f"run.store={tmp_path / 'interrupted'}"]
    log_path = tmp_path / "killed.log"
    with log_path.open("w") as log:
        process = start_rollout(interrupted, ROOT, env, log, log)
        deadline = time.monotonic() + 600
        while not calls.exists() or len(calls.read_text().splitlines()) < 32 + 8:  # step 1's 32, then 8 of step 2's
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "step 2's rewards never started"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert "step 1: reward" in log_path.read_text()  # step 1 was done; step 2's stage was not (below: it reruns)

    resumed = train_in_process(*interrupted)  # the rerun, in this process as the reference run: a CLI start saved
    assert resumed["checkpoint"] == expected["checkpoint"] and resumed["reward_curve"] == expected["reward_curve"]
    states = task_run_states(resumed["flow_run_id"])
    assert states["sample-and-score-step-1"] == states["score-merge-step-1"] == states["train-step-1"] == "Cached"
    assert states["sample-and-score-step-2"] == "Completed"  # killed inside it: run again, not from cache
