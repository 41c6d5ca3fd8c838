#!/usr/bin/env bash
# vllm-router (PyPI, a Rust wheel) in its own venv, .venv-router, for bench/bench_router.py only: it is measured
# against rollout's reward router (rollout_lib/serving/router.py) and is never a dependency of the project.
# Idempotent: a venv that already holds this version is kept as it is.
#   bash scripts/setup-router.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VLLM_ROUTER_VERSION=0.1.17

[ -x .venv-router/bin/python ] || "$PYTHON" -m venv .venv-router
source scripts/quiet-pip.sh  # pip(): quiet, and a failed install fails the setup
export PIP_VENV=.venv-router

installed=$(.venv-router/bin/python -c "import importlib.metadata as m
try: print(m.version('vllm-router'))
except m.PackageNotFoundError: pass")
[ "$installed" = "$VLLM_ROUTER_VERSION" ] || pip install "vllm-router==$VLLM_ROUTER_VERSION"
.venv-router/bin/vllm-router --help > /dev/null
echo ".venv-router ready: vllm-router $VLLM_ROUTER_VERSION"
