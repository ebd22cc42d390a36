"""E2B's own Python SDK test suite, unmodified, against a fresh boxd daemon: a table by area.

``scripts/e2b-suite`` runs this with boxd's Python. The suite is
``packages/python-sdk/tests`` of e2b-dev/E2B at ``SUITE_COMMIT`` (the commit of the
``e2b`` release ``E2B_VERSION``): its tests, conftests, ``pytest.ini``, ``pyproject.toml``
and ``uv.lock`` are exported with git into a work folder (never into this repository; the
SDK's own source is left out so that the tests import the released wheel). It runs in a
cached virtualenv holding ``e2b==E2B_VERSION`` and the suite's dev dependencies at the
versions its ``uv.lock`` pins, against a daemon started for the run in a temporary
``BOXD_HOME`` (``daemon_process.running_daemon``: the guest image is shared, every VM is
deleted at the end, Ctrl-C and SIGTERM included).

Each test gets an area (its folder: api, sandbox, commands, files, pty, git, shared,
client for the top-level files, and template, volume, secret) and a flavour (sync or
async, none for shared/ and the top-level files), and a kind:

- ``daemon``: it made requests to the daemon (counted by the plugin
  ``e2b_suite_plugin.py``), or uses a fixture that makes a sandbox or a template build;
- ``client``: it never reached the daemon (the SDK's own unit tests, mocked APIs, and
  calls the SDK refuses client-side);
- ``not in boxd``: template builds, volumes and secrets, which boxd does not offer
  (README: "Not supported"); counted apart, whatever they did;
- ``n/a``: listed in ``NOT_APPLICABLE`` with a reason (E2B's cloud domain, the public
  internet); they are deselected, not run (``--run-na`` runs them anyway).

The exit status is 1 if a daemon or client test failed or errored (``--strict``: a
not-in-boxd one too), 2 if the run could not be made, 130 if interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import venv
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

E2B_VERSION = "2.45.1"
SUITE_COMMIT = "b8029973aa7da5f741f7bb1a9f833b38a0885438"
DEFAULT_SUITE_REPO = "https://github.com/e2b-dev/E2B.git"
SDK_DIR = "packages/python-sdk"
# What the export takes from SDK_DIR: not the SDK's source (``e2b/``), which would
# shadow the installed release.
EXPORTED = ("tests", "pytest.ini", "pyproject.toml", "uv.lock")
# Dev dependencies of the suite that running it does not need (linter, type checker).
NOT_NEEDED = {"ruff", "ty"}
PLUGIN = Path(__file__).with_name("e2b_suite_plugin.py")
PLUGIN_MODULE = "boxd_e2b_report"

FLAVOURS = ("sync", "async")
FLAVOURED_AREAS = ("api", "sandbox", "commands", "files", "pty", "template", "volume", "secret")
PLAIN_AREAS = ("git", "shared", "client")
AREAS = FLAVOURED_AREAS + PLAIN_AREAS
NOT_IN_BOXD = ("template", "volume", "secret")
# Fixtures of the suite's conftests that make a sandbox or a template build on the server.
SERVER_FIXTURES = {
    "sandbox", "async_sandbox", "sandbox_factory", "async_sandbox_factory", "build", "async_build",
    "git_sandbox", "template",
}


@dataclass(frozen=True)
class NotApplicable:
    """Tests (a node id, or a file or node id prefix) that cannot pass on any self-hosted
    daemon, with the reason. ``{f}`` stands for sync and async (``sandbox_{f}``)."""

    pattern: str
    reason: str
    client: bool = False  # a client-side test: it never reaches the server


_PUBLIC_URL = "fetches https://<sandbox.get_host(port)>, a public URL under E2B's sandbox domain (boxd serves http://NAME.localhost:PORT/)"
_DEFAULT_URL = ("asserts the envd URL the SDK derives from E2B's domain (https://sandbox.e2b.app and the like); "
                "E2B_SANDBOX_URL, set for the run (it is how the SDK reaches boxd), takes precedence")

# The one list of tests that are not applicable, each with its reason (read from the
# tests at SUITE_COMMIT). A pattern that matches no collected test is reported.
NOT_APPLICABLE: tuple[NotApplicable, ...] = (
    NotApplicable("tests/{f}/sandbox_{f}/test_host.py::test_ping_server", _PUBLIC_URL),
    NotApplicable("tests/{f}/sandbox_{f}/test_create.py::test_auto_resume_wakes_on_http_request",
                  "wakes a paused sandbox by an https request to sandbox.get_host(8000) under E2B's domain"),
    NotApplicable("tests/{f}/sandbox_{f}/test_network.py",
                  "egress rules tried against public IPs (1.1.1.1, 8.8.8.8) from the sandbox, public sandbox URLs "
                  "(get_host, traffic tokens, mask_request_host) and the 'httpbin' template: E2B's network and the "
                  "public internet"),
    NotApplicable("tests/{f}/sandbox_{f}/test_internet_access.py",
                  "curls connectivitycheck.gstatic.com from the sandbox: needs the public internet, which this "
                  "kind of host must not reach (only loopback and package registries)"),
    NotApplicable("tests/{f}/sandbox_{f}/test_config_propagation.py::test_connect_sets_stable_host_routing_headers",
                  _DEFAULT_URL, client=True),
    *(NotApplicable(f"tests/test_connection_config.py::{name}", _DEFAULT_URL, client=True) for name in (
        "test_sandbox_url_uses_stable_host_for_supported_domain",
        "test_sandbox_url_uses_stable_host_for_supported_non_prod_domain",
        "test_sandbox_url_falls_back_to_per_sandbox_host_for_custom_domain",
        "test_sandbox_url_falls_back_to_per_sandbox_host_for_unsupported_subdomain",
        "test_sandbox_url_debug_uses_localhost",
        "test_sandbox_direct_url_keeps_per_sandbox_host_for_supported_domain",
    )),
    NotApplicable("tests/test_sandbox_urls.py::test_file_urls_use_direct_sandbox_host_when_envd_api_uses_stable_host",
                  _DEFAULT_URL, client=True),
    NotApplicable("tests/shared/sandbox/test_egress_proxy.py::test_create_omits_none_credentials",
                  "came with an SDK fix (E2B #1757, this very commit) made after the 2.45.1 release: the released "
                  "SDK still sends None proxy credentials", client=True),
)
# Not applicable only while the daemon refuses ``e2b_<hex>`` keys, so that the run sets
# E2B_VALIDATE_API_KEY=false (see key_for_sdk).
WITHOUT_KEY_VALIDATION: tuple[NotApplicable, ...] = (
    NotApplicable("tests/test_validate_api_key.py::test_api_client_validates_key_by_default",
                  "expects the SDK to check the key's form, which E2B_VALIDATE_API_KEY=false turns off; the run sets "
                  "it because this daemon refuses e2b_<hex> keys", client=True),
)


def expand(pattern: str) -> list[str]:
    return [pattern.format(f=flavour) for flavour in FLAVOURS] if "{f}" in pattern else [pattern]


def not_applicable_reason(nodeid: str, entries: tuple[NotApplicable, ...] = NOT_APPLICABLE) -> NotApplicable | None:
    for entry in entries:
        for pattern in expand(entry.pattern):
            if nodeid == pattern or nodeid.startswith((pattern + "::", pattern + "[")):
                return entry
    return None


def area_of(nodeid: str) -> tuple[str, str]:
    """(area, flavour) of a test from its folder; flavour "-" for shared/ and top-level tests."""
    parts = nodeid.split("::")[0].split("/")
    if len(parts) > 2 and parts[1] in FLAVOURS:
        group = parts[2].rsplit("_", 1)[0]  # sandbox_sync -> sandbox
        if group == "sandbox" and len(parts) > 4:
            return parts[3], parts[1]  # commands, files, pty
        return group, parts[1]
    if len(parts) > 2 and parts[1] == "shared":
        return ("git" if parts[2] == "git" else "shared"), "-"
    return "client", "-"


def selection_paths(sdk: Path, areas: list[str], flavours: list[str]) -> list[str]:
    """pytest path arguments for the areas and flavours asked for (all: the whole suite)."""
    if not areas and len(flavours) == len(FLAVOURS):
        return ["tests"]
    chosen = areas or list(AREAS)
    paths: list[str] = []
    for area in chosen:
        if area in FLAVOURED_AREAS:
            for f in flavours:
                if area == "sandbox":  # only the files of sandbox_{f}, not its sub-folders
                    paths += sorted(str(p.relative_to(sdk)) for p in (sdk / f"tests/{f}/sandbox_{f}").glob("test_*.py"))
                elif area in ("commands", "files", "pty"):
                    paths.append(f"tests/{f}/sandbox_{f}/{area}")
                else:
                    paths.append(f"tests/{f}/{area}_{f}")
        elif areas or len(flavours) == len(FLAVOURS):  # no flavour: only when named or both asked
            if area == "git":
                paths.append("tests/shared/git")
            elif area == "shared":
                paths += sorted(str(p.relative_to(sdk)) for p in (sdk / "tests/shared").iterdir()
                                if p.is_dir() and p.name not in ("git", "__pycache__"))
            else:
                paths += sorted(str(p.relative_to(sdk)) for p in (sdk / "tests").glob("test_*.py"))
    return [p for p in paths if (sdk / p).exists()]


# ---------------------------------------------------------------------------------
# The suite and its virtualenv


def run(argv: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], check=True, **kwargs)


def export_suite(source: str, commit: str, work: Path) -> Path:
    """EXPORTED of SDK_DIR at ``commit`` into ``work/suite``. ``source`` is a local git
    repository (bare or not), read with ``git archive``, or a URL, fetched at depth 1 with
    only the blobs of those paths (a sparse checkout of a blobless fetch)."""
    destination = work / "suite"
    paths = [f"{SDK_DIR}/{name}" for name in EXPORTED]
    if Path(source).exists():
        archive = subprocess.run(["git", "-C", source, "archive", "--format=tar", commit, *paths],
                                 check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(destination, filter="data")
        return destination / SDK_DIR
    clone = work / "suite-clone"
    shutil.rmtree(clone, ignore_errors=True)
    run(["git", "init", "-q", clone])
    run(["git", "-C", clone, "remote", "add", "origin", source])
    run(["git", "-C", clone, "sparse-checkout", "set", "--no-cone", *(f"/{p}" for p in paths)])
    run(["git", "-C", clone, "fetch", "-q", "--depth", "1", "--filter=blob:none", "origin", commit], timeout=600)
    run(["git", "-C", clone, "-c", "advice.detachedHead=false", "checkout", "-q", "FETCH_HEAD"], timeout=600)
    for path in paths:
        target = destination / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(clone / path, target)
    shutil.rmtree(clone, ignore_errors=True)
    return destination / SDK_DIR


def _requirement_name(spec: str) -> str:
    name = spec
    for stop in "<>=!~[; ":
        name = name.split(stop)[0]
    return name.strip().lower().replace("_", "-")


def suite_requirements(sdk: Path) -> tuple[list[str], list[str]]:
    """(requirements, constraints): e2b==E2B_VERSION and the suite's dev group, each at
    the version uv.lock pins (as pip constraints: they only apply to what gets installed)."""
    project = tomllib.loads((sdk / "pyproject.toml").read_text())
    declared = project["project"]["version"]
    if declared != E2B_VERSION:
        print(f"warning: the suite at this commit is for e2b {declared}, installing e2b {E2B_VERSION}", file=sys.stderr)
    dev = [spec for spec in project.get("dependency-groups", {}).get("dev", []) if isinstance(spec, str)]
    requirements = [f"e2b=={E2B_VERSION}", *(spec for spec in dev if _requirement_name(spec) not in NOT_NEEDED)]
    constraints = []
    lock = sdk / "uv.lock"
    if lock.exists():
        for package in tomllib.loads(lock.read_text()).get("package", []):
            source = package.get("source", {})
            if "editable" in source or "virtual" in source or "version" not in package:
                continue  # the e2b project itself
            constraints.append(f"{package['name']}=={package['version']}")
    return requirements, sorted(constraints)


def suite_python(sdk: Path, home: Path) -> tuple[Path, dict]:
    """The virtualenv's Python (made once per set of requirements) and its versions."""
    requirements, constraints = suite_requirements(sdk)
    digest = hashlib.sha256(json.dumps([requirements, constraints]).encode()).hexdigest()
    python = home / "bin" / "python"
    ready = home / "ready"
    if not (ready.exists() and ready.read_text().split("\n")[0] == digest):
        print(f"making the suite's virtualenv in {home} (e2b=={E2B_VERSION} and the test dependencies)", flush=True)
        venv.create(home, with_pip=True, clear=True)
        (home / "requirements.txt").write_text("\n".join(requirements) + "\n")
        (home / "constraints.txt").write_text("\n".join(constraints) + "\n")
        install = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", home / "requirements.txt"]
        pinned = subprocess.run([str(a) for a in install + ["-c", home / "constraints.txt"]], timeout=900)
        if pinned.returncode != 0:
            print("warning: the versions uv.lock pins did not install; installing without them", file=sys.stderr)
            run(install, timeout=900)
        ready.write_text(digest + "\n")
    versions = json.loads(subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in "
         "('e2b', 'pytest', 'pytest-asyncio', 'pytest-xdist', 'pytest-timeout', 'pyqwest', 'httpx')}))"],
        check=True, capture_output=True, text=True).stdout)
    if versions["e2b"] != E2B_VERSION:
        raise SystemExit(f"the virtualenv {home} holds e2b {versions['e2b']}, not {E2B_VERSION}: delete it")
    return python, versions


