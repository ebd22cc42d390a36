"""Unmodified ``e2b`` SDK code on boxd: the conformance suite of the E2B-compatible API.

The real SDK runs in virtualenvs of its own (its dependencies are not boxd's), at the
newest release and at the oldest 2.x release that honours ``E2B_SANDBOX_URL``, in its
sync and its async flavour, against one ``boxd serve`` with real VMs. The steps are
``tests/e2b_scenario.py``; each prints a JSON line, and every line must pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import image_home
from daemon_process import print_log_if_failed, running_daemon

pytestmark = pytest.mark.vm

LATEST = "2.63.0"
OLDEST_WITH_SANDBOX_URL = "2.7.0"  # E2B_SANDBOX_URL came in 2.7.0
SCENARIO = Path(__file__).parent.parent / "e2b_scenario.py"
TEMPLATE = "e2b-booted"
CHECKS = [
    "commands", "background_kill", "stdin", "streamed_stdin", "pty", "files", "watch", "start_holder",
    "pause_connect", "reconnect_stream", "fork", "snapshot", "listing", "timeout_expiry", "wrong_key",
    "metrics", "kill",
]
# Calls the oldest release does not have at all, so it cannot make those checks.
MISSING_IN_OLDEST = {"streamed_stdin", "fork", "snapshot"}


def sdk_python(version: str) -> Path:
    """A virtualenv with ``e2b==version`` (made once per machine, like the guest image)."""
    home = image_home() / "e2b-sdk" / version
    python = home / "bin" / "python"
    if not (home / "ready").exists():
        venv.create(home, with_pip=True, clear=True)
        subprocess.run([python, "-m", "pip", "install", "-q", f"e2b=={version}"], check=True, timeout=600)
        (home / "ready").touch()
    return python


@pytest.fixture(scope="module")
def e2b_daemon(guest_image):
    with running_daemon("boxd-e2b-") as daemon:
        # A booted machine kept as a snapshot: sandboxes made from it start in a second.
        with daemon.sdk() as boxd:
            boxd.machines.new("template-source")
            boxd.machines.wait_until_ready("template-source")
            boxd.snapshots.save("template-source", TEMPLATE)
            boxd.machines.delete("template-source")
        yield daemon


@pytest.fixture(autouse=True)
def daemon_log_on_failure(request, e2b_daemon):
    yield
    print_log_if_failed(request, e2b_daemon)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("flavor", ["sync", "async"])
@pytest.mark.parametrize("version", [LATEST, OLDEST_WITH_SANDBOX_URL])
def test_the_e2b_sdk_runs_unmodified(e2b_daemon, version, flavor):
    url = f"{e2b_daemon.url}/e2b"
    env = {
        "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "PYTHONFAULTHANDLER": "1",
        "E2B_API_KEY": e2b_daemon.local_key(), "E2B_API_URL": url, "E2B_SANDBOX_URL": url,
    }
    done = subprocess.run(
        [sdk_python(version), SCENARIO, flavor, TEMPLATE], env=env, capture_output=True, text=True, timeout=1100
    )
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            results[entry["check"]] = entry
    print(done.stdout[-4000:], done.stderr[-4000:], file=sys.stderr)
    broken = {name: entry["detail"] for name, entry in results.items() if entry["ok"] is False}
    assert not broken, json.dumps(broken, indent=1)
    assert list(results) == CHECKS, f"checks that did not run: {set(CHECKS) - set(results)}\n{done.stderr}"
    skipped = {name for name, entry in results.items() if entry["ok"] is None}
    assert skipped == (MISSING_IN_OLDEST if version == OLDEST_WITH_SANDBOX_URL else set()), skipped
    assert done.returncode == 0, done.stderr[-2000:]
