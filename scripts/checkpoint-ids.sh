#!/usr/bin/env bash
# The final checkpoint id of every shipped tiny config, trained from scratch into a fresh store: run it before and
# after a change that should not change behaviour (a refactor) and compare the two lists. Ids are reproducible per
# machine type, not across CPU instruction sets (docs/hardware.md), so compare lists made on one machine.
#   bash scripts/checkpoint-ids.sh [CHECKOUT] > ids.txt   # CHECKOUT: another tree of the project (default: this one)
# The rl-calculator-echo / rl-guess configs start from sft-tools-tiny's checkpoint, so they share its store (the
# tool-call rl-calculator is left out: its warm start, sft-calculator-tools-tiny, is 1000 steps of ~230 tokens).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
checkout="$(cd "${1:-$here}" && pwd)"
python="${VENV:-$here/.venv}/bin/python"
work="$(mktemp -d "${TMPDIR:-/tmp}/checkpoint-ids.XXXXXX")"
# Its own state directory: the Prefect server the runs start there is this script's, stopped at the end.
export ROLLOUT_STATE_DIR="$work/state" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
trap '(cd "$checkout" && "$python" -m rollout_cli stack stop >/dev/null 2>&1); rm -rf "$work"' EXIT

train() {  # entry point, config name, store name: prints "<config> <checkpoint id>" (stdout's JSON result)
  local out
  if ! out=$(cd "$checkout" && "$python" -m rollout_cli train "$1" --config "configs/$2.toml" --quiet \
               --set "run.store=$work/$3" 2>"$work/$2.err"); then
    echo "$2 FAILED:"; tail -5 "$work/$2.err"; return 1
  fi
  printf '%-18s %s\n' "$2" "$(printf '%s\n' "$out" | grep -m1 -oE '"checkpoint": "[0-9a-f]{64}"' | cut -d'"' -f4)"
}

train rm rm-tiny rm
train sft sft-tiny sft
train sft sft-teacher-tiny sft-teacher
train rl rl-tiny rl
train rl rl-opsd rl-opsd
PYTHONPATH="$checkout/tests" train rl rl-custom rl-custom  # its advantage function lives in tests/
train rlhf rlhf-tiny rlhf
train sft sft-tools-tiny tools
# The text-protocol calculator was configs/rl-calculator.toml before issue 40 (run.name is not in the id): an older
# CHECKOUT's is measured and printed under the new name, so the two lists compare line by line.
if [ -e "$checkout/configs/rl-calculator-echo.toml" ]; then
  train rl rl-calculator-echo tools
else
  train rl rl-calculator tools | sed -E 's/^rl-calculator +/rl-calculator-echo /'
fi
train rl rl-guess tools
