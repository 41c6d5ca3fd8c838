"""Runs inside vLLM's venv: vLLM's OpenAI server, its engine-core process forked rather than spawned on CPUs.

`python -m rollout_lib.serving.vllm_server_main <vllm serve flags>` is `python -m vllm.entrypoints.openai.api_server`
with one change. vLLM runs the model in an engine-core process the API server starts; its CPU platform forces the
`spawn` start method (platforms/cpu.py, no reason given), so that process is a fresh interpreter importing torch and
vLLM all over again: on these 2-core machines a tiny model's replica took 16.9 s and 18.1 CPU-s to be ready, and
10.6 s and 11.4 CPU-s with the process forked from the API server, which has imported them already, sampling the same
tokens with the same logprobs (docs/serving.md, "A replica's engine core is forked"). `fork` is vLLM's own default
on every other platform, and the API server has run no parallel torch work before it forks.

Set VLLM_WORKER_MULTIPROC_METHOD=spawn (in the environment or a deployment's `env`) to keep vLLM's choice.
Only the standard library and vLLM are imported here: nothing of rollout, which lives in another venv.
"""

import os
import runpy

SPAWN_KEPT = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn"


def _fork_the_engine_core() -> None:
    from vllm.platforms import cpu

    choose_settings = cpu.CpuPlatform.check_and_update_config.__func__

    def keep_fork(cls, vllm_config) -> None:
        choose_settings(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # what the CPU platform has just set to spawn

    cpu.CpuPlatform.check_and_update_config = classmethod(keep_fork)
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # else the API server's setup defaults it to spawn


if __name__ == "__main__":
    if not SPAWN_KEPT:
        _fork_the_engine_core()
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
