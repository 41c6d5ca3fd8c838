"""trackio (`run.trackers = ["trackio"]`), local-first: a SQLite file per project under `run.trackio.dir`
(`trackio show --project P` serves it). Each step's metrics at its step, the settings as the run's config, each
RL step's samples as a `trackio.Table` (`sample_table` at that step), the curves as an image and the final checkpoint
and flow run page as the last step's `summary/...` values.

trackio keeps every row logged, a replayed step too, so a rerun resumes the run of the same name and logs only
the steps after the last one its project holds. trackio reads its directory once, at import: a run whose
`dir` differs from the one an earlier run of this process imported it with writes to that earlier one (warned).
"""

from __future__ import annotations

import io
import logging
import os

from rollout_lib.config.common import TrackioSettings
from rollout_lib.runlog.trackers.sample_table import TABLE_KEY

log = logging.getLogger(__name__)



class TrackioBackend:
    name = "trackio"

    def __init__(self, settings: TrackioSettings, run_name: str):
        self.settings = settings
        self.run_name = run_name
        self.run = None
        self.last_step: int | None = None

    def open(self, settings: dict[str, str]) -> int | None:
        import sys

        if self.settings.dir is not None:
            if "trackio" in sys.modules and os.environ.get("TRACKIO_DIR") != self.settings.dir:
                log.warning("trackio: already imported with TRACKIO_DIR=%s; run.trackio.dir=%s takes effect in a "
                            "new process", os.environ.get("TRACKIO_DIR"), self.settings.dir)
            os.environ["TRACKIO_DIR"] = self.settings.dir
        import matplotlib.figure  # noqa: F401  see below
        import trackio
        from trackio import SQLiteStorage

        # trackio.log tests every value against sys.modules["matplotlib.figure"].Figure without importing it; while
        # the run's own curves (runlog/plot.py) import matplotlib on the training thread, that module is in
        # sys.modules half initialised and trackio drops the step's metrics ("skipped metric ... partially
        # initialized module"). Importing it here first (an import waits for one in progress) makes it whole.
        held = SQLiteStorage.get_max_step_for_run(self.settings.project, self.run_name)
        self.run = trackio.init(project=self.settings.project, name=self.run_name, resume="allow", embed=False,
                                config=settings, auto_log_cpu=False, auto_log_gpu=False)
        self.last_step = held
        return held

    def metrics(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        for step, metrics in steps:
            self.run.log(metrics, step=step)
            self.last_step = max(step, self.last_step or 0)

    def table(self, step: int, columns: list[str], rows: list[list]) -> None:
        import trackio

        self.run.log({TABLE_KEY: trackio.Table(columns=columns, data=rows)}, step=step)

    def finish(self, summary: dict[str, str], curves_png: bytes | None) -> None:
        import trackio
        from PIL import Image

        final = {f"summary/{key}": value for key, value in summary.items()}
        if curves_png is not None:
            final["curves"] = trackio.Image(Image.open(io.BytesIO(curves_png)))
        self.run.log(final, step=self.last_step or 0)

    def run_failed(self, error: str) -> None:
        """trackio has no run status: the error is the run's last log entry."""
        self.run.log({"summary/error": error}, step=self.last_step or 0)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
