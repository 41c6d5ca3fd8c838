"""Where the project's own files are: the checkout root (configs/, data/, the packages), a config's project (what
its relative paths resolve from), and rollout's home (the Prefect server, the stack, served models, logs)."""

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# What makes a directory a rollout project: its deployments file, which `prefect deploy` reads from there.
PROJECT_MARKER = "prefect.yaml"
HOME_DIR_NAME = ".rollout"


def project_root(start: str | Path) -> Path | None:
    """The nearest directory at or above `start` that holds a prefect.yaml, or None."""
    start = Path(start).expanduser().resolve()
    for directory in (start, *start.parents):
        if (directory / PROJECT_MARKER).is_file():
            return directory
    return None


def config_base_dir(config_path: str | Path) -> Path:
    """What a config's relative paths (datasets, the store, an RLHF stage's config) resolve from: its project's
    root, so `data/x.jsonl` in configs/x.toml means the same file from every working directory; a config outside
    any project resolves from its own directory."""
    directory = Path(config_path).expanduser().resolve().parent
    return project_root(directory) or directory


def default_home(start: str | Path | None = None) -> Path:
    """rollout's home when ROLLOUT_HOME is not set: `.rollout` in the project around `start` (default: the working
    directory), else in the checkout rollout runs from, else in the user's home directory. One Prefect server per
    project, whichever directory a command is typed in."""
    root = project_root(start or Path.cwd())
    if root is None and (PROJECT_ROOT / PROJECT_MARKER).is_file():
        root = PROJECT_ROOT
    return (root or Path.home()) / HOME_DIR_NAME


def state_dir() -> Path:
    """rollout's home: ROLLOUT_HOME (ROLLOUT_STATE_DIR, its older name, still works), else `default_home()`.
    The CLI sets ROLLOUT_HOME from a command's --config, so a run uses its config's project's server."""
    configured = os.environ.get("ROLLOUT_HOME") or os.environ.get("ROLLOUT_STATE_DIR")
    return Path(configured).expanduser().resolve() if configured else default_home()


def use_home_of_config(config_path: str | Path) -> None:
    """Make the home of the config's project this process's (and its children's) ROLLOUT_HOME, unless one is set
    or the config is in no project."""
    if os.environ.get("ROLLOUT_HOME") or os.environ.get("ROLLOUT_STATE_DIR"):
        return
    root = project_root(Path(config_path).expanduser().resolve().parent)
    if root is not None:
        os.environ["ROLLOUT_HOME"] = str(root / HOME_DIR_NAME)


def default_store() -> Path:
    """Where checkpoints go when neither a config nor `--store` says: `store` in rollout's home."""
    return state_dir() / "store"


def rollout_cache_dir() -> Path:
    """What rollout derives once and keeps across runs (converted GGUF models, data files' digests, the `datasets`
    library's cache): ROLLOUT_CACHE_DIR, else ~/.cache/rollout."""
    return Path(os.environ.get("ROLLOUT_CACHE_DIR", Path.home() / ".cache" / "rollout"))
