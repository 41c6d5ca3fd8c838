"""On an AVX-512 machine, make vLLM's CPU build choose what it chooses on a CPU without AVX-512 (scripts/avx2.sh).

vLLM picks its kernel library (`_C` with AVX-512 and bf16, `_C_AVX512`, `_C_AVX2`) and some attention paths by asking
torch whether the CPU has AVX-512 (vllm/platforms/cpu.py `import_kernels`); no environment variable says otherwise.
Python imports this file at start-up when scripts/avx2 is on PYTHONPATH; it changes nothing unless the process
is vLLM's (its own venv) and ROLLOUT_EMULATE_AVX2=1, and then answers "no AVX-512, no AMX" to those questions.
ATen, oneDNN and MKL are held to AVX2 by their own variables, which scripts/avx2.sh sets.
"""

import os
import sys

if os.environ.get("ROLLOUT_EMULATE_AVX2") == "1" and ".venv-vllm" in sys.prefix:
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
