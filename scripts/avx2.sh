#!/usr/bin/env bash
# Run a command with the kernels of a CPU without AVX-512 forced on this one (issue 39, issue 45): ATen, oneDNN and
# MKL held to AVX2 by their own variables, and vLLM's CPU build loading its AVX2 kernel library (scripts/avx2/
# sitecustomize.py). On an AVX-512 EPYC this reproduces an AVX2 EPYC's echo trajectory to the printed digit
# (docs/hardware.md); check a speed ratio against a real AVX2 machine before trusting it (docs/serving.md).
#   bash scripts/avx2.sh .venv/bin/python bench/bench_rl_vs_trl.py --steps 8
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ROLLOUT_EMULATE_AVX2=1
export PYTHONPATH="$here/avx2${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
