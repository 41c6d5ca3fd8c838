"""Where the project's own files are: the checkout root (configs/, data/, the packages), and the state directory
the CLI and the served models keep their records in."""

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def state_dir() -> Path:
    """Where rollout keeps its state: the Prefect server, the stack's record, served models, logs, the default
    store (ROLLOUT_STATE_DIR, default `.rollout` in the working directory)."""
    return Path(os.environ.get("ROLLOUT_STATE_DIR", ".rollout")).resolve()
