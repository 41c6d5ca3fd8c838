"""LoRA adapters end to end (rollout_lib/adapters.py): what trains, what a checkpoint holds, how it exports and is
used again, the policy server loading each step's adapter, and resume."""

from __future__ import annotations

import asyncio
import copy
import json
import re

import pytest
import torch

from clirun import final_result, run_rollout
from rollout_lib.identity.training import training_settings
from rollout_lib.adapters import LoraSettings, adapter_weights, is_adapted, target_problem, with_adapter
from rollout_lib.checkpoint import ADAPTER_KEY, load_model_weights, model_weights, read_manifest
from rollout_lib.config import RlConfig, RmConfig, SftConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.errors import ConfigError
from rollout_lib.model.loading import load_causal_lm, load_tokenizer, model_content_digest, resolve_model
from rollout_lib.serving.policy_server import lora_server_args
from rollout_lib.settings_base import ModelRef
from rollout_lib.store import ObjectStore

LORA = ["--set", "algorithm.sft.adapter.r=4", "--set", "algorithm.sft.optimizer.kind=adamw",
        "--set", "algorithm.sft.optimizer.lr=1e-2"]


def tiny_lora(seed: int = 0, r: int = 4):
    torch.manual_seed(seed)
    return with_adapter(load_causal_lm(resolve_model("tiny:qwen2")), LoraSettings(r=r), task="causal_lm",
                        where="algorithm.sft.adapter")


def test_the_adapter_is_a_setting_that_enters_the_identity_only_when_set():
    plain = load_config(SftConfig, "configs/sft-tiny.toml")
    assert "adapter" not in training_settings(plain)  # identities of full fine-tuning runs stay what they were
    lora = load_config(SftConfig, "configs/sft-tiny.toml", ["algorithm.sft.adapter.r=8"])
    assert training_settings(lora)["adapter"] == {"type": "lora", "r": 8, "alpha": 32.0, "dropout": 0.0,
                                                   "target_modules": "all-linear"}
    rl = load_config(RlConfig, "configs/rl-tiny.toml", ["algorithm.rl.adapter.target_modules=[\"q_proj\"]"])
    assert rl.settings.adapter.target_modules == ["q_proj"]


def test_target_modules_that_match_nothing_fail_at_plan_time_naming_the_setting():
    with pytest.raises(ConfigError) as raised:
        load_config(SftConfig, "configs/sft-tiny.toml", ['algorithm.sft.adapter.target_modules=["q_proj","vproj"]'])
    message = str(raised.value)
    assert "algorithm.sft.adapter.target_modules" in message and "'vproj' matches no module of Qwen2ForCausalLM" in message
    assert "q_proj" in message.split("its linear layers are")[1]  # what would fit is named
    with pytest.raises(ConfigError, match="algorithm.rm.adapter.target_modules: 'nope'"):
        load_config(RmConfig, "configs/rm-tiny.toml", ['algorithm.rm.adapter.target_modules=["nope"]'])
    with pytest.raises(ConfigError, match="name at least one module"):
        load_config(SftConfig, "configs/sft-tiny.toml", ["algorithm.sft.adapter.target_modules=[]"])
    # A base whose config is not at hand without loading (a GGUF file) is checked when the trainer builds it.
    model = load_causal_lm(resolve_model("tiny:qwen2"))
    assert "'vproj' matches no module" in target_problem(model, LoraSettings(target_modules=["vproj"]))
    assert target_problem(model, LoraSettings(target_modules=["v_proj", "mlp.up_proj"])) is None


def test_only_the_adapter_trains_and_a_checkpoint_holds_its_weights_in_peft_names():
    model = tiny_lora()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    weights = model_weights(model)  # what a checkpoint stores
    assert set(weights) == set(adapter_weights(model))
    assert all(name.startswith("base_model.model.") and ".default." not in name for name in weights)
    assert all(torch.count_nonzero(t) == 0 for name, t in weights.items() if "lora_B" in name)  # starts as its base

    other = tiny_lora(seed=1)
    assert not torch.equal(model_weights(other)[next(iter(weights))], weights[next(iter(weights))])
    load_model_weights(other, weights)
    assert all(torch.equal(model_weights(other)[name], tensor) for name, tensor in weights.items())
    with pytest.raises(Exception, match="do not fit"):
        load_model_weights(other, {name: t for name, t in list(weights.items())[1:]})


def test_lora_ranks_map_onto_the_ranks_vllm_serves():
    assert lora_server_args(4)[:3] == ["--enable-lora", "--max-lora-rank", "8"]
    assert lora_server_args(16)[2] == "16" and lora_server_args(17)[2] == "32"
    with pytest.raises(ValueError, match="above the largest"):
        lora_server_args(1024)


# --- through the flows ----------------------------------------------------------------------------------------


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


