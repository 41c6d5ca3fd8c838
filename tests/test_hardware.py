"""The hardware settings (`[algorithm.<kind>.hardware]`, docs/hardware.md): validation and locators, "auto" resolved
on this machine, what enters the training identity, gradient checkpointing giving the same bits, bf16 autocast on
CPU, checkpoints that load and score on CPU whatever trained them. Tests marked `gpu` run a few SFT, RM and RL
pieces on CUDA and are skipped where torch sees no GPU."""

import uuid
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rollout_lib.identity.training import training_settings
from rollout_lib import wire
from rollout_lib.config import ConfigError, RmConfig, SftConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.hardware import HardwareSettings, hardware_settings
from rollout_lib.data import load_examples, load_pairs
from rollout_lib.model.loading import ResolvedModel, load_tokenizer
from rollout_lib.packing import collate_micro_batch, token_logprobs
from rollout_lib.rm.checkpoints import load_reward_checkpoint, score_with_checkpoint
from rollout_lib.rm.evaluate import evaluate_pairs
from rollout_lib.rm.pairs import tokenize_pairs
from rollout_lib.rm.trainer import RewardModelTrainer
from rollout_lib.sft.batches import plan_micro_batches
from rollout_lib.sft.evaluate import evaluate_nll
from rollout_lib.sft.tokenize import tokenize_examples
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer, PlannedBatches
from rollout_lib.checkpoint import read_manifest
from rollout_lib.determinism import plan_batches
from rollout_lib.hardware import CPU, hardware_of, is_checkpointing, resolve_hardware
from rollout_lib.identity.training import training_identity

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
ALLOW_CPU_BF16 = ["hardware.precision=bf16", "hardware.allow_cpu_bf16=true"]


def sft_config(*overrides: str, tiny_model_dir=None) -> SftConfig:
    base = [f"algorithm.sft.base_model.uri={tiny_model_dir}"] if tiny_model_dir else []
    return load_config(SftConfig, ROOT / "configs/sft-tiny.toml",
                       [*base, *(f"algorithm.sft.{o}" if o.startswith("hardware") else o for o in overrides)])


def rm_config(*overrides: str) -> RmConfig:
    return load_config(RmConfig, ROOT / "configs/rm-tiny.toml",
                       [f"algorithm.rm.{o}" if o.startswith("hardware") else o for o in overrides])


# --- settings ---------------------------------------------------------------------------------------------------


def test_defaults_are_auto_fp32_without_checkpointing():
    hardware = sft_config().settings.hardware
    assert hardware == HardwareSettings()
    assert (hardware.device, hardware.precision, hardware.gradient_checkpointing) == ("auto", "fp32", False)
    assert hardware_settings(object()) == HardwareSettings()  # a settings block without the field: the defaults


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_device_spellings_that_validate(device):
    assert rm_config(f"hardware.device={device}").settings.hardware.device == device


@pytest.mark.parametrize("override, locator, words", [
    ("hardware.device=gpu", "algorithm.rm.hardware.device", "should match pattern"),
    ("hardware.device=cuda:x", "algorithm.rm.hardware.device", "should match pattern"),
    ("hardware.precision=fp16", "algorithm.rm.hardware.precision", "fp32"),
    ("hardware.dtype=bf16", "algorithm.rm.hardware.dtype", ""),
])
def test_bad_settings_name_their_key(override, locator, words):
    with pytest.raises(ConfigError) as caught:
        rm_config(override)
    assert f"{locator}:" in str(caught.value) and words in str(caught.value)


def test_bf16_on_an_explicit_cpu_is_refused_unless_allowed():
    with pytest.raises(ConfigError) as caught:
        sft_config("hardware.device=cpu", "hardware.precision=bf16")
    assert "algorithm.sft.hardware.precision: bf16 autocast on device = \"cpu\"" in str(caught.value)
    assert "allow_cpu_bf16" in str(caught.value)
    assert sft_config("hardware.device=cpu", *ALLOW_CPU_BF16).settings.hardware.precision == "bf16"


