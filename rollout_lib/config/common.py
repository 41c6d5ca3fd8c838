"""Settings blocks shared by every entry point (optimizer, budget, datasets, model references, run, hardware)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from rollout_lib.paths import default_store
from rollout_lib.hardware import HardwareSettings  # noqa: F401  (composed here)
from rollout_lib.settings_base import ModelRef, StrictModel, tagged_union

__all__ = ["ModelRef", "StrictModel"]  # defined in settings_base (importable without this package), used here

# The validation context's key for the directory relative paths resolve from (config/loading.py sets it to the
# config file's project root).
BASE_DIR = "base_dir"


def resolve_path(path: str, info: ValidationInfo) -> str:
    """A relative path made absolute from the validation context's BASE_DIR (without one: the working directory),
    so a setting names one file whatever directory the run starts in."""
    expanded = Path(path).expanduser()
    if expanded.is_absolute():
        return str(expanded)
    base = (info.context or {}).get(BASE_DIR)
    return str((Path(base) if base else Path.cwd()) / expanded)


class TaskRunnerSettings(StrictModel):
    """Where a step's scoring fans out (docs/hardware.md, "Task runners"). "thread": in the flow's process, one
    score task per step (the default). "dask" / "ray": the step's rollouts split into `chunks` score tasks run on a
    Dask cluster (prefect-dask) or a Ray cluster (prefect-ray, the `ray` extra), each building its own reward
    functions on its worker, merged in row order: the scored table, and every id after it, is the thread runner's."""

    type: Literal["thread", "dask", "ray"] = "thread"
    # A running cluster: a Dask scheduler ("tcp://host:8786") or a Ray address ("ray://head:10001", "auto").
    # None: a cluster on this machine for the length of the run (a Dask LocalCluster, a local Ray instance).
    address: str | None = None
    n_workers: int | None = Field(None, ge=1)  # a Dask LocalCluster's worker processes (None: Dask's default)
    threads_per_worker: int = Field(1, ge=1)  # a Dask LocalCluster's threads per worker process
    chunks: int | None = Field(None, ge=1)  # score tasks per step; None: n_workers, or 4

    @model_validator(mode="after")
    def _settings_of_its_type(self) -> "TaskRunnerSettings":
        local_cluster = {"n_workers": self.n_workers, "threads_per_worker": self.threads_per_worker != 1}
        if self.type == "thread":
            given = [name for name, value in {"address": self.address, **local_cluster,
                                               "chunks": self.chunks}.items() if value]
            if given:
                raise ValueError(f"{', '.join(given)}: settings of a dask or ray task runner, not of type = \"thread\"")
        elif self.address is not None or self.type == "ray":
            given = [name for name, value in local_cluster.items() if value]
            if given:
                where = "a Ray task runner" if self.type == "ray" else "a Dask cluster at an address"
                raise ValueError(f"{', '.join(given)}: settings of a Dask LocalCluster, not of {where}")
        return self

    @property
    def score_chunks(self) -> int:
        return self.chunks or self.n_workers or 4


# The trackers `run.trackers` may name, and the Python package each needs (None: none beyond rollout's own; MLflow
# is spoken to over its REST API with httpx, so its client package, which pins importlib-metadata<10 and
# pyarrow<26 against ours, is never imported). One place for the fact, read at validation (plan time).
TRACKER_PACKAGES: dict[str, str | None] = {"mlflow": None, "wandb": "wandb", "trackio": "trackio",
                                           "tensorboard": "tensorboard"}
TRACKER_EXTRAS = {"wandb": "trackers", "trackio": "trackers", "tensorboard": "tensorboard"}


class MlflowSettings(StrictModel):
    """`run.mlflow`: an MLflow tracking server (`mlflow server`), reached over HTTP."""

    tracking_uri: str = Field("http://127.0.0.1:5000", pattern=r"^https?://")
    experiment: str = Field("rollout", min_length=1)
    timeout_s: float = Field(5.0, gt=0)  # one request's limit; a dead server costs the tracker this once


class WandbSettings(StrictModel):
    """`run.wandb`: Weights & Biases. `mode = "offline"` needs no account (`wandb sync` uploads it later)."""

    project: str = Field("rollout", min_length=1)
    entity: str | None = None
    mode: Literal["online", "offline"] = "online"
    # W&B's local directory (its `wandb/` goes under it). None: beside the metrics file for a local store, else
    # `.rollout/wandb/<run>` of the working directory, as TensorBoard's event files.
    dir: str | None = None


class TrackioSettings(StrictModel):
    """`run.trackio`: trackio, local-first: one SQLite file per project under `dir` (`trackio show` serves it)."""

    project: str = Field("rollout", min_length=1)
    dir: str | None = None  # TRACKIO_DIR; None: trackio's own default (~/.cache/huggingface/trackio)


