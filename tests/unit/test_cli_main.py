"""The ``boxd`` command against a real daemon (FakeRuntime) on a temporary BOXD_HOME."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from fakes import FakeRuntime, daemon_thread, short_home

from boxd.cli.main import cli

home_dir = pytest.fixture(short_home)


@pytest.fixture
def boxd(home_dir, monkeypatch):
    """Runs ``boxd ARGS...`` against the daemon of a temp home, as a user would."""
    monkeypatch.setenv("BOXD_HOME", str(home_dir))
    monkeypatch.delenv("BOXD_URL", raising=False)
    monkeypatch.delenv("BOXD_API_KEY", raising=False)
    runner = CliRunner()
    runtime = FakeRuntime()
    with daemon_thread(home_dir, runtime) as daemon:

        def run(*args: str, env: dict[str, str] | None = None, input: bytes | None = None):
            return runner.invoke(cli, list(args), env=env, input=input, catch_exceptions=False)

        run.daemon, run.runtime = daemon, runtime
        yield run


def test_machine_lifecycle(boxd, tmp_path):
    created = boxd("machine", "new", "rl-base", "--memory", "256")
    assert created.exit_code == 0, created.output
    assert "rl-base" in created.stdout and "running" in created.stdout and "256 MiB" in created.stdout

    listed = boxd("machine", "list")
    assert "rl-base" in listed.stdout and "NAME" in listed.stdout
    assert "running" in boxd("machine", "get", "rl-base").stdout

    shell = boxd("machine", "exec", "rl-base", "--", "echo out; echo err >&2; exit 3")
    assert shell.exit_code == 3
    assert shell.stdout == "out\n" and shell.stderr == "err\n"
    argv = boxd("machine", "exec", "rl-base", "--", "printf", "%s|", "a b", "$HOME")
    assert argv.exit_code == 0 and argv.stdout == "a b|$HOME|"
    no_separator = boxd("machine", "exec", "--env", "GREETING=hi", "rl-base", "sh", "-c", "echo $GREETING")
    assert no_separator.stdout == "hi\n"
    piped = boxd("machine", "exec", "--stdin", "rl-base", "--", "cat", input=b"fed in")
    assert piped.stdout == "fed in"

    local = tmp_path / "rollout.py"
    local.write_text("print('hi')\n")
    up = boxd("machine", "files", "upload", "rl-base", str(local), "/home/boxd/rollout.py")
    assert up.exit_code == 0 and "12 bytes" in up.stderr
    back = tmp_path / "back.py"
    down = boxd("machine", "files", "download", "rl-base", "/home/boxd/rollout.py", str(back))
    assert down.exit_code == 0 and back.read_text() == "print('hi')\n"

    deleted = boxd("machine", "delete", "rl-base")
    assert deleted.exit_code == 0 and "deleted rl-base" in deleted.stderr
    assert "rl-base" not in boxd("machine", "list").stdout


def test_errors_are_one_line_and_exit_non_zero(boxd):
    missing = boxd("machine", "get", "nope")
    assert missing.exit_code == 1
    assert missing.stderr == "error: no machine named or with id nope\n"
    bad_name = boxd("machine", "new", "Bad_Name")
    assert bad_name.exit_code == 1 and bad_name.stderr.startswith("error: name: ")
    usage = boxd("machine", "new")
    assert usage.exit_code == 2 and usage.stderr.startswith("error: Missing argument")
    assert len(usage.stderr.strip().splitlines()) == 1
    assert boxd("machine", "frobnicate").exit_code == 2
    bad_env = boxd("machine", "exec", "--env", "NOEQUALS", "x", "--", "true")
    assert bad_env.exit_code == 2


def test_keys_and_accounts(boxd):
    account = boxd("accounts", "set", "team", "--max-machines", "1")
    assert account.exit_code == 0 and "team" in account.stdout
    created = boxd("keys", "create", "--account", "team", "--name", "ci")
    assert created.exit_code == 0
    key = created.stdout.strip()
    assert key.startswith("boxd_") and "shown only now" in created.stderr
    key_id = key[5:17]
    assert key_id in boxd("keys", "list").stdout

    as_team = {"BOXD_API_KEY": key}
    assert boxd("machine", "new", "only", env=as_team).exit_code == 0
    over = boxd("machine", "new", "second", env=as_team)
    assert over.exit_code == 1 and "at most 1" in over.stderr
    # The local account does not see the team's machine.
    assert "only" not in boxd("machine", "list").stdout

    assert boxd("keys", "revoke", key_id).exit_code == 0
    revoked = boxd("machine", "list", env=as_team)
    assert revoked.exit_code == 1 and "revoked" in revoked.stderr
    assert boxd("keys", "create", "--account", "nobody").exit_code == 1


def test_admin_commands_use_the_local_socket_even_when_boxd_url_is_set(boxd):
    remote = {"BOXD_URL": f"http://127.0.0.1:{boxd.daemon.port}"}
    assert boxd("keys", "list", env=remote).exit_code == 0
    # Machine commands follow BOXD_URL, where a key is needed.
    listed = boxd("machine", "list", env=remote)
    assert listed.exit_code == 1 and "missing API key" in listed.stderr


def test_help_lists_the_command_groups(boxd):
    result = boxd("--help")
    for group in ("machine", "snapshots", "keys", "accounts", "serve"):
        assert group in result.stdout


def test_a_lazy_command_group_appears_only_when_its_module_exists(monkeypatch, tmp_path):
    from boxd.cli import main

    (tmp_path / "stand_in_image_cmd.py").write_text(
        "import click\n\n@click.group()\ndef image():\n    'Guest images.'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    runner = CliRunner()

    def commands() -> list[str]:
        listing = runner.invoke(cli, ["--help"]).stdout.split("Commands:")[1]
        return [line.split()[0] for line in listing.strip().splitlines()]

    monkeypatch.setitem(main._LAZY_COMMANDS, "image", "stand_in_image_cmd")
    assert "image" in commands()
    assert runner.invoke(cli, ["image", "--help"]).exit_code == 0
    monkeypatch.setitem(main._LAZY_COMMANDS, "image", "absent_image_cmd")
    assert "image" not in commands()


def test_checkpoint_restore_asks_first(boxd, tmp_path):
    state = tmp_path / "state"

    def upload(text: str) -> None:
        state.write_text(text)
        assert boxd("machine", "files", "upload", "rl-base", str(state), "/state").exit_code == 0

    def current() -> str:
        back = tmp_path / "back"
        assert boxd("machine", "files", "download", "rl-base", "/state", str(back)).exit_code == 0
        return back.read_text()

    assert boxd("machine", "new", "rl-base").exit_code == 0
    upload("warm")
    saved = boxd("machine", "checkpoint", "save", "rl-base", "warm")
    assert saved.exit_code == 0 and "saved checkpoint warm of rl-base" in saved.stderr
    listed = boxd("machine", "checkpoint", "list", "rl-base")
    assert "warm" in listed.stdout and "PAUSE" in listed.stdout
    upload("played")

    declined = boxd("machine", "checkpoint", "restore", "rl-base", "warm", input=b"n\n")
    assert declined.exit_code == 1
    assert "Rewind rl-base to checkpoint warm?" in declined.stderr
    assert "error: rl-base not restored" in declined.stderr
    assert current() == "played"

    confirmed = boxd("machine", "checkpoint", "restore", "rl-base", "warm", input=b"y\n")
    assert confirmed.exit_code == 0 and "running" in confirmed.stdout
    assert current() == "warm"
    upload("played again")
    without_asking = boxd("machine", "checkpoint", "restore", "rl-base", "warm", "-y")
    assert without_asking.exit_code == 0 and "Rewind" not in without_asking.stderr
    assert current() == "warm"

    assert boxd("machine", "checkpoint", "delete", "rl-base", "warm").exit_code == 0
    assert "warm" not in boxd("machine", "checkpoint", "list", "rl-base").stdout
    missing = boxd("machine", "checkpoint", "restore", "rl-base", "warm", "-y")
    assert missing.exit_code == 1 and "no checkpoint named warm" in missing.stderr


def test_snapshots_save_list_get_and_new_from_one(boxd, tmp_path):
    state = tmp_path / "state"
    state.write_text("warm")
    assert boxd("machine", "new", "source", "--memory", "256").exit_code == 0
    assert boxd("machine", "files", "upload", "source", str(state), "/state").exit_code == 0

    saved = boxd("snapshots", "save", "source", "base")
    assert saved.exit_code == 0, saved.output
    (digest,) = re.findall(r"\b[0-9a-f]{64}\b", boxd("snapshots", "get", "base").stdout)
    # The machine's files: /state, and the key the daemon handed it.
    files = boxd.runtime.host.snapshots[digest].files
    assert files["/state"] == b"warm"
    size = sum(len(data) for data in files.values())
    assert "base@1" in saved.stdout and digest[:12] in saved.stdout and f"{size} B" in saved.stdout
    assert digest not in saved.stdout  # shown short

    listed = boxd("snapshots", "list")
    assert "base@1" in listed.stdout and "ready" in listed.stdout and digest[:12] in listed.stdout

    assert boxd("machine", "delete", "source").exit_code == 0
    clone = boxd("machine", "new", "clone", "--from-snapshot", "base")
    assert clone.exit_code == 0 and "256 MiB" in clone.stdout and "running" in clone.stdout
    back = tmp_path / "back"
    assert boxd("machine", "files", "download", "clone", "/state", str(back)).exit_code == 0
    assert back.read_text() == "warm"

    deleted = boxd("snapshots", "delete", "base")
    assert deleted.exit_code == 0 and "deleted base@1" in deleted.stderr
    assert "base@1" not in boxd("snapshots", "list").stdout
    unknown = boxd("machine", "new", "other", "--from-snapshot", "base")
    assert unknown.exit_code == 1 and unknown.stderr == "error: no snapshot base\n"


def test_idle_settings_url_and_explicit_suspend_hibernate_resume(boxd):
    created = boxd("machine", "new", "web", "--no-idle", "--http-port", "3000", "--public")
    assert created.exit_code == 0, created.output
    url = f"http://web.localhost:{boxd.daemon.port}/"
    assert url in created.stdout and "3000" in created.stdout
    assert re.search(r"public\s+yes", created.stdout)
    assert re.search(r"suspend after idle\s+never", created.stdout)
    assert re.search(r"hibernate after suspend\s+never", created.stdout)

    assert boxd("machine", "new", "quiet", "--suspend-after", "30", "--hibernate-after", "600").exit_code == 0
    quiet = boxd("machine", "get", "quiet").stdout
    assert re.search(r"suspend after idle\s+30 s", quiet) and re.search(r"hibernate after suspend\s+600 s", quiet)
    assert re.search(r"public\s+no", quiet)

    suspended = boxd("machine", "suspend", "web")
    assert suspended.exit_code == 0 and "paused (suspended)" in suspended.stdout
    listed = boxd("machine", "list").stdout  # piped: whole lines, one a machine
    assert re.search(r"web\s+m-[0-9a-f]{12}\s+paused \(suspended\).*" + re.escape(url), listed)
    hibernated = boxd("machine", "hibernate", "web")
    assert hibernated.exit_code == 0 and "stopped (hibernated)" in hibernated.stdout
    assert "stopped (hibernated)" in boxd("machine", "list").stdout
    assert "stopped (hibernated)" in boxd("machine", "get", "web").stdout  # looking does not wake it

    resumed = boxd("machine", "resume", "web")
    assert resumed.exit_code == 0 and re.search(r"state\s+running", resumed.stdout)
    boxd("machine", "suspend", "web")
    woken = boxd("machine", "exec", "web", "--", "echo woken")
    assert woken.exit_code == 0 and woken.stdout == "woken\n"
    assert re.search(r"state\s+running", boxd("machine", "get", "web").stdout)


def test_idle_options_are_checked(boxd):
    both = boxd("machine", "new", "web", "--no-idle", "--suspend-after", "5")
    assert both.exit_code == 2 and "--no-idle" in both.stderr
    negative = boxd("machine", "new", "web", "--hibernate-after", "-1")
    assert negative.exit_code == 1 and "hibernate_after_s" in negative.stderr
    assert boxd("machine", "suspend", "nope").stderr == "error: no machine named or with id nope\n"
    assert "web" not in boxd("machine", "list").stdout
