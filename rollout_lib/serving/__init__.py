"""Served models: frozen teachers, judges, reward models and the live policy behind OpenAI-compatible servers (vLLM
here).

    engine.py         start / find / stop vLLM servers for any model reference (records under the state dir)
    vllm_server_main.py  runs inside vLLM: its OpenAI server, the engine core forked rather than spawned on CPUs
    client.py         one async HTTP client for one replica (generate with logprobs, prefill scoring, chat, tokenize)
    pool.py           several replicas of one served model: least outstanding requests, timeouts, failover,
                      ejection, and restart of the dead replicas rollout serves
    router.py         a pool over HTTP on 127.0.0.1: the one address a reward function POSTs to (verl's
                      reward_router_address), with the pool's guarantees
    served.py         ServedModels: every model a run reaches (frozen models, served reward models, the policy server)
    policy_server.py  the live policy's server: weights reloaded in place each step, checked by a probe
    weight_sync.py    the weights file in shared memory the policy server reloads from
    worker_extension.py  runs inside vLLM: a policy server's worker extension (the two below, over
                      /collective_rpc)
    engine_reload.py  runs inside vLLM: the policy's weights reloaded in place, by the CPU backend's short path
    store_fetch.py    runs inside vLLM: a policy server on another node copies each state from the run's store
    tokenizers.py     the check that a served model and the policy share a tokenizer
    references.py     checkpoint ids and refs as model references a server can load

Everything above this package (samplers, algorithms, the reward loop) talks to a pool and nothing else.
"""