# --- resolution on this machine ---------------------------------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="auto resolves to CUDA on this machine")
def test_auto_resolves_to_cpu_without_a_gpu():
    assert resolve_hardware(HardwareSettings()).device == torch.device("cpu")
    assert resolve_hardware(HardwareSettings()) == CPU


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_cuda_without_a_gpu_and_bf16_under_auto_on_cpu_fail_at_plan_time_naming_the_setting():
    with pytest.raises(ConfigError) as caught:
        training_hash(rm_config("hardware.device=cuda:0"))
    assert "algorithm.rm.hardware.device: 'cuda:0': CUDA is not available" in str(caught.value)
    # "auto" with bf16 is a GPU config: on a CPU-only machine it is refused rather than run slowly in bf16.
    with pytest.raises(ConfigError) as caught:
        training_hash(sft_config("hardware.precision=bf16"))
    assert "algorithm.sft.hardware.precision: bf16 with device = 'auto' runs on the CPU here" in str(caught.value)


def test_the_dry_run_plan_shows_the_resolved_device():
    from rollout_lib.plan import describe_plan

    hardware = describe_plan(sft_config("hardware.gradient_checkpointing=true"))["hardware"]
    assert hardware["gradient_checkpointing"] is True and hardware["device"] == "auto"
    assert hardware["resolved_device"] == ("cuda" if CUDA else "cpu")


# --- the training identity --------------------------------------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="auto resolves to CUDA on this machine")
def test_cpu_fp32_leaves_the_identity_as_it_was_and_checkpointing_never_enters_it():
    default = sft_config()
    assert "hardware" not in training_settings(default)
    assert "hardware" not in default.settings.model_dump(exclude={"hardware"})  # sanity: the block is a field
    same = [sft_config("hardware.device=cpu"), sft_config("hardware.gradient_checkpointing=true")]
    assert {training_hash(config) for config in same} == {training_hash(default)}
    bf16 = sft_config(*ALLOW_CPU_BF16)
    assert training_settings(bf16)["hardware"] == {"device": "cpu", "precision": "bf16"}
    assert training_hash(bf16) != training_hash(default)


def test_what_enters_the_identity_per_device_type():
    settings = HardwareSettings(precision="bf16")
    assert HardwareSettings().identity_settings("cpu") is None
    assert HardwareSettings().identity_settings("cuda") == {"device": "cuda", "precision": "fp32"}
    assert settings.identity_settings("cuda") == {"device": "cuda", "precision": "bf16"}
    deterministic = HardwareSettings(cuda_deterministic=True, gradient_checkpointing=True)
    assert deterministic.identity_settings("cuda") == {"device": "cuda", "precision": "fp32",
                                                       "cuda_deterministic": True}
    assert deterministic.identity_settings("cpu") is None  # CPU kernels are always deterministic


# --- runs on the tiny model -------------------------------------------------------------------------------------


def sft_run(tiny_model_dir, *overrides: str, packing: str = "on") -> TrainingInputs:
    config = sft_config(f"run.store=memory://hw-{uuid.uuid4().hex}", f"algorithm.sft.packing.kind={packing}",
                        "algorithm.sft.packing.max_seq_len=96", "algorithm.sft.budget.max_steps=3",
                        "algorithm.sft.minibatch_size=2", "algorithm.sft.optimizer.kind=adamw",
                        "algorithm.sft.optimizer.lr=1e-2", *overrides, tiny_model_dir=tiny_model_dir)
    store = ObjectStore(config.run.store)
    tokenizer = load_tokenizer(ResolvedModel(str(tiny_model_dir)))
    settings = config.settings
    samples = tokenize_examples(load_examples(ROOT / settings.dataset.path), tokenizer,
                                loss_on=settings.loss_on.kind, max_seq_len=settings.packing.max_seq_len).samples
    plan = plan_batches(samples.num_rows, settings.minibatch_size, settings.budget.max_steps, config.run.seed)
    micro_batches, micro_plan = plan_micro_batches(samples, plan, settings)
    return TrainingInputs(store, config, training_identity(config),
                          {"micro_batches": store.put_table(micro_batches), "plan": store.put_table(micro_plan)})


