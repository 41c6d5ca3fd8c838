"""Where a train-rl step's time goes: each stage's own time, and what the orchestration adds around them.

train-rl keeps a Prefect task per stage of each step (sample, score, advantages, pack, train: the next step samples
from the weights this one produced), so its orchestration cost is five task runs per step. This runs the flow on a
fresh project-local Prefect server and prints, per step (medians over the steps):

    stage times      seconds each stage's function took, measured inside its task (the step's metrics)
    prefect overhead step wall time minus the five stage times: task-run bookkeeping, cache keys, result files,
                     the API, and the flow's own code between tasks; as a share of the step (target <= 5%)

    .venv/bin/python bench/bench_rl_stages.py [--config configs/rl-tiny.toml] [--steps 20] [--set key=value ...]

`--set` overrides a setting as `rollout train --set` does: e.g. k = 1 with the behaviour logprobs computed while
sampling (the default) or at the advantages stage (`--set algorithm.rl.max_off_policy_steps=1 [--set
algorithm.rl.overlap_behaviour_logprobs=false]`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

# score_tail_s: a streamed step's wait for its last rewards after sampling (reward_loop.streamed; absent when staged)
STAGES = ("sample_s", "score_tail_s", "score_s", "advantages_s", "pack_s", "train_s")
# Where the behaviour logprobs' forward went (k > 0): printed when the steps report them
BEHAVIOUR = ("behaviour/precompute_s", "behaviour/precompute_tail_s", "behaviour/recompute_s")


def run_flow(config: str, steps: int, overrides: list[str]) -> dict:
    """The train-rl flow in this process, in a store of its own; its flow run id and training-loop seconds."""
    from flows.train_rl import train_rl

    with tempfile.TemporaryDirectory() as store:
        state = train_rl(config=config, max_steps=steps,
                         overrides=[*overrides, f"run.store={store}", "run.name=bench-rl"], return_state=True)
        result = state.result()
    return {"flow_run_id": str(state.state_details.flow_run_id), "train_seconds": result["train_seconds"]}


def step_walls(flow_run_id: str) -> dict[int, float]:
    """Step k's wall time: from the end of train-step-(k-1) (init-policy for step 1) to the end of train-step-k."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    ends = {0 if run.name == "init-policy" else int(run.name.rsplit("-", 1)[1]): run.end_time.timestamp()
            for run in runs if run.name == "init-policy" or run.name.startswith("train-step-")}
    return {step: ends[step] - ends[step - 1] for step in sorted(ends) if step > 0}


def step_metrics(flow_run_id: str) -> list[dict]:
    """The per-step metrics table artifact of the run, as rows."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    table = next(a for a in artifacts if a.key and a.key.endswith("-metrics")).data
    columns = json.loads(table) if isinstance(table, str) else table
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/rl-tiny.toml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting, as `rollout train --set` takes it (repeatable)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child that runs the flow
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.measure:
        print(json.dumps(run_flow(args.config, args.steps, args.overrides)))
        return

    with tempfile.TemporaryDirectory() as state:
        os.environ["ROLLOUT_STATE_DIR"] = state
        os.environ.pop("PREFECT_API_URL", None)
        from rollout_cli.local_server import start_server, stop_server

        server = start_server()
        os.environ.update(PREFECT_API_URL=server["api_url"], PREFECT_HOME=server["prefect_home"])
        try:
            done = subprocess.run([sys.executable, __file__, "--measure", "--config", args.config, "--steps",
                                   str(args.steps), *(f"--set={item}" for item in args.overrides)],
                                  cwd=ROOT, capture_output=True, text=True, env=os.environ)
            if done.returncode != 0:
                sys.exit(f"bench: the flow failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
            run = json.loads(done.stdout.strip().splitlines()[-1])
            walls, rows = step_walls(run["flow_run_id"]), step_metrics(run["flow_run_id"])
        finally:
            stop_server()

    # Step 1 pays the one-off costs (the reward loop's worker processes start): report steps 2.. as the steady state.
    steady = [row for row in rows if row["step"] > 1]
    settings = "".join(f" --set {item}" for item in args.overrides)
    print(f"train-rl on {args.config}{settings}, {args.steps} steps; medians over steps 2..{args.steps}")
    for stage in STAGES:
        print(f"  {stage[:-2]:<11}: {statistics.median(row.get(stage) or 0.0 for row in steady) * 1000:8.1f} ms")
    for name in BEHAVIOUR:
        if any(name in row for row in steady):
            print(f"  {name[:-2]:<27}: {statistics.median(row.get(name) or 0.0 for row in steady) * 1000:8.1f} ms")
    overheads = [walls[row["step"]] - sum(row.get(stage) or 0.0 for stage in STAGES) for row in steady]
    shares = [overhead / walls[row["step"]] for overhead, row in zip(overheads, steady)]
    print(f"  step wall  : {statistics.median(walls[row['step']] for row in steady) * 1000:8.1f} ms")
    print(f"  prefect    : {statistics.median(overheads) * 1000:8.1f} ms per step, "
          f"{100 * statistics.median(shares):.1f}% of the step (median; target <= 5%)")


if __name__ == "__main__":
    main()
