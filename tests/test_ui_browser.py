"""Runs as a user finds them in the Prefect UI, rendered in headless Chromium: the page of a failed
`train-rm/default` run shows the failed task's name and its error; a finished run's page its name and tags, its
settings and curves as artifacts. Screenshots are kept in test-artifacts/.

Needs Debian's `chromium` and `chromium-driver` (README, test set-up); the test installs nothing. Set
ROLLOUT_SKIP_BROWSER=1 to skip it on a machine without them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ARTIFACTS_DIR

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def browser():
    if os.environ.get("ROLLOUT_SKIP_BROWSER") == "1":
        pytest.skip("ROLLOUT_SKIP_BROWSER=1")
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not Path(path).exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: `apt-get install -y chromium chromium-driver` (README, test "
                    "set-up), or set ROLLOUT_SKIP_BROWSER=1")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="rollout-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--window-size=1600,1200", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait_for_text(driver, needles: list[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = driver.find_element("tag name", "body").text
        if all(needle in text for needle in needles):
            return text
        time.sleep(0.5)
    return text


def test_failed_flow_run_page_shows_failed_task_and_error(worker_stack, failed_row_run, browser):
    flow_run, data, line = failed_row_run["flow_run"], failed_row_run["data"], failed_row_run["line"]
    assert flow_run["state"]["type"] == "FAILED"
    url = f"{worker_stack.ui_url}/runs/flow-run/{flow_run['id']}"
    ARTIFACTS_DIR.mkdir(exist_ok=True)
    screenshot = ARTIFACTS_DIR / "failed-flow-run.png"

    browser.get(url)
    needles = [flow_run["name"], "Failed", "load-pairs-train", f"{data.name}:{line}: invalid JSON"]
    text = _wait_for_text(browser, needles, timeout=60)
    browser.save_screenshot(str(screenshot))
    (ARTIFACTS_DIR / "failed-flow-run.txt").write_text(text)
    missing = [needle for needle in needles if needle not in text]
    assert not missing, f"{url} never showed {missing}; screenshot {screenshot}; rendered text:\n{text[:3000]}"


def test_a_finished_run_is_found_by_name_with_its_tags_settings_and_curves_in_the_ui(prefect_server, browser,
                                                                                     tmp_path):
    """A `rollout train rm` run as a user finds it in the UI: its page is named after the run and shows its tags
    (run name, flow, short identity); its resolved settings are a table artifact; its curves (`<run>-curves`, a PNG
    inside a markdown artifact) render, decoded by the browser (naturalWidth > 0), not a broken-image icon."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from clirun import run_rollout

    done = run_rollout("train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={tmp_path}",
                       "--set", "run.name=rm-curves", "--max-steps", "4", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["rm-curves-curves"])))
    assert artifacts, "no curves artifact"
    artifact = max(artifacts, key=lambda found: found.created)
    assert "data:image/png;base64," in artifact.data
    url = f"{prefect_server['ui_url']}/artifacts/artifact/{artifact.id}"
    ARTIFACTS_DIR.mkdir(exist_ok=True)
    screenshot = ARTIFACTS_DIR / "run-curves.png"

    browser.get(url)
    deadline, widths = time.monotonic() + 60, []
    while time.monotonic() < deadline:
        images = [image for image in browser.find_elements("tag name", "img")
                  if (image.get_attribute("src") or "").startswith("data:image/png")]
        widths = [browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image)
                  for image in images]
        if widths and all(widths):
            break
        time.sleep(0.5)
    browser.save_screenshot(str(screenshot))
    assert widths and all(width > 100 for width in widths), f"{url}: curve image not rendered ({widths}); " \
                                                            f"screenshot {screenshot}"

    flow_run_id = str(artifact.flow_run_id)
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(artifact.flow_run_id)
        settings = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["rm-curves-settings"])))
    assert flow_run.name == f"rm-curves-{flow_run_id[:4]}"
    identity_tag = next(tag for tag in flow_run.tags if tag.startswith("identity:"))
    assert {"rm-curves", "train-rm"} <= set(flow_run.tags)
    for page, needles, shot in (
            (f"/runs/flow-run/{flow_run_id}", [flow_run.name, "rm-curves", "train-rm", identity_tag], "run-page.png"),
            (f"/artifacts/artifact/{max(settings, key=lambda found: found.created).id}",
             ["algorithm.rm.optimizer.lr", "run.seed", "training identity"], "run-settings.png")):
        browser.get(f"{prefect_server['ui_url']}{page}")
        text = _wait_for_text(browser, needles, timeout=60)
        browser.save_screenshot(str(ARTIFACTS_DIR / shot))
        missing = [needle for needle in needles if needle not in text]
        assert not missing, f"{page} never showed {missing}; screenshot {ARTIFACTS_DIR / shot}:\n{text[:2000]}"
