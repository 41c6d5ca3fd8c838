"""The CUDA paths, checked on a GPU machine in one short run (no Prefect, no vLLM: the library's trainers alone).

    python bench/gpu_check.py [--smollm2-config DIR] [--steps 5]

1. parity   tiny SFT, 3 steps: CUDA fp32 against CPU fp32 (losses within 1e-4 relative), CUDA bf16 autocast
            (finite, close), LoRA on CUDA (only the adapter moves), a LoRA reward model on CUDA
2. sharded  the FSDP2 path on nccl: one rank (a GPU per rank; a one-GPU machine has one), SFT tiny 3 steps from
            the same start checkpoint as an unsharded CUDA run: the same losses, a gathered checkpoint; then steps
            1-2 and step 3 from their checkpoint (AdamW state streamed to the ranks): the same final weights
3. speed    an rl-smollm2 train step (32 x 64 tokens, packed, grpo-like) on a SmolLM2-135M-shaped model (random
            weights from its config.json: --smollm2-config), timed after a warm-up: fp32, bf16 autocast, LoRA
            r=16 bf16, full fine-tuning tokens/s and achieved TFLOP/s

Prints one line per check and a JSON summary at the end (`GPU_CHECK {...}`); exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SUMMARY: dict = {}


def check(name):
    def wrap(fn):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
                SUMMARY[name] = {"ok": True, **(result or {}), "seconds": round(time.perf_counter() - started, 1)}
                print(f"PASS {name}: {json.dumps(result)}", flush=True)
            except Exception as exc:  # noqa: BLE001 - every check reports, the run goes on
                SUMMARY[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc()
        return run
    return wrap


def sft_setup(store_dir: str, overrides: dict):
    from rollout_lib.config import SftConfig
    from rollout_lib.plan_checks import load_config
    from rollout_lib.data import load_examples
    from rollout_lib.determinism import plan_batches
    from rollout_lib.identity.training import training_identity
    from rollout_lib.model.loading import resolve_model
    from rollout_lib.sft.batches import plan_micro_batches
    from rollout_lib.sft.tokenize import sft_tokenizer, tokenize_examples
    from rollout_lib.store import ObjectStore
    from rollout_lib.trainer.base import TrainingInputs
    from rollout_lib.trainer.causal import PlannedBatches

    config = load_config(SftConfig, ROOT / "configs/sft-tiny.toml", {
        "run.store": store_dir, "algorithm.sft.minibatch_size": 2, "algorithm.sft.budget.max_steps": 3,
        "algorithm.sft.optimizer.kind": "adamw", "algorithm.sft.optimizer.lr": 1e-2,
        "algorithm.sft.dataset.path": str(ROOT / "data/sft-tiny.jsonl"), **overrides})
    settings = config.settings
    store = ObjectStore(config.run.store)
    tokenized = tokenize_examples(load_examples(settings.dataset.path), sft_tokenizer(resolve_model(settings.base_model)),
                                  loss_on=settings.loss_on.kind, max_seq_len=settings.packing.max_seq_len,
                                  source=settings.dataset.path)
    plan = plan_batches(tokenized.samples.num_rows, settings.minibatch_size, 3, config.run.seed)
    micro_batches, plan = plan_micro_batches(tokenized.samples, plan, settings)
    inputs = TrainingInputs(store, config, training_identity(config), {"samples": store.put_table(tokenized.samples)})
    return inputs, PlannedBatches(store, store.put_table(micro_batches), store.put_table(plan))


def sft_losses(store_dir: str, overrides: dict) -> tuple[list[float], object]:
    from rollout_lib.trainer.causal import CausalLmTrainer

    inputs, batches = sft_setup(store_dir, overrides)
    trainer = CausalLmTrainer.initial(inputs, batches=batches)
    return [trainer.train_step(step)["loss"] for step in (1, 2, 3)], trainer


@check("parity")
def parity(tmp: str) -> dict:
    import math

    import torch

    cpu, _ = sft_losses(f"{tmp}/cpu", {"algorithm.sft.hardware.device": "cpu"})
    cuda, trainer = sft_losses(f"{tmp}/cuda", {"algorithm.sft.hardware.device": "cuda"})
    assert next(trainer.model.parameters()).device.type == "cuda"
    worst = max(abs(a - b) / abs(a) for a, b in zip(cpu, cuda))
    assert worst < 1e-4, (cpu, cuda)
    bf16, _ = sft_losses(f"{tmp}/bf16", {"algorithm.sft.hardware.device": "cuda",
                                         "algorithm.sft.hardware.precision": "bf16"})
    assert all(math.isfinite(x) for x in bf16) and abs(bf16[0] - cpu[0]) / cpu[0] < 2e-2, bf16
    lora, lora_trainer = sft_losses(f"{tmp}/lora", {"algorithm.sft.hardware.device": "cuda",
                                                    "algorithm.sft.adapter.r": 8})
    from rollout_lib.adapters import adapter_weights
    moved = max(t.abs().max().item() for n, t in adapter_weights(lora_trainer.model).items() if "lora_B" in n)
    assert moved > 0 and lora[-1] < lora[0], lora
    snapshot = lora_trainer.snapshot(metrics={})
    rm = rm_on_cuda(f"{tmp}/rm")
    return {"device": torch.cuda.get_device_name(0), "cpu_losses": cpu, "cuda_losses": cuda,
            "max_relative_loss_diff": worst, "bf16_losses": bf16, "lora_losses": lora,
            "lora_checkpoint": snapshot[:16], "rm": rm}


def rm_on_cuda(store_dir: str) -> dict:
    from rollout_lib.config import RmConfig
    from rollout_lib.plan_checks import load_config
    from rollout_lib.data import load_pairs
    from rollout_lib.identity.training import training_identity
    from rollout_lib.model.loading import load_tokenizer, resolve_model
    from rollout_lib.rm.pairs import tokenize_pairs
    from rollout_lib.rm.trainer import RewardModelTrainer
    from rollout_lib.store import ObjectStore
    from rollout_lib.trainer.base import TrainingInputs

    config = load_config(RmConfig, ROOT / "configs/rm-tiny.toml", {
        "run.store": store_dir, "algorithm.rm.hardware.device": "cuda", "algorithm.rm.adapter.r": 8,
        "algorithm.rm.dataset.path": str(ROOT / "data/rm-tiny.jsonl")})
    store = ObjectStore(store_dir)
    table = tokenize_pairs(load_pairs(config.settings.dataset.path),
                           load_tokenizer(resolve_model(config.settings.base_model)), config.settings.max_seq_len)
    inputs = TrainingInputs(store, config, training_identity(config), {"tokenized": store.put_table(table)})
    trainer = RewardModelTrainer.initial(inputs)
    losses = [trainer.train_step(step)["loss"] for step in (1, 2)]
    return {"lora_rm_losses": losses, "checkpoint": trainer.snapshot(metrics={})[:16]}


@check("sharded")
def sharded(tmp: str) -> dict:
    import torch

    from rollout_lib.checkpoint import read_manifest
    from rollout_lib.trainer.causal import CausalLmTrainer
    from rollout_lib.trainer.segment_group import run_segment_in_processes

    plain, _ = sft_losses(f"{tmp}/plain", {"algorithm.sft.hardware.device": "cuda"})
    # nproc = 2 in the settings (sharding needs it); one process launched: this machine has one GPU.
    inputs, batches = sft_setup(f"{tmp}/sharded", {"algorithm.sft.hardware.device": "cuda",
                                                   "algorithm.sft.hardware.nproc": 2,
                                                   "algorithm.sft.hardware.sharding": "fsdp"})
    start = CausalLmTrainer.initial(inputs, batches=batches).checkpoint_id
    checkpoint, history = run_segment_in_processes(CausalLmTrainer, inputs, start, 1, 3, 1, batches=batches)
    losses = [m["loss"] for m in history]
    worst = max(abs(a - b) / abs(a) for a, b in zip(plain, losses))
    assert worst < 1e-4, (plain, losses)
    weights = inputs.store.get_tensors(read_manifest(inputs.store, checkpoint)["weights"])
    assert all(t.device.type == "cpu" for t in weights.values())
    # A later segment: steps 1-2, then step 3 from that checkpoint, whose AdamW state the sharded ranks receive
    # streamed from rank 0 over nccl (sharding.receive_optimizer_state), never whole on one rank. Step 3's update
    # reads that state, so the weights it ends on must be the uninterrupted run's.
    middle, first_two = run_segment_in_processes(CausalLmTrainer, inputs, start, 1, 2, 1, batches=batches)
    resumed_checkpoint, third = run_segment_in_processes(CausalLmTrainer, inputs, middle, 3, 3, 1, batches=batches)
    resumed = [m["loss"] for m in first_two + third]
    assert resumed == losses, (losses, resumed)
    resumed_weights = inputs.store.get_tensors(read_manifest(inputs.store, resumed_checkpoint)["weights"])
    weight_diff = max(float((weights[name] - resumed_weights[name]).abs().max()) for name in weights)
    assert weight_diff < 1e-6, weight_diff
    return {"nccl_fsdp_losses": losses, "unsharded_losses": plain, "max_relative_loss_diff": worst,
            "resumed_at_step_3_max_weight_diff": weight_diff, "torch": torch.__version__}


@check("speed")
def speed(config_dir: str, steps: int) -> dict:
    import copy

    import pyarrow as pa
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench_train_step import COMPLETION_TOKENS, SAMPLES, bare_step, step_flops, synthetic_samples
    from rollout_lib.adapters import LoraSettings, with_adapter
    from rollout_lib.config.common import OptimizerSettings
    from rollout_lib.hardware import ResolvedHardware, place_model
    from rollout_lib.model.packed_attention import use_packed_attention
    from rollout_lib.packing import batch_unpacked, pack_samples
    from rollout_lib.trainer.causal import train_on_micro_batches
    from rollout_lib.trainer.optim import build_optimizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    step_samples = synthetic_samples(int(base.get_input_embeddings().weight.shape[0]))

    def timed(step) -> float:
        seconds = []
        for index in range(steps + 1):
            torch.cuda.synchronize()
            started = time.perf_counter()
            step()
            torch.cuda.synchronize()
            if index:  # the first is a warm-up
                seconds.append(time.perf_counter() - started)
        return statistics.median(seconds)

    results = {}
    # (label, precision, LoRA, layout, copies of the rl-smollm2 step's 32 samples)
    # packed: one [1, T] row, per-sequence attention (model/packed_attention.py, the CPU-tuned path); packed_mask:
    # the same row under transformers' sdpa with its block-diagonal mask; padded: one [32, 64] batch.
    variants = [("fp32_packed", "fp32", False, "packed", 1), ("bf16_packed", "bf16", False, "packed", 1),
                ("bf16_packed_mask", "bf16", False, "packed_mask", 1), ("lora_bf16_packed_mask", "bf16", True,
                                                                         "packed_mask", 1),
                ("bf16_padded", "bf16", False, "padded", 1), ("lora_bf16_padded", "bf16", True, "padded", 1),
                ("bf16_packed_mask_x8", "bf16", False, "packed_mask", 8), ("bf16_padded_x8", "bf16", False, "padded", 8),
                ("bare_bf16_padded", "bf16", False, "bare", 1)]
    for label, precision, adapter, layout, copies in variants:
        where = step_samples.schema.get_field_index("sample_id")
        samples = pa.concat_tables([step_samples.set_column(where, step_samples.schema.field(where), pa.array(
            [f"{copy_index}/{sample}" for sample in step_samples.column("sample_id").to_pylist()]))
            for copy_index in range(copies)])
        tokens = samples.num_rows * len(samples.column("input_ids")[0])
        flops = step_flops(base, SAMPLES * COMPLETION_TOKENS) * copies
        model = copy.deepcopy(base)
        if layout == "packed":
            use_packed_attention(model)  # per-sequence attention: the CPU-tuned path
        if adapter:
            model = with_adapter(model, LoraSettings(r=16), task="causal_lm", where="bench")
        place_model(model, ResolvedHardware(torch.device("cuda"), precision))
        if layout == "bare":
            step = bare_step(model, samples, "fused", device="cuda")  # bench_train_step's loop, on the GPU
            with torch.autocast("cuda", dtype=torch.bfloat16):
                median = timed(step)
        else:
            packed = layout.startswith("packed")
            micro_batches = (pack_samples(samples, 2304 * copies) if packed
                             else batch_unpacked(samples, samples.num_rows))
            optimizer = build_optimizer(model.parameters(), OptimizerSettings(lr=1e-5))
            median = timed(lambda model=model, optimizer=optimizer, micro_batches=micro_batches, packed=packed:
                           train_on_micro_batches(model, optimizer, micro_batches, packed=packed,
                                                  pad_token_id=0, max_grad_norm=1.0))
        results[label] = {"s_per_step": round(median, 4), "tokens_per_s": round(tokens / median),
                          "tflops": round(flops / median / 1e12, 2),
                          "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
        print(f"  {label}: {results[label]}", flush=True)
        torch.cuda.reset_peak_memory_stats()
        del model
        torch.cuda.empty_cache()
    return {"step_tokens": step_samples.num_rows * len(step_samples.column("input_ids")[0]), **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2-config", default=None, help="a directory with SmolLM2-135M's config.json")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", choices=["parity", "sharded", "speed"], nargs="+", default=None)
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, {torch.cuda.get_device_name(0)}", flush=True)
    wanted = set(args.only or ["parity", "sharded", "speed"])
    with tempfile.TemporaryDirectory() as tmp:
        if "parity" in wanted:
            parity(tmp)
        if "sharded" in wanted:
            sharded(tmp)
    if args.smollm2_config and "speed" in wanted:
        speed(args.smollm2_config, args.steps)
    print("GPU_CHECK " + json.dumps(SUMMARY), flush=True)
    sys.exit(0 if all(entry["ok"] for entry in SUMMARY.values()) else 1)


if __name__ == "__main__":
    main()
