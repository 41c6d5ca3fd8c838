"""TensorBoard event files of a run's steps (`run.tensorboard = true`): every numeric metric as a scalar.

Where: a local store keeps them beside the metrics file, in ``<root>/runs/<name>/tensorboard``; for a remote store
they go to the local directory ``.rollout/tensorboard/<name>`` (of the working directory the run starts in):
TensorBoard reads event files from a directory, and no store is mounted as one.
`tensorboard --logdir <that directory>` shows them.

A resumed run replays the steps after its last snapshot: the writer of a process opens at the first step it writes
with ``purge_step`` at that step, so TensorBoard hides what an earlier (killed) attempt wrote from there on.
"""

from __future__ import annotations

import os
from pathlib import Path

from rollout_lib.runlog.metrics_file import RUNS_DIR, WALL_TIME, check_run_name, is_local
from rollout_lib.store import ObjectStore

TENSORBOARD_DIR = "tensorboard"
REMOTE_STORE_TENSORBOARD_ROOT = ".rollout/tensorboard"


def tensorboard_dir(store: ObjectStore, run_name: str) -> Path:
    """The directory a run's event files go to."""
    name = check_run_name(run_name)
    if is_local(store):
        return Path(store.root) / RUNS_DIR / name / TENSORBOARD_DIR
    return Path(REMOTE_STORE_TENSORBOARD_ROOT).resolve() / name


def require_tensorboard() -> None:
    """Fail before a run starts, not at its first step, when `run.tensorboard` is on without the package."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ImportError("run.tensorboard = true needs the tensorboard package: pip install 'rollout[tensorboard]'"
                          ) from None


class TensorBoardLog:
    """Writes scalars of a run's steps to ``log_dir``; flushed at every step, so a killed run keeps them."""

    def __init__(self, log_dir: str | Path):
        require_tensorboard()
        self.log_dir = Path(log_dir)
        self.had_events = self.log_dir.is_dir() and any(self.log_dir.glob("events.out.tfevents.*"))
        self.written: set[int] = set()  # the steps this process wrote
        self._writer = None
        self._last_step: int | None = None

    def write(self, step: int, metrics: dict) -> None:
        """A step as training completes it: a step not after the last one written starts a replay."""
        if self._writer is None or (self._last_step is not None and step <= self._last_step):
            self._open(purge_step=step)
            self.written = {written for written in self.written if written < step}
        self._add_scalars(step, metrics)
        self._last_step = step
        self.written.add(step)

    def annotate(self, step: int, extra: dict) -> None:
        """More scalars at a step this process wrote (held-out evaluation), no replay; nothing for a step it did not
        write (a rerun that trained nothing: its event files already hold them)."""
        if self._writer is not None and step in self.written:
            self._add_scalars(step, extra)

    def _add_scalars(self, step: int, metrics: dict) -> None:
        walltime = metrics.get(WALL_TIME)
        for name, value in metrics.items():
            if name in ("step", WALL_TIME) or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._writer.add_scalar(name, float(value), step, walltime=walltime)
        self._writer.flush()

    def _open(self, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.close()
        os.makedirs(self.log_dir, exist_ok=True)
        self._writer = SummaryWriter(str(self.log_dir), purge_step=purge_step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