# ---------------------------------------------------------------------------------
# Results


@dataclass
class Result:
    nodeid: str
    area: str
    flavour: str
    kind: str = "daemon"  # daemon | client | not in boxd
    outcome: str = "not run"  # passed | failed | error | skipped | n/a | not run
    reason: str = ""
    requests: int = 0
    duration: float = 0.0
    fixtures: list[str] = field(default_factory=list)


def _one_line(text: str, limit: int = 220) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


class Phases:
    """The plugin's JSON lines (one per test phase), read as they are appended."""

    def __init__(self, report: Path) -> None:
        self.report = report
        self.offset = 0
        self.seen: dict[str, dict[str, dict]] = defaultdict(dict)

    def read(self) -> list[dict]:
        """The entries appended since the last read."""
        if not self.report.exists():
            return []
        with open(self.report, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        entries = []
        for line in complete.decode(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError, KeyError):
                entry = json.loads(line)
                self.seen[entry["nodeid"]][entry["when"]] = entry
                entries.append(entry)
        return entries


def update_result(results: dict[str, Result], nodeid: str, seen: dict[str, dict], timeout: float) -> Result:
    """The outcome of one test from its phases' reports."""
    result = results.get(nodeid)
    if result is None:
        area, flavour = area_of(nodeid)
        result = results[nodeid] = Result(nodeid, area, flavour)
    setup, call, teardown, crash = (seen.get(w) for w in ("setup", "call", "teardown", "???"))
    reports = [r for r in (setup, call, teardown, crash) if r is not None]
    if not reports:
        return result  # started, no report yet
    result.requests = sum(r.get("requests") or 0 for r in reports)
    result.duration = round(sum(r.get("duration") or 0 for r in reports), 2)
    result.fixtures = (setup or {}).get("fixtures") or result.fixtures
    if crash is not None:  # pytest-xdist's report for a worker that died (the thread timeout ends it)
        start = seen.get("start", {}).get("time")
        if start and crash.get("time"):
            result.duration = round(crash["time"] - start, 2)
        result.outcome = "error"
        result.reason = (f"worker crashed (the per-test timeout of {timeout:g} s ends it), "
                         + _one_line(crash.get("message", ""), 120))
    elif setup and setup["outcome"] == "failed":
        result.outcome, result.reason = "error", "setup: " + _one_line(setup["message"])
    elif (setup and setup["outcome"] == "skipped") or (call and call["outcome"] == "skipped"):
        skipped = call if call and call["outcome"] == "skipped" else setup
        result.outcome = "skipped"
        result.reason = ("xfail: " if skipped.get("xfail") else "") + _one_line(skipped["message"])
    elif call and call["outcome"] == "failed":
        result.outcome, result.reason = "failed", _one_line(call["message"])
    elif teardown and teardown["outcome"] == "failed":
        result.outcome, result.reason = "error", "teardown: " + _one_line(teardown["message"])
    elif call and teardown:
        result.outcome = "passed"
    return result


def classify(result: Result) -> None:
    if result.outcome == "n/a":
        return
    if result.area in NOT_IN_BOXD:
        result.kind = "not in boxd"
    elif result.requests > 0 or SERVER_FIXTURES & set(result.fixtures):
        result.kind = "daemon"
    elif result.outcome != "not run":
        result.kind = "client"


COLUMNS = ("passed", "failed", "error", "skipped", "n/a")
KIND_ORDER = {"daemon": 0, "client": 1, "not in boxd": 2}


def table_rows(results: list[Result]) -> list[dict]:
    rows: dict[tuple[str, str, str], Counter] = defaultdict(Counter)
    for r in results:
        if r.outcome == "not run":
            continue
        rows[(r.kind, r.area, r.flavour)][r.outcome] += 1
    ordered = sorted(rows, key=lambda k: (KIND_ORDER.get(k[0], 9), AREAS.index(k[1]) if k[1] in AREAS else 99, k[2]))
    out = []
    for kind, area, flavour in ordered:
        counts = rows[(kind, area, flavour)]
        out.append({"kind": kind, "area": area, "flavour": flavour, **{c: counts[c] for c in COLUMNS},
                    "total": sum(counts.values())})
    return out


def counts_as_failure(result: Result, strict: bool) -> bool:
    return result.outcome in ("failed", "error") and (strict or result.kind != "not in boxd")


def print_report(console, results: list[Result], rows: list[dict], meta: dict, strict: bool) -> None:
    from rich.table import Table

    table = Table(title=f"E2B Python SDK suite (e2b {E2B_VERSION}, {SUITE_COMMIT[:12]}) on boxd", title_justify="left")
    for name in ("kind", "area", "passed", "failed", "errors", "skipped", "n/a", "total"):
        table.add_column(name, justify="left" if name in ("kind", "area") else "right", no_wrap=True)
    previous = None
    for row in rows:
        if previous is not None and row["kind"] != previous:
            table.add_section()
        previous = row["kind"]
        area = row["area"] + ("" if row["flavour"] == "-" else f" ({row['flavour']})")
        failed, errors = row["failed"], row["error"]
        table.add_row(row["kind"], area, str(row["passed"]), f"[red]{failed}[/]" if failed else "0",
                      f"[red]{errors}[/]" if errors else "0", str(row["skipped"]), str(row["n/a"]), str(row["total"]))
    table.add_section()
    for kind in ("daemon", "client", "not in boxd"):
        picked = [r for r in rows if r["kind"] == kind]
        if picked:
            table.add_row(f"[bold]{kind}[/]", "all", *(str(sum(r[c] for r in picked)) for c in (*COLUMNS, "total")))
    console.print(table)
    failing = [r for r in results if r.outcome in ("failed", "error")]
    if failing:
        console.print(f"\n[bold]Failing tests[/] ({len(failing)}; not in boxd ones do not change the exit status"
                      f"{'' if not strict else ', except with --strict'}):")
        for r in sorted(failing, key=lambda r: (KIND_ORDER.get(r.kind, 9), r.nodeid)):
            mark = "" if counts_as_failure(r, strict) else "[dim](not in boxd)[/] "
            console.print(f"  {mark}{r.outcome:6} {r.nodeid}\n           {r.reason}", highlight=False, soft_wrap=True)
    skipped = [r for r in results if r.outcome == "n/a"]
    if skipped:
        by_reason = Counter(r.reason for r in skipped)
        console.print(f"\n[bold]Not applicable[/] ({len(skipped)}, not run; the list is NOT_APPLICABLE in tests/e2b_suite.py):")
        for reason, count in by_reason.items():
            console.print(f"  {count:3} x {reason}", highlight=False, soft_wrap=True)
    not_run = [r for r in results if r.outcome == "not run"]
    if not_run:
        console.print(f"\n[yellow]{len(not_run)} selected tests have no result[/] (the run was cut short)")
    console.print(f"\nwork folder (pytest.log, daemon.log, results.jsonl, junit.xml): {meta['work']}", highlight=False)


# ---------------------------------------------------------------------------------
# The run


class Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def _still_cleaning(signum, frame):
    print("\nstill stopping the daemon and deleting its VMs; one moment", file=sys.stderr, flush=True)


def pytest_env(args, plugin_dir: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {name: os.environ[name] for name in ("PATH", "HOME", "TMPDIR", "LANG", "TERM") if name in os.environ}
    env.update(PYTHONPATH=str(plugin_dir), PYTHONFAULTHANDLER="1", PYTHONDONTWRITEBYTECODE="1")
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    env.update(extra)
    return env


def collect(pytest_bin: Path, sdk: Path, selection: list[str], args, plugin_dir: Path, work: Path) -> dict[str, list[str]]:
    """The selected tests' ids, each with the fixtures it uses."""
    target = work / "collected.json"
    argv = [pytest_bin, *selection, "--collect-only", "-q", "-p", "no:cacheprovider", "-p", PLUGIN_MODULE]
    if args.k:
        argv += ["-k", args.k]
    done = subprocess.run([str(a) for a in argv], cwd=sdk, capture_output=True, text=True,
                          env=pytest_env(args, plugin_dir, {"BOXD_E2B_SUITE_COLLECT": str(target)}))
    if not target.exists():
        raise SystemExit(f"collecting the suite failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(target.read_text())


def key_for_sdk(url: str, boxd_key: str) -> tuple[str, dict[str, str], str]:
    """The E2B_API_KEY to give the SDK, extra env, and a note. e2b validates the key's form
    (``e2b_`` + hex) client-side: boxd's ``boxd_<hex>`` goes as ``e2b_<hex>`` where the
    daemon takes that, else as it is with E2B_VALIDATE_API_KEY=false."""
    import httpx

    e2b_form = "e2b_" + boxd_key.removeprefix("boxd_")
    status = httpx.get(f"{url}/e2b/sandboxes", headers={"X-API-Key": e2b_form}, timeout=30).status_code
    if status == 200:
        return e2b_form, {}, "E2B_API_KEY=e2b_<hex of the daemon's local key>"
    own = httpx.get(f"{url}/e2b/sandboxes", headers={"X-API-Key": boxd_key}, timeout=30).status_code
    if own != 200:
        raise SystemExit(f"the daemon answers GET /e2b/sandboxes with {own} even for its local key")
    return boxd_key, {"E2B_VALIDATE_API_KEY": "false"}, (
        f"the daemon refused the e2b_<hex> form ({status}): E2B_API_KEY=boxd_<hex> with E2B_VALIDATE_API_KEY=false")


def run_pytest(argv: list, sdk: Path, env: dict, work: Path, results: dict[str, Result], total: int,
               args, console) -> int:
    """pytest in a session of its own (Ctrl-C reaches this process, which stops it),
    printing a line per finished test; a watchdog ends it if nothing finishes for long."""
    phases = Phases(Path(env["BOXD_E2B_SUITE_REPORT"]))
    log = open(work / "pytest.log", "ab")
    process = subprocess.Popen([str(a) for a in argv], cwd=sdk, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    finished, last_progress = 0, time.monotonic()
    stall_limit = args.timeout + 300
    try:
        while True:
            code = process.poll()
            for entry in phases.read():
                last_progress = time.monotonic()
                if entry["when"] not in ("teardown", "???"):
                    continue
                finished += 1
                r = update_result(results, entry["nodeid"], phases.seen[entry["nodeid"]], args.timeout)
                colour = {"passed": "green", "failed": "red", "error": "red"}.get(r.outcome, "yellow")
                console.print(f"[{finished}/{total}] [{colour}]{r.outcome:7}[/] {r.nodeid} ({r.duration:.1f} s)"
                              + (f"\n            {r.reason}" if r.outcome in ("failed", "error") else ""),
                              highlight=False, soft_wrap=True)
            if code is not None:
                return code
            if time.monotonic() - last_progress > stall_limit:
                console.print(f"[red]no test finished for {stall_limit:g} s: stopping pytest[/]")
                _stop_group(process)
                return process.wait()
            time.sleep(1)
    except BaseException:
        _stop_group(process)
        raise
    finally:
        log.close()


def _stop_group(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/e2b-suite", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="areas: " + ", ".join(AREAS) + "\nexample: scripts/e2b-suite --suite-repo /work/.mirror/e2b-dev+E2B/repo "
               "--area commands --flavor sync")
    parser.add_argument("--suite-repo", default=DEFAULT_SUITE_REPO, help="git repository (path or URL) of e2b-dev/E2B")
    parser.add_argument("--commit", default=SUITE_COMMIT, help=argparse.SUPPRESS)
    parser.add_argument("--area", action="append", default=[], choices=AREAS, help="only this area (repeatable)")
    parser.add_argument("--flavor", choices=("sync", "async", "both"), default="both",
                        help="only sync or async tests (shared/ and top-level tests have no flavour: left out unless "
                             "their area is named)")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--subset", action="append", default=[], metavar="NODEID",
                        help="run these test ids (relative to packages/python-sdk, e.g. "
                             "tests/sync/sandbox_sync/commands/test_run.py::test_run); repeatable")
    parser.add_argument("--subset-file", type=Path, help="a file of test ids, one a line")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist workers (default 1; each boots VMs)")
    parser.add_argument("--timeout", type=float, default=180,
                        help="seconds per test (the suite's own is 30 s, for E2B's cloud; tests with their own "
                             "timeout mark keep it); default 180")
    parser.add_argument("--json", type=Path, help="write everything here as JSON")
    parser.add_argument("--work", type=Path, help="work folder (default: a new one under /tmp, kept)")
    parser.add_argument("--venv", type=Path, help=f"the suite's virtualenv (default ~/.cache/boxd-test/e2b-suite-{E2B_VERSION}/venv)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="more environment for the suite")
    parser.add_argument("--run-na", action="store_true", help="run the not-applicable tests too")
    parser.add_argument("--strict", action="store_true", help="failures of template, volume and secret tests count too")
    parser.add_argument("--list-na", action="store_true", help="print the not-applicable list and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    if args.list_na:
        for entry in NOT_APPLICABLE + WITHOUT_KEY_VALIDATION:
            console.print(f"{entry.pattern}\n    {entry.reason}", soft_wrap=True)
        return 0

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import image_home
    from daemon_process import running_daemon

    started = time.time()
    work = (args.work or Path(tempfile.mkdtemp(prefix="boxd-e2b-suite-", dir="/tmp"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    plugin_dir = work / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    shutil.copy(PLUGIN, plugin_dir / f"{PLUGIN_MODULE}.py")

    console.print(f"exporting {SDK_DIR} of {args.suite_repo} at {args.commit[:12]} into {work}/suite")
    shutil.rmtree(work / "suite", ignore_errors=True)
    sdk = export_suite(args.suite_repo, args.commit, work)
    python, versions = suite_python(sdk, (args.venv or image_home() / f"e2b-suite-{E2B_VERSION}" / "venv").resolve())
    pytest_bin = python.parent / "pytest"
    console.print("suite virtualenv: " + ", ".join(f"{k} {v}" for k, v in versions.items()))

    subset = list(args.subset)
    if args.subset_file:
        subset += [line.strip() for line in args.subset_file.read_text().splitlines()
                   if line.strip() and not line.startswith("#")]
    flavours = list(FLAVOURS) if args.flavor == "both" else [args.flavor]
    selection = subset or selection_paths(sdk, args.area, flavours)
    if not selection:
        raise SystemExit("nothing selected")
    collected = collect(pytest_bin, sdk, selection, args, plugin_dir, work)
    if not collected:
        raise SystemExit("the selection holds no test")

    results = {nodeid: Result(nodeid, *area_of(nodeid), fixtures=fixtures) for nodeid, fixtures in collected.items()}
    deselect: list[str] = []

    def mark_not_applicable(entries: tuple[NotApplicable, ...]) -> None:
        if args.run_na:
            return
        for nodeid, result in results.items():
            entry = not_applicable_reason(nodeid, entries)
            if entry is not None and result.outcome != "n/a":
                result.outcome, result.reason = "n/a", entry.reason
                result.kind = "not in boxd" if result.area in NOT_IN_BOXD else "client" if entry.client else "daemon"
                deselect.append(nodeid)

    mark_not_applicable(NOT_APPLICABLE)
    to_run = len(collected) - len(deselect)
    stale = [e.pattern for e in NOT_APPLICABLE
             if args.area == [] and not subset and not args.k and args.flavor == "both"
             and not any(not_applicable_reason(n) is e for n in collected)]
    for pattern in stale:
        console.print(f"[yellow]NOT_APPLICABLE entry matches no test:[/] {pattern}")
    console.print(f"{len(collected)} tests selected: {to_run} to run, {len(deselect)} not applicable")

    meta = {
        "e2b_version": E2B_VERSION, "suite_commit": args.commit, "suite_repo": args.suite_repo,
        "versions": versions, "selection": selection, "k": args.k, "workers": args.workers,
        "timeout_s": args.timeout, "work": str(work), "started": started,
    }
    report = work / "results.jsonl"
    report.unlink(missing_ok=True)
    interrupted = None
    pytest_exit = None
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if to_run:
            from boxd.guest.image import ImageRecipe, ensure_image

            ensure_image(ImageRecipe(), home=image_home())
            with running_daemon("boxd-e2b-suite-") as daemon:
                try:
                    url = f"{daemon.url}/e2b"
                    key, key_env, key_note = key_for_sdk(daemon.url, daemon.local_key())
                    console.print(f"daemon {daemon.url} (BOXD_HOME {daemon.home}); {key_note}")
                    if key_env.get("E2B_VALIDATE_API_KEY") == "false":
                        mark_not_applicable(WITHOUT_KEY_VALIDATION)
                    meta.update(daemon_url=daemon.url, key=key_note)
                    env = pytest_env(args, plugin_dir, {
                        **key_env, "E2B_API_KEY": key, "E2B_API_URL": url, "E2B_SANDBOX_URL": url,
                        "BOXD_E2B_SUITE_PORT": str(daemon.port), "BOXD_E2B_SUITE_REPORT": str(report),
                    })
                    argv = [pytest_bin, *selection, "-p", "no:cacheprovider", "-p", PLUGIN_MODULE,
                            "-n", str(max(1, args.workers)), "--max-worker-restart", "1000",
                            "--timeout", f"{args.timeout:g}", "--timeout-method", "thread",
                            "--junitxml", work / "junit.xml", "-q", "-rfE", "--tb=short", "--no-header"]
                    if args.k:
                        argv += ["-k", args.k]
                    for nodeid in deselect:
                        argv += ["--deselect", nodeid]
                    (work / "pytest-argv.json").write_text(json.dumps([str(a) for a in argv]))
                    pytest_exit = run_pytest(argv, sdk, env, work, results, len(collected) - len(deselect), args,
                                             console)
                except (KeyboardInterrupt, Interrupted) as stop:
                    interrupted = str(stop) or "SIGINT"
                finally:
                    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                        signal.signal(s, _still_cleaning)
                    console.print("stopping the daemon and deleting its VMs")
                    for log in daemon.home.glob("*.log"):  # daemon.log, before the home goes
                        with contextlib.suppress(OSError):
                            shutil.copy(log, work / log.name)
    except (KeyboardInterrupt, Interrupted) as stop:
        interrupted = str(stop) or "SIGINT"
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s, handler in previous.items():
            signal.signal(s, handler)

    phases = Phases(report)
    phases.read()
    for nodeid, seen in phases.seen.items():
        update_result(results, nodeid, seen, args.timeout)
    everything = sorted(results.values(), key=lambda r: r.nodeid)
    for r in everything:
        classify(r)
    rows = table_rows(everything)
    meta.update(duration_s=round(time.time() - started, 1), pytest_exit=pytest_exit, interrupted=interrupted)
    print_report(console, everything, rows, meta, args.strict)
    failures = [r for r in everything if counts_as_failure(r, args.strict)]
    if args.json:
        args.json.write_text(json.dumps({
            "meta": meta, "table": rows,
            "failing": [{"nodeid": r.nodeid, "outcome": r.outcome, "kind": r.kind, "reason": r.reason} for r in everything
                        if r.outcome in ("failed", "error")],
            "not_applicable": [{"pattern": e.pattern, "reason": e.reason, "client": e.client}
                               for e in NOT_APPLICABLE + WITHOUT_KEY_VALIDATION],
            "tests": [r.__dict__ for r in everything],
        }, indent=1))
        console.print(f"JSON: {args.json}")
    if interrupted:
        console.print(f"[yellow]interrupted ({interrupted})[/]")
        return 130
    if pytest_exit not in (None, 0, 1, 5):
        console.print(f"[red]pytest exited {pytest_exit}[/] (see {work}/pytest.log)")
        return 2
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit as stop:
        if isinstance(stop.code, str):  # the run could not be made
            print(f"e2b-suite: {stop.code}", file=sys.stderr)
            sys.exit(2)
        raise
    except Exception:
        import traceback

        traceback.print_exc()
        sys.exit(2)
