"""Served models: frozen teachers, judges, reward models and the live policy behind OpenAI-compatible servers (vLLM
here).

Each module's one job: docs/architecture.md ("serving/") and docs/serving.md. Modules that run inside vLLM, not in
rollout: vllm_server_main.py, worker_extension.py, engine_reload.py, store_fetch.py.

Everything above this package (samplers, algorithms, the reward loop) talks to a pool and nothing else.
"""
