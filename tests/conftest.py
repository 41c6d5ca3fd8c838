"""Test-session set-up: offline, isolated caches, and one real Prefect server for the whole session.

The environment is fixed here, at import time, before any test imports Prefect: Prefect reads its settings when
it is imported, and subprocesses (the CLI, workers) inherit them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SESSION_DIR = Path(tempfile.mkdtemp(prefix="rollout-tests-"))

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["ROLLOUT_CACHE_DIR"] = str(SESSION_DIR / "cache")
os.environ["ROLLOUT_STATE_DIR"] = str(SESSION_DIR / "state")
os.environ["PREFECT_HOME"] = str(SESSION_DIR / "prefect-home")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
sys.path.insert(0, str(ROOT))

from flows.local_server import free_port, is_healthy, stop_process_group  # noqa: E402

_PORT = free_port()
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{_PORT}/api"
ARTIFACTS_DIR = ROOT / "test-artifacts"


@pytest.fixture(scope="session")
def prefect_server():
    """A real `prefect server start` on 127.0.0.1, shared by every test that needs the API; always stopped."""
    api_url = os.environ["PREFECT_API_URL"]
    log = (SESSION_DIR / "prefect-server.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(_PORT)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not is_healthy(api_url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not start; see {SESSION_DIR / 'prefect-server.log'}")
            time.sleep(0.5)
        yield {"api_url": api_url, "ui_url": api_url.removesuffix("/api"), "pid": process.pid}
    finally:
        stop_process_group(process.pid)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from rollout_lib.model.tiny import build_tiny_qwen2

    return build_tiny_qwen2(SESSION_DIR / "tiny-qwen2")


@pytest.fixture
def store_root(tmp_path) -> str:
    return str(tmp_path / "store")