def sft_trainer(run: TrainingInputs, checkpoint_id: str | None = None) -> CausalLmTrainer:
    batches = PlannedBatches(run.store, run.data_ids["micro_batches"], run.data_ids["plan"])
    if checkpoint_id is None:
        return CausalLmTrainer.initial(run, batches=batches)
    return CausalLmTrainer.from_checkpoint(run, checkpoint_id, batches=batches)


def rm_run(tiny_model_dir, *overrides: str) -> TrainingInputs:
    config = rm_config(f"run.store=memory://hw-{uuid.uuid4().hex}", f"algorithm.rm.base_model={tiny_model_dir}",
                       "algorithm.rm.budget.max_steps=3", "algorithm.rm.optimizer.kind=adamw",
                       "algorithm.rm.optimizer.lr=1e-2", *overrides)
    store = ObjectStore(config.run.store)
    tokenizer = load_tokenizer(ResolvedModel(str(tiny_model_dir)))
    tokenized = tokenize_pairs(load_pairs(ROOT / "data/rm-tiny.jsonl"), tokenizer, config.settings.max_seq_len)
    return TrainingInputs(store, config, training_identity(config), {"tokenized": store.put_table(tokenized)})


def train(trainer, steps: int = 3) -> tuple[str, list[dict]]:
    metrics = [trainer.train_step(step) for step in range(1, steps + 1)]
    return trainer.snapshot(metrics[-1]), metrics


def loss_and_gradients(trainer: CausalLmTrainer, step: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's ce loss and the gradients it gives, in train mode (checkpointing is active only there)."""
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    row = trainer.batches.for_step(step).to_pylist()[0]
    batch = collate_micro_batch(row, packed=trainer.inputs.settings.packed,
                                pad_token_id=trainer.tokenizer.pad_token_id)
    logprobs = token_logprobs(model, batch)
    weights = batch["ce_weights"].to(logprobs.device)
    loss = -(weights * logprobs).sum() / (weights != 0).sum()
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packing", ["on", "off"])
def test_gradient_checkpointing_gives_bit_identical_loss_gradients_and_checkpoints(tiny_model_dir, packing):
    """Tolerance: none. On CPU the recomputed forward pass runs the same kernels on the same inputs, so the loss,
    every gradient and the trained weights are the same bits (hence the same checkpoint id: the identity leaves
    checkpointing out)."""
    plain = sft_trainer(sft_run(tiny_model_dir, packing=packing))
    checkpointed = sft_trainer(sft_run(tiny_model_dir, "hardware.gradient_checkpointing=true", packing=packing))
    assert is_checkpointing(checkpointed.model) and not is_checkpointing(plain.model)
    loss, grads = loss_and_gradients(plain)
    loss_gc, grads_gc = loss_and_gradients(checkpointed)
    assert torch.equal(loss, loss_gc)
    assert grads.keys() == grads_gc.keys() and len(grads) > 0
    assert all(torch.equal(grads[name], grads_gc[name]) for name in grads)
    plain.model.zero_grad(set_to_none=True)
    checkpointed.model.zero_grad(set_to_none=True)
    plain_id, plain_metrics = train(plain)
    gc_id, gc_metrics = train(checkpointed)
    assert [m["loss"] for m in plain_metrics] == [m["loss"] for m in gc_metrics]
    assert gc_id == plain_id


def test_reward_model_gradient_checkpointing_reaches_the_same_checkpoint(tiny_model_dir):
    plain_id, _ = train(RewardModelTrainer.initial(rm_run(tiny_model_dir)))
    checkpointed = RewardModelTrainer.initial(rm_run(tiny_model_dir, "hardware.gradient_checkpointing=true"))
    assert is_checkpointing(checkpointed.model)
    gc_id, _ = train(checkpointed)
    assert gc_id == plain_id


def test_bf16_autocast_on_cpu_trains_fp32_weights_with_a_loss_close_to_fp32(tiny_model_dir):
    fp32 = sft_trainer(sft_run(tiny_model_dir))
    bf16 = sft_trainer(sft_run(tiny_model_dir, *ALLOW_CPU_BF16))
    assert hardware_of(bf16.model).precision == "bf16" and bf16.inputs.identity != fp32.inputs.identity
    _, fp32_metrics = train(fp32)
    checkpoint, bf16_metrics = train(bf16)
    for a, b in zip(fp32_metrics, bf16_metrics):
        assert torch.isfinite(torch.tensor(b["loss"])) and b["grad_norm"] > 0
        # bf16 keeps 8 bits of mantissa: a step's mean token loss within 2% of fp32's (measured: < 0.1%).
        assert abs(a["loss"] - b["loss"]) <= 0.02 * abs(a["loss"]), (a["loss"], b["loss"])
        assert a["loss"] != b["loss"]  # autocast did run in bf16
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # master weights stay fp32
    weights = bf16.inputs.store.get_tensors(read_manifest(bf16.inputs.store, checkpoint)["weights"])
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in weights.values())