@pytest.mark.slow
def test_sft_with_lora_exports_a_peft_directory_and_merged_weights_and_serves_as_a_base_model(prefect_server,
                                                                                              tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    store = tmp_path / "store"
    done = run_rollout("train", "sft", "--config", "configs/sft-tiny.toml", *LORA, "--set", f"run.store={store}")
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = final_result(done)["checkpoint"]
    manifest = read_manifest(ObjectStore(str(store)), checkpoint)
    record = manifest[ADAPTER_KEY]
    assert record["base_model"] == "tiny:qwen2" and record["base_model_content"] == model_content_digest("tiny:qwen2")
    assert record["config"]["r"] == 4 and record["config"]["target_modules"] == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    weights = ObjectStore(str(store)).get_tensors(manifest["weights"])
    assert all("lora_" in name for name in weights) and len(weights) == 2 * 7 * 2  # A and B, 7 modules, 2 layers

    peft_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    for out, extra in ((peft_dir, []), (merged_dir, ["--merged"])):
        exported = run_rollout("export", "--checkpoint", checkpoint, "--store", str(store), "--out", str(out), *extra)
        assert exported.returncode == 0, exported.stderr[-2000:]
    assert json.loads((peft_dir / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert not (peft_dir / "model.safetensors").exists() and (merged_dir / "model.safetensors").exists()

    ids = [1, 5, 9, 200, 33, 7, 12]
    base = load_causal_lm(resolve_model("tiny:qwen2"))
    with_peft = logits_of(PeftModel.from_pretrained(copy.deepcopy(base), str(peft_dir)), ids)
    merged = logits_of(AutoModelForCausalLM.from_pretrained(merged_dir), ids)
    assert torch.allclose(with_peft, merged, atol=1e-5)  # the PEFT directory and the merged weights agree
    assert (with_peft - logits_of(base, ids)).abs().max() > 1e-3  # and the adapter trained

    # The checkpoint as a model reference (a base_model, a teacher): its merged weights.
    as_reference = resolve_model(ModelRef(uri=checkpoint, store=str(store)))
    reloaded = AutoModelForCausalLM.from_pretrained(as_reference.source)
    assert torch.allclose(logits_of(reloaded, ids), merged, atol=1e-5)


@pytest.mark.slow
def test_a_lora_reward_model_trains_its_head_in_full_and_scores_the_same_from_the_store(prefect_server, tmp_path):
    from rollout_lib.model.reward import reward_scores
    from rollout_lib.rm.checkpoints import load_reward_checkpoint
    from rollout_lib.rm.trainer import RewardModelTrainer
    from rollout_lib.trainer.base import TrainingInputs

    store = tmp_path / "store"
    done = run_rollout("train", "rm", "--config", "configs/rm-tiny.toml", "--set", "algorithm.rm.adapter.r=4",
                       "--set", f"run.store={store}")
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = final_result(done)["checkpoint"]
    weights = ObjectStore(str(store)).get_tensors(read_manifest(ObjectStore(str(store)), checkpoint)["weights"])
    heads = [name for name in weights if "lora_" not in name]
    assert heads == ["base_model.model.score.weight"]  # the score head, in full

    config = load_config(RmConfig, "configs/rm-tiny.toml", ["algorithm.rm.adapter.r=4", f"run.store={store}"])
    trainer = RewardModelTrainer.from_checkpoint(TrainingInputs(ObjectStore(str(store)), config, ""), checkpoint)
    assert is_adapted(trainer.model)
    merged, _ = load_reward_checkpoint(ObjectStore(str(store)), checkpoint)
    ids = torch.tensor([[1, 5, 9, 200, 33], [4, 8, 15, 16, 23]])
    mask = torch.ones_like(ids)
    trainer.model.eval()
    with torch.no_grad():
        assert torch.allclose(reward_scores(trainer.model, ids, mask), reward_scores(merged, ids, mask), atol=1e-5)


def test_a_lora_trainer_reopened_from_its_checkpoint_continues_to_the_uninterrupted_checkpoint(tmp_path):
    """What a rerun after a kill does (trainer/segment.py): open the last snapshot, replay the steps after it. An
    adapter checkpoint holds only the adapter and its AdamW state; the frozen base comes from the base model."""
    from test_data_parallel import sft_inputs
    from rollout_lib.trainer.causal import CausalLmTrainer

    config = load_config(SftConfig, "configs/sft-tiny.toml", {
        "run.store": str(tmp_path / "store"), "algorithm.sft.minibatch_size": 3,
        "algorithm.sft.gradient_accumulation": 3, "algorithm.sft.budget.max_steps": 3,
        "algorithm.sft.optimizer.kind": "adamw", "algorithm.sft.optimizer.lr": 1e-2, "algorithm.sft.adapter.r": 4})
    inputs, batches = sft_inputs(config)
    uninterrupted = CausalLmTrainer.initial(inputs, batches=batches)
    for step in (1, 2):
        uninterrupted.train_step(step)
    middle = uninterrupted.snapshot(metrics={})
    uninterrupted.train_step(3)
    expected = uninterrupted.snapshot(metrics={})
    reopened = CausalLmTrainer.from_checkpoint(inputs, middle, batches=batches)
    assert is_adapted(reopened.model) and reopened.step == 2
    reopened.train_step(3)
    assert reopened.snapshot(metrics={}) == expected


@pytest.mark.slow
def test_the_policy_server_loads_each_steps_adapter_in_place_and_the_probe_checks_it(tiny_model_dir):
    from rollout_lib.serving.policy_server import PolicyServerError, PolicyServerSpec, trainer_logprobs
    from rollout_lib.serving.served import ServedModels

    tokenizer = load_tokenizer(resolve_model(str(tiny_model_dir)))
    model = tiny_lora(r=8)
    with torch.no_grad():  # a trained adapter: B away from zero, so the adapter changes the logprobs
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    with ServedModels() as served:
        server = served.policy_server(PolicyServerSpec(ModelRef(uri=str(tiny_model_dir)), adapter_rank=8))
        first = server.hold("state-a", model, tokenizer)
        assert first.max_probe_diff < 1e-4 and server.served_name.endswith("-adapter")
        assert not (server.weights.directory.parent / "model.safetensors").exists()  # no full weights written
        ids = tokenizer("one two three, the sea and the sky", add_special_tokens=False)["input_ids"]
        served_logprobs = asyncio.run(server.pool.score(ids))
        assert max(abs(a - b) for a, b in zip(served_logprobs, trainer_logprobs(model, ids))) < 1e-4
        base_logprobs = trainer_logprobs(load_causal_lm(resolve_model(str(tiny_model_dir))), ids)
        assert max(abs(a - b) for a, b in zip(served_logprobs, base_logprobs)) > 1e-3  # the adapter is applied

        nudged = copy.deepcopy(model)
        with torch.no_grad():
            for name, parameter in nudged.named_parameters():
                if "lora_B" in name:
                    parameter.add_(0.05)
        second = server.hold("state-b", nudged, tokenizer)  # loaded in place under the same name
        assert second.max_probe_diff < 1e-4 and second.seconds < first.seconds + 1
        with pytest.raises(PolicyServerError, match="does not hold policy state state-a"):
            server.check("state-a", model, tokenizer)  # the server now serves the nudged adapter, not the first


@pytest.mark.slow
def test_an_rl_run_samples_its_lora_policy_on_the_engine_loading_each_steps_adapter(prefect_server, tmp_path):
    """`train rl` (the flow, in this process) with a LoRA policy sampled on the engine (`adapter_serving = "lora"`,
    the default): the run starts its policy server with --enable-lora, which loads each step's adapter in place (2
    loads in vLLM's log: the initial adapter for step 1, step 1's for step 2), each passing the probe; the
    checkpoint holds the adapter alone. (`adapter_serving = "merged"` is run on the full-weights policy server of
    tests/test_policy_remote.py, which is started there anyway.)"""
    from clirun import train_in_process
    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.serving import engine
    from test_rl_data_parallel import assert_adapter_checkpoint

    def policy_logs() -> dict:
        return {path: path.stat().st_size for path in engine.serve_dir().glob("policy-*.log")}

    before = policy_logs()
    store = ObjectStore(str(tmp_path / "store"))
    done = train_in_process("train", "rl", "--config", "configs/rl-tiny.toml", "--set", "algorithm.rl.adapter.r=4",
                            "--set", 'algorithm.rl.policy_sampler={ type = "vllm", concurrency = 8 }',
                            "--store", store.root, "--name", "rl-lora-engine", "--max-steps", "2")
    assert len(done["reward_curve"]) == 2
    manifest = read_manifest(store, done["checkpoint"])
    assert manifest["step"] == 2
    assert_adapter_checkpoint({"manifest": manifest, "weights": store.get_tensors(manifest["weights"])})
    steps = [record for record in read_metrics(store, "rl-lora-engine") if record["step"] > 0]
    assert [record["policy_server/reloads"] for record in steps] == [1, 1], steps
    assert all(record["policy_server/probe_diff"] < 1e-3 for record in steps), steps
    logged = "".join(path.read_bytes()[before.get(path, 0):].decode(errors="replace") for path in policy_logs())
    loads = re.findall(r"Loaded new LoRA adapter: name '(policy-\S+-adapter)'", logged)
    assert len(loads) == 2 and len(set(loads)) == 1, loads  # in place, under one name
    assert "reload_weights" not in logged  # the base's weights never moved
    assert not [d for d in engine.running_deployments() if d.live_policy]  # the run stopped its server
