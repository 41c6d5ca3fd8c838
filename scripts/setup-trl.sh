#!/usr/bin/env bash
# TRL in its own venv, .venv-trl, for bench/bench_rl_vs_trl.py only (never a dependency of the project): torch first
# and pinned (the local CPU wheel: any looser spec pulls gigabytes of CUDA), then trl with transformers held at the
# project venv's version (the same model code and tokenizer on both sides), then reasoning-gym at the project's
# version (its score_answer is one of the two rewards). Idempotent: a venv that already holds these versions is
# kept as it is. Needs .venv (scripts/setup.sh) for the versions it copies.
#   bash scripts/setup-trl.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
TRL_VERSION=1.16.0
[ -x .venv/bin/python ] || { echo "setup-trl: no .venv; run scripts/setup.sh first" >&2; exit 1; }
version_in() {  # version_in VENV DIST: the installed version, or nothing
  "$1/bin/python" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$2"
}
TRANSFORMERS_VERSION=$(version_in .venv transformers)
REASONING_GYM_VERSION=$(version_in .venv reasoning_gym)

[ -x .venv-trl/bin/python ] || "$PYTHON" -m venv .venv-trl
source scripts/quiet-pip.sh  # pip(): quiet, and a failed install fails the setup
export PIP_VENV=.venv-trl

installed() {  # installed DIST VERSION: true when .venv-trl holds exactly that version
  [ "$(version_in .venv-trl "$1")" = "$2" ]
}
installed torch "$TORCH_VERSION+cpu" || installed torch "$TORCH_VERSION" || pip install "torch==$TORCH_VERSION"
if ! installed trl "$TRL_VERSION" || ! installed transformers "$TRANSFORMERS_VERSION"; then
  # torch repeated as a constraint so that no dependency can move it.
  pip install "trl==$TRL_VERSION" "transformers==$TRANSFORMERS_VERSION" "torch==$TORCH_VERSION"
fi
installed reasoning_gym "$REASONING_GYM_VERSION" || \
  pip install "reasoning-gym==$REASONING_GYM_VERSION" "torch==$TORCH_VERSION"
.venv-trl/bin/python -W ignore -c "
import torch, transformers, trl, reasoning_gym
assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__
assert trl.__version__ == '$TRL_VERSION', trl.__version__
from trl import GRPOConfig, GRPOTrainer
print(f'.venv-trl ready: trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}')"
