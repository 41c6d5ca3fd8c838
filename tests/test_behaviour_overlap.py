"""Behaviour logprobs computed while a step samples (rl/behaviour_stream.py): off-policy and streamed, each chunk of
the trainer's recompute runs as soon as its rows are sampled, and the advantages stage adopts it.

In process: the chunks computed while sampling (envs in config order, a chunk across two envs, a short last chunk,
a multi-turn env, a frozen model's rows between, truncation, a temperature) give the staged recompute's training
samples bit for bit, the first chunk starting before the last env samples; chunks whose rows were not all handed
over fall back to the recompute, with the same bits; a chunk over other rows fails loudly. The flow: a k = 1 run
ends on the same checkpoint with the overlap on and off."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rollout_lib.config import RlConfig
from rollout_lib.identity.training import training_hash
from rollout_lib.plan_checks import validate_config
from rollout_lib.identity.training import training_identity
from rollout_lib.rl.advantages import PolicyReference, algorithm_resources, training_samples
from rollout_lib.rl.behaviour import CHUNK_ROWS
from rollout_lib.rl.behaviour_stream import BehaviourStream, overlaps_behaviour_logprobs
from rollout_lib.rl.policy import initial_policy, policy_inputs, sampling_policy
from rollout_lib.rl.prompts import load_prompts
from rollout_lib.rl.sample import sample_rollouts
from rollout_lib.sampling.hf import HfSampler, HfSamplerSettings
from rollout_lib.sampling.base import SamplingContext
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.resident import ResidentTrainer

from clirun import ROOT

FROZEN = "frozen:served:teacher"


def env(name: str, path: str, prompts: int, group: int, **extra) -> dict:
    return {"name": name, "source": {"type": "jsonl_path", "path": str(ROOT / "data" / path)},
            "prompts_per_step": prompts, "algo": {"type": "grpo"},
            "rewards": [{"function": "target_length", "kwargs": {"target": 4}}], **extra}


def overlap_config(tiny_model_dir, **settings) -> RlConfig:
    """Three envs, 12 + 4 + 8 rows: `words` (the policy, temperature 0.7), `teacher` (a frozen model: its rows are
    never recomputed) and `calculator` (the policy, multi-turn). The recompute's chunks: rows 0-7, rows 8-11 with
    16-19 (across the frozen env), rows 20-23 (short)."""
    return validate_config(RlConfig, {
        "run": {"name": "overlap", "seed": 3, "store": "memory://unused"},
        "algorithm": {"rl": {
            "base_model": str(tiny_model_dir), "max_seq_len": 40, "checkpoint_interval": 1,
            "optimizer": {"lr": 1e-2}, "budget": {"max_steps": 2}, "max_off_policy_steps": 1,
            "envs": [
                env("words", "rl-tiny-prompts.jsonl", 3, 4, sampling={"group_size": 4, "temperature": 0.7,
                                                                      "max_tokens": 10}),
                env("teacher", "rl-tiny-prompts.jsonl", 2, 2, sampling={"group_size": 2, "max_tokens": 6},
                    algo={"type": "sft", "teacher": {"base_url": ["http://127.0.0.1:9"], "name": "teacher"}}),
                env("calculator", "rl-calculator-prompts.jsonl", 2, 4, sampling={"group_size": 4, "max_tokens": 8},
                    interaction={"type": "calculator", "max_turns": 2}),
            ],
            **settings,
        }},
    })


@pytest.fixture(scope="module")
def sampling_state(tiny_model_dir):
    """(config, the frozen copy at the initial state, its state id, prompt tables, policy reference), with the
    samplers every env uses: the embedded sampler in batches of 4 (completions stream), the frozen env's rows
    recorded as a frozen model's."""
    cfg = overlap_config(tiny_model_dir)
    store = ObjectStore("memory://behaviour-overlap")
    prompts = {env.name: load_prompts(env) for env in cfg.settings.envs}
    run = policy_inputs(store, cfg, {name: store.put_table(table) for name, table in prompts.items()})
    with ResidentTrainer(frozen_capacity=2) as resident:
        state = initial_policy(run, resident)
        policy = sampling_policy(run, state, resident)  # k = 1: a frozen copy, as the sample stage's
        settings = HfSamplerSettings(batch_size=4)
        on_policy = HfSampler(settings, policy.model, policy.tokenizer, SamplingContext(policy_state=state))
        teacher = HfSampler(settings, policy.model, policy.tokenizer, SamplingContext(policy_state=FROZEN))
        samplers = {"words": on_policy, "teacher": teacher, "calculator": on_policy}
        reference = PolicyReference(lambda: sampling_policy(run, state, resident), cfg.settings.base_model,
                                    state_id=state)
        yield cfg, policy, state, prompts, samplers, reference


