"""Runs inside vLLM's venv: vLLM's OpenAI server, its engine-core process forked rather than spawned on CPUs.

`python -m rollout_lib.serving.vllm_server_main <vllm serve flags>` is `python -m vllm.entrypoints.openai.api_server`
with one change: the engine-core process is forked from the API server (which has imported torch and vLLM already)
instead of spawned, as vLLM's CPU platform forces; `fork` is vLLM's default on every other platform. The same tokens,
ready sooner (measured: docs/serving.md, "A replica's engine core is forked").

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
