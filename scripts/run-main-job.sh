#!/usr/bin/env bash
# Run the main job the way users run it: start the project's local Prefect stack (server, `rollout-process` work
# pool, `prefect deploy --all`, a worker), then `prefect deployment run train-rm/default`, followed with
# `rollout follow` (the flow's log lines, a progress bar, and its summary at the end).
# The stack stays up afterwards so the finished run can be inspected in the UI; the last lines say where and how
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
  # The flow's own log lines, a progress bar and its summary (not the server's raw event records).
  "$VENV/bin/rollout" follow "$flow_run_id" 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
else
  cat "$log"
fi
set -e

ui_url=${PREFECT_API_URL%/api}
echo
if [ -n "$flow_run_id" ]; then
  state=$("$VENV/bin/python" - "$PREFECT_API_URL" "$flow_run_id" <<'EOF'
import json, sys, urllib.request
with urllib.request.urlopen(f"{sys.argv[1]}/flow_runs/{sys.argv[2]}", timeout=10) as response:
    run = json.load(response)
print(run["state"]["name"] + (f": {run['state']['message']}" if run["state"]["type"] != "COMPLETED" else ""))
EOF
  ) || state="unknown"
  echo "train-rm/default finished: $state"
  echo "  inspect the run:  $ui_url/runs/flow-run/$flow_run_id"
else
  echo "train-rm/default: no flow run was created (see above)"
fi
echo "  Prefect UI:       $ui_url"
echo "  the stack is still up; stop it with:  $VENV/bin/rollout stack stop"
exit "$status"
