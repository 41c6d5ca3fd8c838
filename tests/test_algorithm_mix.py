"""One run, two envs of different algorithms: grpo on the toy env and opd distilling from a served teacher, through
the library's stages in-process (sample, score, advantages with the run's frozen models, pack, train step; no
Prefect), on the tiny policy.

The teacher is the session's vLLM deployment of tiny:qwen2 (`vllm_tiny`), reached as a server the user runs
(`{ base_url = [...], name = "test-tiny" }`): the policy's own base model, so at step 1 the reverse KL to it is ~0
(which also says the teacher's logprobs land on the policy's positions), and it grows once the policy moves.
That opd learns from a trained teacher is shown by tests/test_distillation.py; this test is about the wiring of
a mixed run: both components train in one optimizer step, and their samples share micro-batches."""

from __future__ import annotations

import json

import pytest
import torch

from rollout_lib.config import RlConfig
from rollout_lib.plan_checks import validate_config
from rollout_lib.rl.advantages import algorithm_resources, training_samples
from rollout_lib.rl.pack import pack
from rollout_lib.rl.policy import initial_policy, policy_at, policy_inputs, train_policy_step
from rollout_lib.rl.prompts import check_distinct_examples, load_prompts
from rollout_lib.rl.sample import build_samplers, sample_rollouts
from rollout_lib.rl.score import run_reward_loops, score_rollouts
from rollout_lib.serving.served import ServedModels
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.resident import ResidentTrainer

pytestmark = pytest.mark.slow

STEPS = 3


def mixed_config(tmp_path, vllm_tiny) -> RlConfig:
    def prompts(name: str, texts: list[str]) -> str:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
        return str(path)

    env = {"prompts_per_step": 2, "sampling": {"group_size": 3, "temperature": 1.0, "max_tokens": 12},
           # A length in characters: rewards within a group differ, so grpo's advantages are non-zero.
           "rewards": [{"function": "target_length", "kwargs": {"target": 40, "unit": "chars"}}]}
    return validate_config(RlConfig, {
        "run": {"name": "mixed", "seed": 7, "store": "memory://algorithm-mix"},
        "algorithm": {"rl": {
            "base_model": "tiny:qwen2", "max_seq_len": 64, "micro_batch_tokens": 192,
            "optimizer": {"kind": "adamw", "lr": 1e-2}, "budget": {"max_steps": STEPS},
            "reward_loop": {"concurrency": 8, "timeout_s": 60},
            "envs": [
                {**env, "name": "words", "algo": {"type": "grpo"}, "source": {
                    "type": "jsonl_path", "path": prompts("words", ["Write a few words.", "Say something.",
                                                                    "Name some animals."])}},
                {**env, "name": "distill", "source": {
                    "type": "jsonl_path", "path": prompts("distill", ["Tell me about the sea.", "Describe the sky.",
                                                                      "Hello! How are you?"])},
                 "algo": {"type": "opd", "teacher": {"base_url": vllm_tiny.base_urls, "name": vllm_tiny.name}}},
            ],
        }},
    })


def component_grad_norms(model, micro_batch: dict) -> dict[str, float]:
    """The gradient norm each component alone gives on one micro-batch (the other's weights zeroed), through the
    trainer's own collate, logprobs and loss; gradients are cleared afterwards."""
    from rollout_lib.losses import component_loss, count_component_tokens
    from rollout_lib.packing import collate_micro_batch, token_logprobs

    batch = collate_micro_batch(micro_batch, packed=True, pad_token_id=0)
    norms = {}
    for component, other in (("rl", "ref_kl_weights"), ("ref_kl", "rl_weights")):
        alone = {**batch, other: torch.zeros_like(batch[other])}
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss, _ = component_loss(token_logprobs(model, alone), alone, count_component_tokens(alone))
            loss.backward()
        norms[component] = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()
                                                if p.grad is not None)))
    model.zero_grad(set_to_none=True)
    return norms


