#!/usr/bin/env bash
# The learning tests (`-m learning`: a run's curve must rise) on this CPU's own kernels, or with the kernels of a CPU
# without AVX-512 forced on this one. CPU kernels round differently across instruction sets, so each machine type
# draws another trajectory; a learning test must pass on both (issue 39).
#   bash scripts/test-learning.sh          # this CPU's kernels
#   bash scripts/test-learning.sh avx2     # ATen, oneDNN and MKL limited to AVX2 (checked: on an AVX-512 machine it
#                                          # reproduces an AVX2 machine's echo trajectory to the printed digit)
# Extra arguments go to pytest (e.g. -k echo -s).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-native}" in
  native) ;;
  avx2) export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ;;
  *) echo "usage: bash scripts/test-learning.sh [native|avx2] [pytest arguments]" >&2; exit 2 ;;
esac
[ $# -gt 0 ] && shift
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup -m learning "$@"
