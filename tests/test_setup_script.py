"""scripts/setup.sh fails when an install fails: its quiet `pip` wrapper (scripts/quiet-pip.sh) filters pip's noisy
'WARNING: Location' lines but returns pip's own exit status, including when the filter prints nothing."""

from __future__ import annotations

import subprocess

import pytest

from clirun import ROOT

WRAPPER = ROOT / "scripts" / "quiet-pip.sh"


def run_wrapper(cwd, *pip_args: str) -> subprocess.CompletedProcess:
    # As setup.sh runs it: `set -eu`, then the wrapper; a failing pip must stop the script before "after".
    script = f'set -eu; source "{WRAPPER}"; pip {" ".join(pip_args)}; echo after'
    return subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=120)


def fake_venv(tmp_path, output: str, status: int):
    """A `.venv/bin/python` that prints `output` and exits with `status`, whatever it is asked."""
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nprintf '%s' '{output}'\nexit {status}\n")
    python.chmod(0o755)
    return tmp_path


@pytest.mark.parametrize("output", ["", "WARNING: Location 'x' is ignored\n"])  # the filter prints nothing
def test_a_quiet_success_succeeds(tmp_path, output):
    done = run_wrapper(fake_venv(tmp_path, output, 0), "install", "x")
    assert (done.returncode, done.stdout) == (0, "after\n")


@pytest.mark.parametrize("output", ["", "WARNING: Location 'x' is ignored\n", "ERROR: No matching distribution\n"])
def test_a_failed_install_fails_with_pips_status(tmp_path, output):
    done = run_wrapper(fake_venv(tmp_path, output, 7), "install", "x")
    assert done.returncode == 7 and "after" not in done.stdout
    assert "WARNING: Location" not in done.stdout
    assert ("ERROR: No matching distribution" in done.stdout) == output.startswith("ERROR")


def test_the_real_pip_failing_fails_the_wrapper():
    done = run_wrapper(ROOT, "install", "--no-index", "--dry-run", "rollout-no-such-package-xyz")
    assert done.returncode != 0 and "after" not in done.stdout
    assert "No matching distribution found for rollout-no-such-package-xyz" in done.stdout


def test_setup_uses_the_wrapper_and_swallows_nothing():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "source scripts/quiet-pip.sh" in setup and "|| true" not in setup
    assert "set -euo pipefail" in setup