class RunSettings(StrictModel):
    name: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    seed: int = 42
    # CPU threads of every torch computation that decides a checkpoint. Reductions split across threads round
    # differently, so byte-identical checkpoints across machines need the same count: pinned, not "all cores".
    torch_threads: int = Field(2, ge=1)
    # Any fsspec URL: a local directory (default), memory://..., s3://bucket/prefix.
    # A relative local path resolves from the config's project root. Default: rollout's home's store
    # (`.rollout/store` of the config's project unless ROLLOUT_HOME says otherwise; paths.default_store).
    store: str = Field(default_factory=lambda: str(default_store()), validate_default=True)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    # Also write each step's metrics as TensorBoard event files (docs/runs.md: beside the metrics file for a local
    # store, .rollout/tensorboard/<name> for a remote one). How a run is watched, never what it trains: like the
    # store, not in training_settings(), so turning it on reuses every finished step.
    tensorboard: bool = False
    # Experiment trackers the run's steps also go to (docs/runs.md, "Trackers"), each with its settings block
    # below; "tensorboard" here is `tensorboard = true`. Watching, never training: not in training_settings().
    trackers: list[Literal["mlflow", "wandb", "trackio", "tensorboard"]] = Field(default_factory=list)
    mlflow: MlflowSettings = MlflowSettings()
    wandb: WandbSettings = WandbSettings()
    trackio: TrackioSettings = TrackioSettings()
    # Rows of each RL step's samples table in the UI (`<run>-samples`, a version a step): the failed ones first,
    # then the worst and the best; 0 for none. Watching, not training: not in training_settings().
    ui_samples: int = Field(8, ge=0)
    # Rows of each RL step's sample table sent to a tracker with tables (the failed, the worst, then the best).
    tracker_samples: int = Field(16, ge=0)
    # Where per-sample fan-out (a step's scoring) runs: how fast, never what (not in training_settings()).
    task_runner: TaskRunnerSettings = TaskRunnerSettings()

    @field_validator("trackers")
    @classmethod
    def _trackers_installed(cls, trackers: list[str]) -> list[str]:
        """A tracker asked for whose package is missing fails here, at plan time (`--dry-run`), not mid-run. The
        package is looked for, not imported: importing wandb alone takes seconds."""
        import importlib.util

        if len(set(trackers)) != len(trackers):
            raise ValueError(f"lists a tracker twice: {trackers}")
        for tracker in trackers:
            package = TRACKER_PACKAGES[tracker]
            if package is not None and importlib.util.find_spec(package) is None:
                raise ValueError(f"\"{tracker}\" needs the {package} package, which is not installed: "
                                 f"pip install -e '.[{TRACKER_EXTRAS[tracker]}]'")
        return trackers

    @model_validator(mode="after")
    def _tracker_settings_of_listed_trackers(self) -> "RunSettings":
        # A settings block for a tracker the run does not use is a mistake (it would be silently ignored). Blocks
        # left at their defaults pass: `rollout config show` writes every default, and its TOML must load back.
        unused = [name for name in ("mlflow", "wandb", "trackio")
                  if name not in self.trackers and getattr(self, name) != type(self).model_fields[name].default]
        if unused:
            raise ValueError(f"{', '.join(f'run.{name}' for name in unused)}: settings of a tracker not in "
                             f"run.trackers ({self.trackers}); add it there or drop the block")
        return self

    @property
    def writes_tensorboard(self) -> bool:
        return self.tensorboard or "tensorboard" in self.trackers

    @field_validator("store")
    @classmethod
    def _absolute_local_store(cls, store: str, info: ValidationInfo) -> str:
        # A relative local root would point somewhere else from another working directory (a worker, a test);
        # made absolute once, at validation, it names one place in every cache key that carries it.
        return store if "://" in store else str(Path(resolve_path(store, info)).resolve())


class OptimizerSettings(StrictModel):
    kind: Literal["sgd", "adamw"] = "adamw"
    lr: float = Field(gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.0, ge=0, lt=1)  # sgd only
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    # The horizon a linear/cosine decay reaches its floor at (default: the run's max_steps). Set it to extend a
    # finished run without changing the learning rate of the steps already trained (see `schedule_horizon`).
    decay_steps: int | None = Field(None, ge=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # floor of linear/cosine decay, as a fraction of lr
    max_grad_norm: float | None = Field(1.0, gt=0)  # gradient clipping; None disables it

    @model_validator(mode="after")
    def _betas_in_range(self) -> "OptimizerSettings":
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1) (got {list(self.betas)})")
        return self


    def schedule_horizon(self, max_steps: int) -> int | None:
        """The step count the learning rate depends on, or None for a constant schedule (then raising max_steps
        continues a finished run; with a decay and no `decay_steps`, it changes every step's rate)."""
        if self.schedule == "constant":
            return None
        return self.decay_steps or max_steps