def test_a_run_of_grpo_and_opd_trains_both_in_mixed_micro_batches(tmp_path, vllm_tiny):
    vllm_tiny.ensure_running()
    cfg = mixed_config(tmp_path, vllm_tiny)
    store = ObjectStore(cfg.run.store)
    prompts = {env.name: load_prompts(env) for env in cfg.settings.envs}
    check_distinct_examples(prompts)
    run = policy_inputs(store, cfg, {name: store.put_table(table) for name, table in prompts.items()})

    steps = []
    with ResidentTrainer() as resident, run_reward_loops(cfg) as reward_loops, \
            ServedModels(cfg.run.store) as served_models:
        resources = algorithm_resources(cfg, served_models=served_models)
        state = start = initial_policy(run, resident)
        initial = {name: tensor.clone() for name, tensor in policy_at(run, state, resident).model.state_dict().items()}
        for step in range(1, STEPS + 1):
            policy = policy_at(run, state, resident)
            rollouts, _ = sample_rollouts(cfg, build_samplers(cfg, policy.model, policy.tokenizer), prompts, step)
            scored, _ = score_rollouts(cfg, rollouts, prompts, reward_loops)
            samples, advantage_metrics = training_samples(cfg, scored, resources)
            micro_batches, _ = pack(cfg, samples)
            envs = dict(zip(samples.column("sample_id").to_pylist(), samples.column("env").to_pylist()))
            mixed = [row for row in micro_batches.to_pylist() if len({envs[i] for i in row["sample_ids"]}) == 2]
            norms = component_grad_norms(policy.model, mixed[0]) if mixed else None
            state, metrics = train_policy_step(run, state, step, store.put_table(micro_batches), resident)
            steps.append({"samples": samples, "micro_batches": micro_batches, "metrics": metrics,
                          "advantage_metrics": advantage_metrics, "grad_norms": norms})
        trained = policy_at(run, state, resident).model.state_dict()

    print("ref_kl/kl per step:", [round(s["metrics"]["ref_kl/kl"], 5) for s in steps])
    print("loss/rl, loss/ref_kl per step:", [(s["metrics"]["loss/rl"], s["metrics"]["loss/ref_kl"]) for s in steps])
    print("gradient norm of each component alone on a mixed micro-batch:", [s["grad_norms"] for s in steps])
    print("micro-batch sizes per step:", [[len(row) for row in s["micro_batches"].column("sample_ids").to_pylist()]
                                            for s in steps])
    for step, record in enumerate(steps, start=1):
        samples, metrics = record["samples"], record["metrics"]
        env_of = dict(zip(samples.column("sample_id").to_pylist(), samples.column("env").to_pylist()))
        assert sorted(set(env_of.values())) == ["distill", "words"]
        # Each env trains its own component: grpo's completion tokens under rl, opd's under ref_kl.
        completion = {env: sum(sum(mask) for mask, e in zip(samples.column("loss_mask").to_pylist(),
                                                            samples.column("env").to_pylist()) if e == env)
                      for env in ("words", "distill")}
        assert metrics["tokens/rl"] == completion["words"] > 0, (step, metrics)
        assert metrics["tokens/ref_kl"] == completion["distill"] > 0, (step, metrics)
        assert metrics["tokens/ce"] == 0 and metrics["grad_norm"] > 0
        # Both components are non-zero: rl carries grpo's advantages, ref_kl the teacher's signal once the policy
        # has left the teacher (at step 1 it is the teacher, below). On-policy, loss/rl's *value* is -mean(A) over
        # rl tokens: ~1e-10 here, where group-centred advantages cover completions of equal length (max_tokens),
        # so it says nothing; its gradient does: each component's gradient alone is measured on a mixed micro-batch.
        advantages = record["advantage_metrics"]
        assert advantages["advantage_min"] < 0 < advantages["advantage_max"], (step, advantages)
        assert record["grad_norms"]["rl"] > 1e-3, (step, record["grad_norms"])
        if step > 1:
            assert metrics["loss/ref_kl"] > 1e-3 and record["grad_norms"]["ref_kl"] > 1e-3, (step, metrics,
                                                                                           record["grad_norms"])

        # Samples of both envs share a micro-batch, and at every position of it the streams are the ones of the
        # sample that owns the position: rl weight on grpo's completion, ref_kl weight and teacher logprobs on
        # opd's, nothing on prompts.
        mixed = 0
        for row in record["micro_batches"].to_pylist():
            mixed += len({env_of[sample_id] for sample_id in row["sample_ids"]}) == 2
            start_at = 0
            for sample_id, length in zip(row["sample_ids"], row["sequence_lengths"]):
                span = slice(start_at, start_at + length)
                start_at += length
                mask = [float(keep) for keep in row["loss_mask"][span]]
                if env_of[sample_id] == "words":
                    assert row["rl_weights"][span] == mask and not any(row["ref_kl_weights"][span])
                    assert not any(row["ref_logprobs"][span])
                else:
                    assert row["ref_kl_weights"][span] == mask and not any(row["rl_weights"][span])
                    assert not any(row["advantages"][span])
                    teacher = [lp for lp, keep in zip(row["ref_logprobs"][span], mask) if keep]
                    assert all(lp < 0 for lp in teacher)
        assert mixed >= 1, [row["sample_ids"] for row in record["micro_batches"].to_pylist()]

    kl = [record["metrics"]["ref_kl/kl"] for record in steps]
    # Step 1: the policy is the teacher's weights, so the k1 estimate of KL(policy || teacher) is ~0 (engine vs
    # transformers logprobs agree to ~1e-6 per token); it grows once grpo and ref_kl have moved the policy.
    assert abs(kl[0]) < 1e-3, kl
    assert kl[-1] > 10 * max(abs(kl[0]), 1e-4), kl
    assert state != start
    assert any(not torch.equal(initial[name], tensor) for name, tensor in trained.items())
