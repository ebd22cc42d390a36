"""A pytest plugin that ``scripts/e2b-suite`` loads into E2B's own test suite (never into ours).

It runs in the suite's virtualenv (e2b and pytest only, no boxd) and changes nothing
in the suite. For each test it records how many requests reached the boxd daemon (every
request of the e2b SDK, control plane and envd alike, goes through one pyqwest retry
transport, whose ``execute`` it wraps to look at the URL), and appends one JSON line per
test phase to ``$BOXD_E2B_SUITE_REPORT``, written as each phase ends so that a run cut
short keeps what it did. Under pytest-xdist the workers measure and the controller writes.
With ``$BOXD_E2B_SUITE_COLLECT`` set it writes there the collected test ids, each with the
names of the fixtures it uses.
"""

from __future__ import annotations

import json
import os
import threading
import time
from urllib.parse import urlsplit

import pytest

_PORT = os.environ.get("BOXD_E2B_SUITE_PORT", "")
_LOOPBACK = {"127.0.0.1", "localhost", "[::1]", "::1"}
_lock = threading.Lock()
_requests = 0


def _note(url: object) -> None:
    global _requests
    try:
        parts = urlsplit(str(url))
        hit = parts.hostname in _LOOPBACK and str(parts.port) == _PORT
    except ValueError:
        return
    if hit:
        with _lock:
            _requests += 1


def _wrap(cls: type, name: str, is_async: bool) -> None:
    original = getattr(cls, name)
    if getattr(original, "_boxd_wrapped", False):
        return
    if is_async:
        async def execute(self, request, *args, **kwargs):
            _note(getattr(request, "url", ""))
            return await original(self, request, *args, **kwargs)
    else:
        def execute(self, request, *args, **kwargs):
            _note(getattr(request, "url", ""))
            return original(self, request, *args, **kwargs)
    execute._boxd_wrapped = True  # type: ignore[attr-defined]
    setattr(cls, name, execute)


def pytest_configure(config: pytest.Config) -> None:
    try:
        from pyqwest.middleware.retry import RetryTransport, SyncRetryTransport
    except ImportError:  # another pyqwest layout: requests are then not counted
        return
    _wrap(RetryTransport, "execute", is_async=True)
    _wrap(SyncRetryTransport, "execute_sync", is_async=False)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_collection_finish(session: pytest.Session) -> None:
    target = os.environ.get("BOXD_E2B_SUITE_COLLECT")
    if target and not _is_worker(session.config):
        with open(target, "w") as out:
            json.dump({item.nodeid: list(getattr(item, "fixturenames", ())) for item in session.items}, out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    global _requests
    outcome = yield
    report = outcome.get_result()
    with _lock:
        made, _requests = _requests, 0
    report.user_properties.append(("boxd_requests", made))
    if call.when == "setup":
        report.user_properties.append(("boxd_fixtures", list(getattr(item, "fixturenames", ()))))


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _write({"nodeid": nodeid, "when": "start", "time": time.time()})


def _message(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)
    text = str(longrepr).strip().splitlines()
    errors = [line for line in text if line.startswith("E ")]
    return (errors[0] if errors else text[-1] if text else "").strip()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    properties = dict(report.user_properties)
    _write({
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "xfail": hasattr(report, "wasxfail"),
        "message": _message(report) if report.outcome != "passed" else "",
        "duration": round(report.duration, 3),
        "requests": properties.get("boxd_requests", 0),
        "fixtures": properties.get("boxd_fixtures"),
        "time": time.time(),
        "worker": (getattr(getattr(report, "node", None), "workerinput", None) or {}).get("workerid"),
    })


_config: pytest.Config | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    global _config
    _config = session.config


def _write(entry: dict) -> None:
    target = os.environ.get("BOXD_E2B_SUITE_REPORT")
    if not target or (_config is not None and _is_worker(_config)):
        return
    with _lock, open(target, "a") as out:
        out.write(json.dumps(entry) + "\n")
