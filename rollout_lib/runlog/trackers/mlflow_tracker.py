"""MLflow (`run.trackers = ["mlflow"]`): an MLflow tracking server's REST API, over httpx.

Not the `mlflow` package: its client pins importlib-metadata<10 and its server pyarrow<26, against rollout's own
pins, and importing it takes seconds; the API a run needs is six calls. The server (`mlflow server`, its own venv)
keeps the run: each step's metrics at their step, the resolved settings as params, the sample tables as
`samples/step_<9 digits>.json` in `mlflow.log_table`'s format (so `mlflow.load_table` reads them), the curves as
`curves.png`, the final checkpoint and the flow run's page as tags.

One MLflow run per rollout run and store: found again by its `rollout.run_key` tag, so a rerun continues it and
logs only the steps after the last one it holds.
"""

from __future__ import annotations

import json
import math
import re
import time

from rollout_lib.config.common import MlflowSettings

RUN_KEY_TAG = "rollout.run_key"
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"  # what mlflow.load_table searches runs by
TAG_LIMIT = 5000  # MLflow caps a tag's value (8000 characters on recent servers); stay under the older limit
PARAM_LIMIT = 6000
BATCH = 1000  # metrics per log-batch request, MLflow's limit; params: 100


class MlflowBackend:
    name = "mlflow"

    def __init__(self, settings: MlflowSettings, run_name: str, run_key: str):
        self.settings = settings
        self.run_name = run_name
        self.run_key = run_key
        self.run_id: str | None = None
        self.artifact_path: str | None = None  # where the server's artifact proxy keeps the run's files
        self.params: dict[str, str] = {}
        self.tables: list[dict] = []
        self._http = None

    def open(self, settings: dict[str, str]) -> int | None:
        import httpx

        self._http = httpx.Client(base_url=self.settings.tracking_uri.rstrip("/") + "/api/2.0/",
                                  timeout=self.settings.timeout_s)
        experiment_id = self._experiment_id()
        found = self._post("mlflow/runs/search", {
            "experiment_ids": [experiment_id], "filter": f"tags.`{RUN_KEY_TAG}` = '{self.run_key}'",
            "max_results": 1}).get("runs", [])
        if found:
            run = found[0]
        else:
            run = self._post("mlflow/runs/create", {
                "experiment_id": experiment_id, "run_name": self.run_name, "start_time": _now_ms(),
                "tags": [{"key": RUN_KEY_TAG, "value": self.run_key}]})["run"]
        self.run_id = run["info"]["run_id"]
        self._post("mlflow/runs/update", {"run_id": self.run_id, "status": "RUNNING"})
        uri = run["info"].get("artifact_uri", "")
        if uri.startswith("mlflow-artifacts:"):
            self.artifact_path = uri.removeprefix("mlflow-artifacts:").lstrip("/")
        data = run.get("data", {})
        self.params = {param["key"]: param["value"] for param in data.get("params", [])}
        tags = {tag["key"]: tag["value"] for tag in data.get("tags", [])}
        self.tables = json.loads(tags.get(LOGGED_ARTIFACTS_TAG, "[]"))
        self._log_params(settings)
        steps = [int(metric["step"]) for metric in data.get("metrics", [])]
        return max(steps) if steps else None

    def _log_params(self, settings: dict[str, str]) -> None:
        # Params never change once logged: a rerun adds the ones the run lacks and keeps the others as they were.
        params = [{"key": key, "value": str(value)[:PARAM_LIMIT]}
                  for key, value in ((param_key(key), value) for key, value in settings.items())
                  if key not in self.params]
        for start in range(0, len(params), 100):
            self._post("mlflow/runs/log-batch", {"run_id": self.run_id, "params": params[start:start + 100]})

    def metrics(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        now = _now_ms()
        batch = [{"key": name, "value": value, "timestamp": now, "step": step}  # no NaN in JSON: finite values
                 for step, metrics in steps for name, value in metrics.items() if math.isfinite(value)]
        for start in range(0, len(batch), BATCH):
            self._post("mlflow/runs/log-batch", {"run_id": self.run_id, "metrics": batch[start:start + BATCH]})

    def table(self, step: int, columns: list[str], rows: list[list]) -> None:
        path = f"samples/step_{step:09d}.json"
        if not self._upload(path, json.dumps({"columns": columns, "data": rows}).encode(), "application/json"):
            return
        self.tables.append({"path": path, "type": "table"})
        value = json.dumps(self.tables)
        if len(value) <= TAG_LIMIT:  # past it the tables stay artifacts, read as files
            self._tag(LOGGED_ARTIFACTS_TAG, value)

    def finish(self, summary: dict[str, str], curves_png: bytes | None) -> None:
        for key, value in summary.items():
            self._tag(f"rollout.{key}", value)
        self._tag("mlflow.note.content", "\n".join(f"- {key}: {value}" for key, value in summary.items()))
        if curves_png is not None:
            self._upload("curves.png", curves_png, "image/png")
        self._post("mlflow/runs/update", {"run_id": self.run_id, "status": "FINISHED", "end_time": _now_ms()})

    def run_failed(self, error: str) -> None:
        self._tag("rollout.error", error[:5000])
        self._post("mlflow/runs/update", {"run_id": self.run_id, "status": "FAILED", "end_time": _now_ms()})

    def close(self) -> None:
        if self._http is not None:
            self._http.close()

    def _experiment_id(self) -> str:
        name = self.settings.experiment
        response = self._http.get("mlflow/experiments/get-by-name", params={"experiment_name": name})
        if response.status_code == 404:
            return self._post("mlflow/experiments/create", {"name": name})["experiment_id"]
        _check(response)
        return response.json()["experiment"]["experiment_id"]

    def _tag(self, key: str, value: str) -> None:
        self._post("mlflow/runs/set-tag", {"run_id": self.run_id, "key": key, "value": value})

    def _upload(self, path: str, content: bytes, content_type: str) -> bool:
        """A file of the run through the server's artifact proxy; False where the server keeps artifacts
        elsewhere (started with --no-serve-artifacts): metrics and params still go."""
        if self.artifact_path is None:
            return False
        _check(self._http.put(f"mlflow-artifacts/artifacts/{self.artifact_path}/{path}", content=content,
                              headers={"Content-Type": content_type}))
        return True

    def _post(self, endpoint: str, body: dict) -> dict:
        response = self._http.post(endpoint, json=body)
        _check(response)
        return response.json() if response.content else {}


def param_key(setting: str) -> str:
    """A dotted setting as an MLflow key, which allows letters, digits, `_ - . / ` and spaces: list indices as
    path parts (`algorithm.rl.envs[0].name` -> `algorithm.rl.envs.0.name`)."""
    return re.sub(r"[^\w\-. /]", "_", re.sub(r"\[(\d+)\]", r".\1", setting))[:250]


def _check(response) -> None:
    if response.status_code >= 400:
        raise RuntimeError(f"MLflow server {response.request.url}: HTTP {response.status_code} {response.text[:200]}")


def _now_ms() -> int:
    return int(time.time() * 1000)