def test_bf16_with_checkpointing_resumes_from_a_snapshot_to_the_same_checkpoint_id_on_cpu(tiny_model_dir):
    run = sft_run(tiny_model_dir, "hardware.gradient_checkpointing=true", *ALLOW_CPU_BF16)
    kept = sft_trainer(run)
    snapshot = kept.snapshot(kept.train_step(1))
    resumed = sft_trainer(run, snapshot)  # what a new process does: rebuild, place, restore
    ids = [trainer.snapshot([trainer.train_step(step) for step in (2, 3)][-1]) for trainer in (kept, resumed)]
    assert ids[0] == ids[1]


def test_a_checkpoint_trained_with_the_settings_loads_and_scores_on_cpu(tiny_model_dir):
    run = rm_run(tiny_model_dir, "hardware.gradient_checkpointing=true", *ALLOW_CPU_BF16)
    trainer = RewardModelTrainer.initial(run)
    checkpoint, _ = train(trainer)
    # Reopened by a fp32 CPU run (another identity, so only the weights are compared) ...
    cpu_run = rm_run(tiny_model_dir, "hardware.device=cpu")
    cpu_run = TrainingInputs(run.store, cpu_run.config, cpu_run.identity, run.data_ids)
    reopened = RewardModelTrainer.from_checkpoint(cpu_run, checkpoint)
    assert hardware_of(reopened.model) == CPU
    for (name, trained), loaded in zip(trainer.model.state_dict().items(), reopened.model.state_dict().values()):
        assert torch.equal(trained.cpu(), loaded), name
    tokenized = run.store.get_table(run.data_ids["tokenized"], wire.TOKENIZED_PAIRS)
    metrics = evaluate_pairs(reopened.model, tokenized, reopened.tokenizer.pad_token_id, batch_size=4)
    assert metrics["pairs"] == tokenized.num_rows and 0.0 <= metrics["accuracy"] <= 1.0
    # ... and rebuilt from the store alone, without the base model, scoring responses.
    responses = pa.table({"prompt": ["Say hi.", "Say hi."], "response": ["Hello!", "no"]})
    scored = score_with_checkpoint(run.store, checkpoint, responses, max_seq_len=64)
    rewards = scored.column("reward").to_pylist()
    assert len(rewards) == 2 and all(torch.isfinite(torch.tensor(r)) for r in rewards)
    model, _ = load_reward_checkpoint(run.store, checkpoint)
    assert next(model.parameters()).device.type == "cpu"


def test_sft_evaluation_runs_where_the_model_is(tiny_model_dir):
    trainer = sft_trainer(sft_run(tiny_model_dir, "hardware.gradient_checkpointing=true"))
    metrics = evaluate_nll(trainer.model, trainer.batches.micro_batches, packed=True,
                           pad_token_id=trainer.tokenizer.pad_token_id)
    assert metrics["tokens"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))


