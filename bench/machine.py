"""The machine a bench row was measured on, in one line: the CPU model, the instruction set its kernels ran with
(AVX-512, or AVX2 on a CPU without it or held there by scripts/avx2.sh), cores and the load when asked."""

from __future__ import annotations

import os


def cpu_label() -> str:
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = " ".join(value.split())
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2" or os.environ.get("ROLLOUT_EMULATE_AVX2") == "1":
        kernels = "AVX2 kernels (AVX-512 CPU held to AVX2: scripts/avx2.sh)" if "avx512f" in flags else "AVX2"
    else:
        kernels = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {kernels}, {cores} cores"


def load_label() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f} (1 min), {five:.1f} (5 min)"
