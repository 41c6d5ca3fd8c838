"""Served models: frozen teachers, judges and reward models behind OpenAI-compatible servers (vLLM here).

    engine.py    start / find / stop vLLM servers for any model reference (records under the state dir)
    client.py    one async HTTP client for one replica (generate with logprobs, prefill scoring, chat, tokenize)
    pool.py      several replicas of one served model: least outstanding requests, timeouts, failover, ejection
    frozen.py    a config's frozen model ({ model = ref } or { base_url = [...], name = ... }) -> a ready pool
    tokenizers.py the plan-time check that a served model and the policy share a tokenizer

Everything above this package (samplers, algorithms, the reward loop) talks to a pool and nothing else.
"""