# --- on CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="torch sees no CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_sft_steps_and_the_checkpoint_loads_and_evaluates_on_cpu(tiny_model_dir, precision):
    run = sft_run(tiny_model_dir, "hardware.device=cuda", f"hardware.precision={precision}",
                  "hardware.gradient_checkpointing=true")
    assert training_settings(run.config)["hardware"] == {"device": "cuda", "precision": precision}
    trainer = sft_trainer(run)
    assert next(trainer.model.parameters()).device.type == "cuda"
    checkpoint, metrics = train(trainer)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    on_gpu = evaluate_nll(trainer.model, trainer.batches.micro_batches, packed=True,
                          pad_token_id=trainer.tokenizer.pad_token_id)

    cpu_config = sft_run(tiny_model_dir, "hardware.device=cpu")
    cpu_run = TrainingInputs(run.store, cpu_config.config, cpu_config.identity, run.data_ids)
    reopened = sft_trainer(cpu_run, checkpoint)
    assert next(reopened.model.parameters()).device.type == "cpu"
    for (name, trained), loaded in zip(trainer.model.state_dict().items(), reopened.model.state_dict().values()):
        assert torch.equal(trained.cpu(), loaded), name
    on_cpu = evaluate_nll(reopened.model, trainer.batches.micro_batches, packed=True,
                          pad_token_id=reopened.tokenizer.pad_token_id)
    assert on_cpu["tokens"] == on_gpu["tokens"]
    assert abs(on_cpu["loss"] - on_gpu["loss"]) <= (1e-4 if precision == "fp32" else 2e-2) * on_cpu["loss"]
    # The same run on CUDA again: the steps rerun to the same checkpoint id (not promised; see docs/hardware.md).
    again, _ = train(sft_trainer(run))
    print(f"cuda {precision}: rerun reaches the same checkpoint id: {again == checkpoint}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="torch sees no CUDA device")
def test_gpu_rm_steps_and_the_checkpoint_scores_on_cpu(tiny_model_dir):
    run = rm_run(tiny_model_dir, "hardware.device=cuda", "hardware.precision=bf16",
                 "hardware.gradient_checkpointing=true")
    trainer = RewardModelTrainer.initial(run)
    assert next(trainer.model.parameters()).device.type == "cuda"
    checkpoint, metrics = train(trainer)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    responses = pa.table({"prompt": ["Say hi."], "response": ["Hello!"]})
    rewards = score_with_checkpoint(run.store, checkpoint, responses, max_seq_len=64).column("reward").to_pylist()
    assert torch.isfinite(torch.tensor(rewards[0]))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="torch sees no CUDA device")
def test_gpu_rl_pieces_sample_score_and_train_on_cuda(tiny_model_dir):
    """What an RL step runs in the training process: the embedded sampler on the policy, the embedded reward-model
    scorer, a causal optimizer step; all on CUDA, and the policy's checkpoint back on CPU."""
    from rollout_lib.reward.settings import RewardModelSettings
    from rollout_lib.reward.functions import RewardInput
    from rollout_lib.reward.reward_model import load_scorer
    from rollout_lib.sampling import SamplingParams
    from rollout_lib.sampling.hf import HfSampler, HfSamplerSettings
    from rollout_lib.hardware import resolve_hardware

    rm = rm_run(tiny_model_dir, "hardware.device=cuda")
    rm_checkpoint, _ = train(RewardModelTrainer.initial(rm), steps=1)
    policy = sft_trainer(sft_run(tiny_model_dir, "hardware.device=cuda", "hardware.precision=bf16"))
    prompts = pa.Table.from_pylist([{"example_id": "e/0", "env": "e", "answer": "1", "info": None, "source_line": 1,
                                     "messages": [{"role": "user", "content": "Say hi."}]}], schema=wire.PROMPTS)
    rollouts = HfSampler(HfSamplerSettings(), policy.model, policy.tokenizer).sample(
        prompts, SamplingParams(group_size=2, max_tokens=6, temperature=1.0), seed=0)
    assert rollouts.num_rows == 2
    scorer = load_scorer(RewardModelSettings(reward_model={"uri": rm_checkpoint, "store": rm.config.run.store}),
                         hardware=resolve_hardware(HardwareSettings(device="cuda")))
    assert next(scorer.model.parameters()).device.type == "cuda"
    scores = scorer.score_batch([RewardInput(prompt=[{"role": "user", "content": "Say hi."}], completion_text=text)
                                 for text in rollouts.column("completion_text").to_pylist()])
    assert all(isinstance(score, float) for score in scores), scores
    checkpoint, metrics = train(policy, steps=1)
    assert torch.isfinite(torch.tensor(metrics[0]["loss"]))
    weights = policy.inputs.store.get_tensors(read_manifest(policy.inputs.store, checkpoint)["weights"])
    assert all(t.device.type == "cpu" for t in weights.values())
