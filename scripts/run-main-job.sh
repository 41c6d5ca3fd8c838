#!/usr/bin/env bash
# Run the main job the way users run it: start the project's local Prefect stack (server, `rollout-process` work
# pool, `prefect deploy --all`, a worker), then `prefect deployment run train-rm/default`, followed with
# `rollout follow` (the flow's log lines, a progress bar, and its summary at the end).
# The stack stays up afterwards so the finished run can be inspected in the UI; the last line says where and how
# to stop it. Extra arguments go to `prefect deployment run`, e.g.:
#   bash scripts/run-main-job.sh --param max_steps=20 --param 'overrides=["algorithm.rm.optimizer.lr=1e-4"]'
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/rollout" ]; then
  echo "run-main-job: $VENV is not set up; run: bash scripts/setup.sh" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

"$VENV/bin/rollout" stack start
eval "$("$VENV/bin/rollout" stack env)"   # PREFECT_API_URL / PREFECT_HOME of the project's stack

mkdir -p .rollout/logs
log=.rollout/logs/run-main-job.log
set +e
"$VENV/bin/prefect" deployment run train-rm/default "$@" > "$log" 2>&1
status=$?
flow_run_id=$(grep -oE 'UUID: [0-9a-f-]{36}' "$log" | head -n 1 | cut -d' ' -f2 || true)
if [ -n "$flow_run_id" ]; then
  # The flow's own log lines, a progress bar, and the summary `rollout train` prints (final checkpoint, run page).
  "$VENV/bin/rollout" follow "$flow_run_id" 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
else
  cat "$log"
fi
set -e
echo "the stack is still up (Prefect UI ${PREFECT_API_URL%/api}); stop it with: $VENV/bin/rollout stack stop"
exit "$status"