@pytest.fixture(scope="module")
def streamed_step(sampling_state):
    """One step sampled with a BehaviourStream told of every rollout: (scored rollouts, its BEHAVIOUR_LOGPROBS,
    its metrics, the chunks started when the last env began sampling)."""
    cfg, policy, state, prompts, samplers, _ = sampling_state
    started_before_last_env = []
    with BehaviourStream(cfg, policy.model, state) as stream:
        def stream_to(env_name: str, chosen: pa.Table):
            if env_name == "calculator":
                started_before_last_env.extend(sorted(stream.running))
            return stream.stream_to(env_name, chosen)

        rollouts, _ = sample_rollouts(cfg, samplers, prompts, 1, stream_to=stream_to)
        precomputed, metrics = stream.results()
    return scored(rollouts), precomputed, metrics, started_before_last_env


def scored(rollouts: pa.Table) -> pa.Table:
    """Rollouts with a reward each (any will do: the behaviour logprobs never read it)."""
    rewards = [float(len(ids) % 3) for ids in rollouts.column("completion_ids").to_pylist()]
    return rollouts.set_column(rollouts.schema.get_field_index("reward"), "reward", pa.array(rewards, pa.float64()))


def staged_and_adopted(sampling_state, rollouts: pa.Table, precomputed: pa.Table):
    cfg, *_, reference = sampling_state
    resources = algorithm_resources(cfg, policy=reference)
    return training_samples(cfg, rollouts, resources), training_samples(cfg, rollouts, resources, precomputed)


def test_chunks_computed_while_sampling_are_the_staged_recomputes_bits(sampling_state, streamed_step):
    rollouts, precomputed, metrics, started_early = streamed_step
    sources = rollouts.column("sampled_from").to_pylist()
    assert sources.count(FROZEN) == 4 and rollouts.num_rows == 24
    assert rollouts.column("completion_turns").null_count == 16  # the calculator's 8 rows are episodes
    lengths = [len(p) + len(c) for p, c in zip(rollouts.column("prompt_ids").to_pylist(),
                                               rollouts.column("completion_ids").to_pylist())]
    assert max(lengths) > 40  # some rows are truncated to max_seq_len
    # Three chunks: the first began while the calculator env had not started sampling.
    assert sorted(set(precomputed.column("chunk").to_pylist())) == [0, 1, 2] and started_early == [0]
    assert precomputed.column("row").to_pylist() == [*range(12), *range(16, 24)]  # the frozen rows skipped
    assert metrics["behaviour/precompute_s"] > 0 and metrics["behaviour/precompute_tail_s"] >= 0

    (staged, staged_metrics), (adopted, adopted_metrics) = staged_and_adopted(sampling_state, rollouts, precomputed)
    assert adopted.equals(staged)  # bit for bit: the same training samples table, so the same id
    assert adopted_metrics["behaviour/precomputed_rows"] == adopted_metrics["behaviour/recomputed"] == 20
    assert adopted_metrics["behaviour/recompute_s"] == 0.0 and staged_metrics["behaviour/precomputed_rows"] == 0
    assert staged_metrics["behaviour/recompute_s"] > 0
    same = ("behaviour/recomputed", "behaviour/sampler_diff_max", "behaviour/sampler_kl")
    assert {name: adopted_metrics[name] for name in same} == {name: staged_metrics[name] for name in same}


