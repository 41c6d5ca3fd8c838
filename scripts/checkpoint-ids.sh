#!/usr/bin/env bash
# The final checkpoint id of every shipped tiny config, trained from scratch into a fresh store: run it before and
# after a change that should not change behaviour (a refactor) and compare the two lists. Ids are reproducible per
# machine type, not across CPU instruction sets (docs/hardware.md), so compare lists made on one machine.
#   bash scripts/checkpoint-ids.sh [CHECKOUT] > ids.txt   # CHECKOUT: another tree of the project (default: this one)
#   MAX_STEPS=2 bash scripts/checkpoint-ids.sh [CHECKOUT]  # each run cut to 2 steps (`--max-steps`): minutes, not
#                                                          # a quarter of an hour; what a refactor's check needs
# Two versions side by side: `git worktree add --detach /tmp/old <commit>`, run it with /tmp/old, diff the lists.
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
  local out steps=()
  # rlhf refuses --max-steps (each stage has its own budget): rlhf-tiny runs whole either way.
  [ -n "${MAX_STEPS:-}" ] && [ "$1" != rlhf ] && steps=(--max-steps "$MAX_STEPS")
  if ! out=$(cd "$checkout" && "$python" -m rollout_cli train "$1" --config "configs/$2.toml" --quiet \
               --set "run.store=$work/$3" "${steps[@]}" 2>"$work/$2.err"); then
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
PYTHONPATH="$checkout/tests" train rl rl-agent-tiny rl-agent  # its agent too
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
# The calculator as tool calls (issue 40), from its own warm start; absent in checkouts before it.
if [ -e "$checkout/configs/sft-calculator-tools-tiny.toml" ]; then
  train sft sft-calculator-tools-tiny calculator-tools
  train rl rl-calculator calculator-tools
fi
