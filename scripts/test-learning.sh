#!/usr/bin/env bash
# The learning tests (`-m learning`: a run's curve must rise) on this CPU's own kernels, or with the kernels of a CPU
# without AVX-512 forced on this one. CPU kernels round differently across instruction sets, so each machine type
# draws another trajectory; a learning test must pass on both (issue 39).
#   bash scripts/test-learning.sh          # this CPU's kernels
#   bash scripts/test-learning.sh avx2     # ATen, oneDNN, MKL and vLLM's kernels limited to AVX2 (scripts/avx2.sh;
#                                          # checked: on an AVX-512 machine it reproduces an AVX2 machine's echo
#                                          # trajectory to the printed digit)
# Extra arguments go to pytest (e.g. -k echo -s).
set -euo pipefail
cd "$(dirname "$0")/.."
wrap=()
case "${1:-native}" in
  native) ;;
  avx2) wrap=(bash scripts/avx2.sh) ;;
  *) echo "usage: bash scripts/test-learning.sh [native|avx2] [pytest arguments]" >&2; exit 2 ;;
esac
[ $# -gt 0 ] && shift
exec "${wrap[@]}" .venv/bin/python -m pytest -q -n 2 --dist loadgroup -m learning "$@"
