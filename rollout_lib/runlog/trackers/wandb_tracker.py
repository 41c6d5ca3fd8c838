"""Weights & Biases (`run.trackers = ["wandb"]`): each step's metrics at its step, the settings as the run's
config, each RL step's samples as a `wandb.Table` (`sample_table` at that step), the curves as an image and the final
checkpoint and flow run page in the run's summary.

One W&B run per rollout run and store: its id is derived from both, and a rerun resumes it (`resume="allow"`).
W&B ignores a step lower than the last one it holds, so a rerun logs only the steps after that one: online, W&B
says which (the resumed run's `_step`); offline, each attempt writes its own `offline-run-*-<id>[-n]` directory (which
`wandb sync` merges), and the steps are read back from the earlier ones (wandb_file.py).
"""

from __future__ import annotations

import io
from pathlib import Path

from rollout_lib.config.common import WandbSettings
from rollout_lib.runlog.trackers import wandb_file
from rollout_lib.runlog.trackers.sample_table import TABLE_KEY



class WandbBackend:
    name = "wandb"

    def __init__(self, settings: WandbSettings, run_name: str, run_key: str, directory: Path):
        self.settings = settings
        self.run_name = run_name
        self.run_id = run_key[:16]  # W&B ids: up to 64 of [a-z0-9_-]
        self.directory = directory
        self.run = None
        self.exit_code = 0  # 1 once the run failed: W&B then shows it as failed

    def open(self, settings: dict[str, str]) -> int | None:
        import wandb

        self.directory.mkdir(parents=True, exist_ok=True)
        earlier = wandb_file.attempt_files(self.directory, self.run_id)
        self.run = wandb.init(project=self.settings.project, entity=self.settings.entity, mode=self.settings.mode,
                              id=self.run_id, name=self.run_name, resume="allow", dir=str(self.directory),
                              config=settings, allow_val_change=True,
                              settings=wandb.Settings(silent=True, console="off", x_disable_stats=True,
                                                      save_code=False))
        if self.settings.mode == "offline":
            return wandb_file.last_step(earlier)
        held = self.run.summary.get("_step")
        return int(held) if held is not None else None

    def metrics(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        for step, metrics in steps:
            self.run.log(metrics, step=step)

    def table(self, step: int, columns: list[str], rows: list[list]) -> None:
        import wandb

        self.run.log({TABLE_KEY: wandb.Table(columns=columns, data=rows)}, step=step)

    def finish(self, summary: dict[str, str], curves_png: bytes | None) -> None:
        import wandb
        from PIL import Image

        for key, value in summary.items():
            self.run.summary[key] = value
        if curves_png is not None:  # in the summary: a step of its own would be one past the run's last
            self.run.summary["curves"] = wandb.Image(Image.open(io.BytesIO(curves_png)))

    def run_failed(self, error: str) -> None:
        self.run.summary["error"] = error
        self.exit_code = 1

    def close(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=self.exit_code)
