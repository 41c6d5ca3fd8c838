"""Sharded data parallelism (trainer/sharding.py, FSDP2 on gloo): 2 CPU ranks sharding parameters, gradients and
optimizer state (each rank holding half of them: counted) train what 2 ranks of plain data parallelism train, write
the same checkpoints, open on another rank count, and resume after a rank dies. Under `precision = "bf16"`
(MixedPrecisionPolicy) a rank's forward multiplies by bf16 weights gathered for it while it keeps fp32 shards.

Tolerances: losses within 1e-5 relative; weights within ADAMW_ATOL = 2e-5 absolute, since AdamW at lr 1e-2
magnifies last-bit differences of near-zero gradients (measured on the tiny model, 3 steps: SFT 2.5e-6 apart, with
weights moving ~3e-2; a wrong shard of the optimizer state moves them by ~1e-2); RL with SGD within 1e-6. RM (no clipping:
the sharded and unsharded sums of two ranks are the same additions) comes out bit-identical.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from clirun import train_in_process
from rollout_lib.identity.training import training_settings
from rollout_lib.checkpoint import read_manifest
from rollout_lib.config import RmConfig, SftConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.errors import ConfigError
from rollout_lib.identity.training import training_identity
from rollout_lib.rm.trainer import RewardModelTrainer
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.causal import CausalLmTrainer
from rollout_lib.trainer.data_parallel import KILL_RANK_ENV, DataParallelError
from rollout_lib.trainer.segment_group import run_segment_in_processes
from test_data_parallel import rm_inputs, sft_inputs, weights

ADAMW = {"algorithm.sft.optimizer.kind": "adamw", "algorithm.sft.optimizer.lr": 1e-2}
ADAMW_ATOL = 2e-5


def sft(store: str, nproc: int, sharding: str, steps: int = 3, cpu_offload: bool = False,
        precision: str = "fp32") -> SftConfig:
    bf16 = {"algorithm.sft.hardware.precision": "bf16", "algorithm.sft.hardware.allow_cpu_bf16": True}
    return load_config(SftConfig, "configs/sft-tiny.toml", {
        "run.store": store, "algorithm.sft.minibatch_size": 3, "algorithm.sft.gradient_accumulation": 3,
        "algorithm.sft.budget.max_steps": steps, **ADAMW, "algorithm.sft.hardware.nproc": nproc,
        "algorithm.sft.hardware.sharding": sharding, "algorithm.sft.hardware.cpu_offload": cpu_offload,
        **(bf16 if precision == "bf16" else {})})


def test_sharding_is_a_hardware_setting_checked_before_anything_runs():
    with pytest.raises(ConfigError) as raised:
        load_config(SftConfig, "configs/sft-tiny.toml", ["algorithm.sft.hardware.sharding=fsdp"])
    assert "algorithm.sft.hardware" in str(raised.value) and "set nproc >= 2" in str(raised.value)
    with pytest.raises(ConfigError, match='cpu_offload is FSDP2.s offload of the shards: set sharding = "fsdp"'):
        load_config(SftConfig, "configs/sft-tiny.toml", ["algorithm.sft.hardware.cpu_offload=true"])
    with pytest.raises(ConfigError, match="sharding"):
        load_config(SftConfig, "configs/sft-tiny.toml", ["algorithm.sft.hardware.sharding=zero3"])
    sharded = sft("/tmp/s", 2, "fsdp")
    assert training_settings(sharded)["hardware"] == {"nproc": 2, "sharding": "fsdp"}
    offloaded = load_config(SftConfig, "configs/sft-tiny.toml", {
        "algorithm.sft.hardware.nproc": 2, "algorithm.sft.hardware.sharding": "fsdp",
        "algorithm.sft.hardware.cpu_offload": True, **ADAMW, "run.store": "/tmp/s", "algorithm.sft.minibatch_size": 3,
        "algorithm.sft.gradient_accumulation": 3, "algorithm.sft.budget.max_steps": 3})
    assert training_identity(offloaded) == training_identity(sharded)  # where shards wait changes no number
    assert training_identity(sharded) != training_identity(sft("/tmp/s", 2, "none"))


def _held_by_rank(rank: int, inputs, start: str, batches, init_file: str, results) -> None:
    """One of 2 gloo ranks (torch.multiprocessing): the trainer sharded as a segment shards it, one step trained and
    snapshotted, then the elements this rank holds of the parameters, the optimizer state and (one more backward)
    the gradients, and the dtypes of each: of a decoder layer's weight as its forward sees it (gathered), and of what
    the rank keeps (its shards of the parameters, gradients and optimizer state)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from rollout_lib.trainer.data_parallel import DataParallelRank

    def held(tensors) -> int:
        return sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors)

    def dtypes(tensors) -> set[str]:
        return {str((t.to_local() if isinstance(t, DTensor) else t).dtype) for t in tensors}

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        trainer = CausalLmTrainer.from_checkpoint(inputs, start, batches=batches)
        trainer.data_parallel = DataParallelRank(rank, 2)
        trainer.shard()
        gathered = []  # inside its layer's FSDP unit: the weight its forward multiplies by, all-gathered
        q_proj = next(module for name, module in trainer.model.named_modules() if name.endswith("self_attn.q_proj"))
        q_proj.register_forward_pre_hook(lambda module, args: gathered.append(
            (str(module.weight.dtype), isinstance(module.weight, DTensor))))
        metrics = trainer.train_step(1)
        checkpoint = trainer.snapshot(metrics, [metrics])  # every rank gathers; rank 0 writes
        parameters = list(trainer.model.parameters())
        optimizer_state = [value for state in trainer.optimizer.state.values() for value in state.values()
                           if torch.is_tensor(value) and value.dim() > 0]
        ids = torch.tensor([[1, 5, 9, 200, 33, 7]])
        trainer.model(input_ids=ids).logits.sum().backward()
        results.put((rank, {"parameters": held(parameters), "gradients": held(p.grad for p in parameters),
                            "optimizer state": held(optimizer_state), "gathered": set(gathered),
                            "kept": dtypes([*parameters, *(p.grad for p in parameters), *optimizer_state]),
                            "metrics": metrics, "checkpoint": checkpoint}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_each_sharded_rank_holds_half_of_the_fp32_state_and_mixed_precision_computes_in_bf16(tmp_path):
    """Under `precision = "bf16"` (FSDP2's MixedPrecisionPolicy, trainer/sharding.py; allowed on this CPU with
    allow_cpu_bf16): each rank holds half of the parameters, gradients and optimizer state, all fp32 (the master
    weights), its forward multiplies by bf16 weights gathered for it, the checkpoint stores fp32, and the flows'
    segment (torchrun) trains the same step to the very same checkpoint. Mixed precision changes where numbers round,
    never how much a rank holds: one run under bf16 shows both.

    bf16 shows in the numbers: step 1's gradient norm is 1.8e-3 relative from the fp32 one of 1 process (2 fp32
    ranks: within 1e-5, above), while its loss, a forward of random weights, is 7e-7 apart (measured here)."""
    import torch
    import torch.multiprocessing as mp

    inputs, batches = sft_inputs(sft(str(tmp_path / "store"), 2, "fsdp", precision="bf16"))
    start = CausalLmTrainer.initial(inputs, batches=batches)
    whole = sum(p.numel() for p in start.model.parameters())  # tied embeddings once
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_held_by_rank, args=(rank, inputs, start.checkpoint_id, batches,
                                                         str(tmp_path / "rendezvous"), results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    held = dict(results.get(timeout=300) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
        assert process.exitcode == 0
    for part in ("parameters", "gradients", "optimizer state"):
        per_rank = [held[rank][part] for rank in (0, 1)]
        expected = whole * (2 if part == "optimizer state" else 1)  # AdamW: exp_avg and exp_avg_sq
        assert sum(per_rank) == expected and max(per_rank) <= 0.55 * expected, (part, per_rank, expected)
        print(f"{part}: {per_rank[0]} + {per_rank[1]} of {expected}")
    for rank in (0, 1):
        assert held[rank]["gathered"] == {("torch.bfloat16", False)}, held[rank]["gathered"]
        assert held[rank]["kept"] == {"torch.float32"}, held[rank]["kept"]
    checkpoint = held[0]["checkpoint"]
    manifest = read_manifest(inputs.store, checkpoint)
    stored = [*weights(inputs.store, checkpoint).values(), *inputs.store.get_tensors(manifest["optimizer"]).values()]
    assert {t.dtype for t in stored} == {torch.float32}

    one, _ = sft_inputs(sft(str(tmp_path / "store"), 1, "none"))
    reference = CausalLmTrainer.initial(one, batches=batches).train_step(1)
    bf16 = held[0]["metrics"]
    apart = abs(bf16["grad_norm"] - reference["grad_norm"]) / reference["grad_norm"]
    assert 1e-4 < apart < 2e-2, apart  # past fp32's rounding (1e-5), yet the same gradient
    assert bf16["loss"] == pytest.approx(reference["loss"], rel=1e-3)
    print(f"step 1, bf16 sharded vs fp32: grad norm {apart:.2g} relative apart, loss "
          f"{abs(bf16['loss'] - reference['loss']) / reference['loss']:.2g}")
    # The flows' path (torchrun, trainer/segment_worker.py): the same step, the same checkpoint id.
    assert run_segment_in_processes(CausalLmTrainer, inputs, start.checkpoint_id, 1, 1, 2,
                                    batches=batches)[0] == checkpoint


@pytest.fixture(scope="module")
def two_sharded_steps(tmp_path_factory) -> SimpleNamespace:
    """Steps 1-2 of sft() on 2 sharded ranks, one segment in a group of its own: the store, the start checkpoint and
    the step-2 checkpoint with its per-step metrics. Shared: the SFT test continues from it, and the kill test's
    rerun must end on it (max_steps is in no identity, so steps=2 and steps=3 are one training)."""
    store = str(tmp_path_factory.mktemp("sharded") / "store")
    inputs, batches = sft_inputs(sft(store, 2, "fsdp"))
    start = CausalLmTrainer.initial(inputs, batches=batches).checkpoint_id
    middle, history = run_segment_in_processes(CausalLmTrainer, inputs, start, 1, 2, 2, batches=batches)
    return SimpleNamespace(store=store, start=start, middle=middle, history=history)


@pytest.mark.slow
def test_sft_sharded_trains_what_plain_data_parallelism_trains_and_opens_on_another_rank_count(two_sharded_steps):
    store = two_sharded_steps.store
    plain, batches = sft_inputs(sft(store, 2, "none"))
    sharded, _ = sft_inputs(sft(store, 2, "fsdp"))
    start = CausalLmTrainer.initial(plain, batches=batches).checkpoint_id
    plain_end, plain_history = run_segment_in_processes(CausalLmTrainer, plain, start, 1, 3, 2, batches=batches)
    # Two segments: the second (in a group of its own) opens the first's checkpoint, so its AdamW state is cut into
    # shards.
    middle, first = two_sharded_steps.middle, two_sharded_steps.history
    end, second = run_segment_in_processes(CausalLmTrainer, sharded, middle, 3, 3, 2, batches=batches)
    history = first + second
    for ours, theirs in zip(history, plain_history):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["tokens/ce"] == theirs["tokens/ce"] and ours["micro_batches"] == 3
    a, b = weights(plain.store, plain_end), weights(sharded.store, end)
    assert a.keys() == b.keys()  # the same checkpoint: full tensors, tied duplicates left out as always
    assert max((a[n] - b[n]).abs().max().item() for n in a) <= ADAMW_ATOL
    plain_opt = plain.store.get_tensors(read_manifest(plain.store, plain_end)["optimizer"])
    sharded_opt = sharded.store.get_tensors(read_manifest(sharded.store, end)["optimizer"])
    assert {n: t.shape for n, t in plain_opt.items()} == {n: t.shape for n, t in sharded_opt.items()}

    # The step-2 checkpoint of 2 sharded ranks, continued by 3 sharded ranks (another identity: nproc enters it,
    # docs/hardware.md) and by 1 process: the same step within rounding.
    three, _ = sft_inputs(sft(store, 3, "fsdp"))
    on_three, _ = run_segment_in_processes(CausalLmTrainer, three, middle, 3, 3, 3, batches=batches)
    one, _ = sft_inputs(sft(store, 1, "none"))
    single = CausalLmTrainer.from_checkpoint(one, middle, batches=batches)
    single.train_step(3)
    c = weights(three.store, on_three)
    assert max((c[n] - b[n]).abs().max().item() for n in c) <= ADAMW_ATOL
    single_weights = {n: t.detach() for n, t in single.model.state_dict().items()}
    assert max((c[n] - single_weights[n]).abs().max().item() for n in c) <= ADAMW_ATOL


@pytest.mark.slow
def test_rm_sharded_writes_the_same_weights_and_optimizer_objects_as_plain_data_parallelism(tmp_path):
    store = str(tmp_path / "store")
    configs = {sharding: load_config(RmConfig, "configs/rm-tiny.toml", {
        "run.store": store, "algorithm.rm.minibatch_size": 3, "algorithm.rm.budget.max_steps": 2,
        "algorithm.rm.optimizer.kind": "adamw", "algorithm.rm.optimizer.lr": 1e-2,
        "algorithm.rm.hardware.nproc": 2, "algorithm.rm.hardware.sharding": sharding}) for sharding in ("none", "fsdp")}
    manifests = {}
    for sharding, config in configs.items():
        inputs = rm_inputs(config)
        start = RewardModelTrainer.initial(inputs).checkpoint_id
        end, _ = run_segment_in_processes(RewardModelTrainer, inputs, start, 1, 2, 2)
        manifests[sharding] = read_manifest(inputs.store, end)
    # Bits equal (no clipping here: two ranks' sums are the same additions sharded or not), so the stored objects
    # are the same objects: nothing of the sharding is in them. Only the manifest's identity names it.
    assert manifests["fsdp"]["weights"] == manifests["none"]["weights"]
    assert manifests["fsdp"]["optimizer"] == manifests["none"]["optimizer"]
    assert manifests["fsdp"]["training_identity"] != manifests["none"]["training_identity"]


@pytest.mark.slow
def test_a_rank_killed_mid_sharded_segment_fails_naming_it_and_the_rerun_ends_on_the_uninterrupted_checkpoint(
        two_sharded_steps, monkeypatch):
    """What the flows' segment task runs (trainer/data_parallel.py): the rerun of a failed segment starts again from
    its start checkpoint in the store. The rerun offloads its shards to the CPU (`cpu_offload`, FSDP2's
    CPUOffloadPolicy; on this CPU machine without pinned memory, which torch cannot pin without an accelerator):
    where shards wait is in no identity and changes no number, so it ends on the very same checkpoint: the
    uninterrupted segment's (`two_sharded_steps`, trained without offload in the same store; checkpoint ids are
    content, so the rerun's id equals it only if its bytes do)."""
    store = two_sharded_steps.store
    inputs, batches = sft_inputs(sft(store, 2, "fsdp", steps=2))
    start = CausalLmTrainer.initial(inputs, batches=batches).checkpoint_id
    assert start == two_sharded_steps.start
    expected = two_sharded_steps.middle
    monkeypatch.setenv(KILL_RANK_ENV, "1:2")  # rank 1 SIGKILLs itself as step 2 starts
    with pytest.raises(DataParallelError) as raised:
        run_segment_in_processes(CausalLmTrainer, inputs, start, 1, 2, 2, batches=batches)
    assert str(raised.value).startswith("train steps 1-2: data-parallel segment (2 processes) failed: rank 1 exited "
                                        "with code -9")
    monkeypatch.delenv(KILL_RANK_ENV)
    offloaded, _ = sft_inputs(sft(store, 2, "fsdp", steps=2, cpu_offload=True))
    assert run_segment_in_processes(CausalLmTrainer, offloaded, start, 1, 2, 2, batches=batches)[0] == expected


@pytest.mark.slow
def test_rl_sharded_trains_what_one_process_trains(prefect_server, tmp_path):
    ends = {}
    for nproc, sharding in (("1", "none"), ("2", "fsdp")):
        args = ("train", "rl", "--config", "configs/rl-tiny.toml",
                "--set", f"algorithm.rl.hardware.sharding={sharding}", "--set", "algorithm.rl.budget.max_steps=2", "--set", "algorithm.rl.checkpoint_interval=1",
                # SGD: AdamW magnifies the last bits of near-zero gradients (its state is tested above)
                "--set", "algorithm.rl.optimizer.kind=sgd", "--set", "algorithm.rl.optimizer.lr=0.05",
                "--store", str(tmp_path / sharding), "--nproc", nproc)
        # the flow in this process (what the CLI runs, its start-up saved); the sharded ranks are torchrun's
        ends[sharding] = (ObjectStore(str(tmp_path / sharding)), train_in_process(*args)["checkpoint"])
    a, b = (weights(store, checkpoint) for store, checkpoint in ends.values())
    assert a.keys() == b.keys() and max((a[n] - b[n]).abs().max().item() for n in a) <= 1e-6
    losses = [read_manifest(store, checkpoint)["metrics"]["loss"] for store, checkpoint in ends.values()]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-6)