def test_chunks_not_handed_over_whole_fall_back_to_the_recompute(sampling_state, streamed_step):
    """The calculator's sampler hands nothing over (a backend that does not stream): the chunks with its rows are
    computed at the advantages stage, the first is adopted; the bits are the same. A chunk computed over other rows
    than the recompute's is a bug, and fails loudly."""
    cfg, policy, state, prompts, _, _ = sampling_state
    rollouts = streamed_step[0]
    records = rollouts.to_pylist()
    with BehaviourStream(cfg, policy.model, state) as stream:
        first = 0
        for env in cfg.settings.envs:
            on_rollout = stream.stream_to(env.name, prompts[env.name].slice(0, env.prompts_per_step))
            rows = env.prompts_per_step * env.sampling.group_size
            if env.name == "words":
                for index in reversed(range(rows)):  # in any order
                    on_rollout(index, records[first + index])
            assert (on_rollout is None) == (env.name == "teacher")
            first += rows
        precomputed, _ = stream.results()
    assert set(precomputed.column("chunk").to_pylist()) == {0}

    (staged, _), (adopted, metrics) = staged_and_adopted(sampling_state, rollouts, precomputed)
    assert adopted.equals(staged)
    assert metrics["behaviour/precomputed_rows"] == CHUNK_ROWS and metrics["behaviour/recompute_s"] > 0

    moved = precomputed.set_column(precomputed.schema.get_field_index("row"), "row",
                                   pa.array([row + 1 for row in precomputed.column("row").to_pylist()], pa.int32()))
    with pytest.raises(AssertionError, match="chunk 0 was computed over rows"):
        staged_and_adopted(sampling_state, rollouts, moved)


def test_the_overlap_is_off_policy_streamed_only_and_in_no_identity(tiny_model_dir):
    on, off = overlap_config(tiny_model_dir), overlap_config(tiny_model_dir, overlap_behaviour_logprobs=False)
    assert overlaps_behaviour_logprobs(on) and not overlaps_behaviour_logprobs(off)
    assert training_identity(on) == training_identity(off) and training_hash(on) == training_hash(off)
    assert not overlaps_behaviour_logprobs(overlap_config(tiny_model_dir, max_off_policy_steps=0))
    assert not overlaps_behaviour_logprobs(overlap_config(tiny_model_dir, behaviour_logprobs="sampler"))


# --- the flow, on the session's Prefect server ------------------------------------------------------------------

K1 = ["run.name=behaviour-overlap", "algorithm.rl.budget.max_steps=2", "algorithm.rl.max_off_policy_steps=1",
      'algorithm.rl.policy_sampler={ type = "hf", batch_size = 8 }']


def test_a_k1_run_ends_on_the_same_checkpoint_computing_them_while_sampling_or_staged(prefect_server, tmp_path):
    """rl-tiny, 2 steps at k = 1 (step 2 trains on rollouts one state stale), the flow in this process: the same
    checkpoint whether the streamed sample stages computed every behaviour logprob while sampling or a staged run
    (sample, then score, then the advantages stage's recompute) did. This is also the suite's k = 1 case of
    "streamed and staged runs end on the same checkpoint" (tests/test_streamed_scoring.py)."""
    from flows.train_rl import train_rl
    from rollout_lib.runlog.metrics_file import read_metrics

    runs = {}
    for streamed in (True, False):
        store = tmp_path / f"streamed-{streamed}"
        result = train_rl(config=str(ROOT / "configs/rl-tiny.toml"),
                          overrides=[*K1, f"run.store={store}", f"algorithm.rl.reward_loop.streamed={streamed}"])
        runs[streamed] = (result, read_metrics(ObjectStore(str(store)), "behaviour-overlap"))
    (on, on_steps), (off, off_steps) = runs[True], runs[False]
    assert on["checkpoint"] == off["checkpoint"] and on["reward_curve"] == off["reward_curve"]
    assert [m["behaviour/precomputed_rows"] for m in on_steps] == [32, 32]
    assert [m["behaviour/precomputed_rows"] for m in off_steps] == [0, 0]
    assert all(m["behaviour/recompute_s"] == 0.0 for m in on_steps)