class BudgetSettings(StrictModel):
    max_steps: int = Field(ge=1)


def existing_path(path: str, info: ValidationInfo, what: str = "file") -> str:
    """`path` made absolute (resolve_path); a local path that does not exist is an error naming where it was
    looked for."""
    resolved = resolve_path(path, info)
    if "://" in path or Path(resolved).exists():
        return resolved
    if Path(path).expanduser().is_absolute():
        raise ValueError(f"no {what} {resolved}")
    base = (info.context or {}).get(BASE_DIR)
    where = (f"relative paths resolve from {base}, the config's project root (the nearest directory above it "
             "with a prefect.yaml)") if base else "relative to the working directory"
    raise ValueError(f"no {what} {resolved} ({where}; give an absolute path or one from there)")


class JsonlDataset(StrictModel):
    """A JSONL file. The RM seed spells the tag `type`, the SFT seed `kind`; both are accepted, as one key."""

    type: Literal["jsonl_path"] = "jsonl_path"
    path: str = Field(min_length=1)

    @field_validator("path")
    @classmethod
    def _from_the_config(cls, path: str, info: ValidationInfo) -> str:
        return existing_path(path, info)

    @model_validator(mode="before")
    @classmethod
    def _kind_or_type(cls, value: Any) -> Any:
        if isinstance(value, dict) and "kind" in value:
            if "type" in value:
                raise ValueError("give either `type` or `kind`, not both")
            value = {**value, "type": value["kind"]}
            del value["kind"]
        return value


class TableDataset(StrictModel):
    """A table in the Hugging Face ecosystem's formats, read offline (rollout_lib/data/sources.py): `parquet` (a
    file, or a folder of them: verl's and the hub's format), `arrow` (an Arrow IPC file or stream, what
    `datasets` caches and saves), `hf_disk` (a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`;
    the `datasets` extra). Rows carry TRL's column names (`prompt`/`completion`, `messages`, `prompt`/`chosen`/
    `rejected`) or the table's own, mapped by `columns` (rollout's name = the table's: `prompt = "question"`).
    The table's content, never its path, enters cache keys and identities."""

    type: Literal["parquet", "arrow", "hf_disk"]
    path: str = Field(min_length=1)
    # Which split: a DatasetDict's (hf_disk), or a folder's `<split>-*.parquet` / `<split>/` files (parquet, arrow).
    # None: the only split there is (a folder with several is an error naming them), or every file of the folder.
    split: str | None = Field(None, min_length=1)
    columns: dict[str, str] = Field(default_factory=dict)  # rollout's column name -> the table's

    @field_validator("path")
    @classmethod
    def _from_the_config(cls, path: str, info: ValidationInfo) -> str:
        return existing_path(path, info, what="file or folder")

    @model_validator(mode="before")
    @classmethod
    def _kind_or_type(cls, value: Any) -> Any:
        return JsonlDataset._kind_or_type(value)


# An SFT or RM dataset: a JSONL file (the default type) or a table.
DatasetSource = tagged_union((JsonlDataset, TableDataset), "dataset", default="jsonl_path")


def dataset_setting(config, split: str):
    """The dataset setting of a split ("train" or "eval") of an entry point with `dataset` and `eval_dataset`."""
    return config.settings.dataset if split == "train" else config.settings.eval_dataset


def dataset_locator(config, split: str) -> str:
    return f"algorithm.{config.algorithm.kind}.{'dataset' if split == 'train' else 'eval_dataset'}"


class EntryPointConfig(StrictModel):
    """The settings of one entry point: `[run]` and `[algorithm.<kind>]`. A subclass declares `algorithm` (a model
    with `kind` and a field of that name holding the entry point's settings)."""

    run: RunSettings = RunSettings()

    @model_validator(mode="after")
    def _checkpoints_in_the_run_store(self) -> "EntryPointConfig":
        """A base model named as a checkpoint (`runs/sft/latest`, an id) is looked up in the run's store unless its
        reference names another."""
        settings = self.settings
        base_model = getattr(settings, "base_model", None)
        if isinstance(base_model, ModelRef) and base_model.store is None:
            # Settings are frozen once validated; this completes validation, it does not change a setting.
            object.__setattr__(settings, "base_model", base_model.model_copy(update={"store": self.run.store}))
        return self

    @property
    def settings(self):
        """The entry point's own settings block (`algorithm.rm`, `algorithm.sft`, `algorithm.rl`)."""
        return getattr(self.algorithm, self.algorithm.kind)

    @property
    def hardware_locator(self) -> str:
        """Where the entry point's hardware settings are written (`algorithm.<kind>.hardware`)."""
        return f"algorithm.{self.algorithm.kind}.hardware"
