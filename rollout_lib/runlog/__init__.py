"""What a run leaves beside its checkpoints: each step's metrics, kept in the store as the step completes
(`metrics_file`), optionally as TensorBoard event files (`tensorboard`), written through one `recorder` per run;
the tables of each RL step (`step_tables`) and their samples read back (`samples`); and the runs a store holds, for
`rollout runs` (`runs`). docs/runs.md."""

from rollout_lib.runlog.metrics_file import read_metrics

__all__ = ["read_metrics"]
