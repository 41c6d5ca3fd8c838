"""The failed step as a user finds it: the Prefect UI page of the failed `train-rm/default` run, rendered in
headless Chromium, shows the failed task's name and its error. A screenshot is kept in test-artifacts/.

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
