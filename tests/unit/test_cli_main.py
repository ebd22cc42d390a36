"""The ``boxd`` command against a real daemon (FakeRuntime) on a temporary BOXD_HOME."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from fakes import daemon_thread, short_home

from boxd.cli.main import cli

home_dir = pytest.fixture(short_home)


@pytest.fixture
def boxd(home_dir, monkeypatch):
    """Runs ``boxd ARGS...`` against the daemon of a temp home, as a user would."""
    monkeypatch.setenv("BOXD_HOME", str(home_dir))
    monkeypatch.delenv("BOXD_URL", raising=False)
    monkeypatch.delenv("BOXD_API_KEY", raising=False)
    runner = CliRunner()
    with daemon_thread(home_dir) as daemon:

        def run(*args: str, env: dict[str, str] | None = None, input: bytes | None = None):
            return runner.invoke(cli, list(args), env=env, input=input, catch_exceptions=False)

        run.daemon = daemon
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
    for group in ("machine", "keys", "accounts", "serve"):
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
