"""The whole control plane with real VMs: a ``boxd serve`` process, LocalRuntime, QEMU.

One daemon per module (``daemon_process``); a failed test prints the daemon's log.
"""

from __future__ import annotations

import importlib
import os
import tarfile
import time
from pathlib import Path

import httpx
import pytest
from daemon_process import print_log_if_failed, running_daemon

from boxd.daemon import socket_path
from boxd.errors import AuthError, NotFound, QuotaExceeded

pytestmark = pytest.mark.vm

ROLLOUT = """\
import argparse, random
parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int)
seed = parser.parse_args().seed
print(f"seed={seed} draw={random.Random(seed).random():.6f}")
"""


@pytest.fixture(scope="module")
def daemon(guest_image):
    with running_daemon("boxd-cp-") as process:
        yield process


@pytest.fixture(autouse=True)
def daemon_log_on_failure(request, daemon):
    yield
    print_log_if_failed(request, daemon)


def test_cli_and_the_seed_sdk_flow(daemon, tmp_path, monkeypatch):
    created = daemon.cli("machine", "new", "rl-base")
    assert "running" in created.stdout

    shell = daemon.cli("machine", "exec", "rl-base", "--", "echo $((6 * 7)); echo to-stderr >&2; exit 5", check=False)
    assert (shell.returncode, shell.stdout, shell.stderr) == (5, "42\n", "to-stderr\n")
    argv = daemon.cli("machine", "exec", "rl-base", "--", "id", "-un")
    assert argv.stdout == "boxd\n"

    # The seed's lines, as written, from a directory holding rollout.py.
    (tmp_path / "rollout.py").write_text(ROLLOUT)
    monkeypatch.chdir(tmp_path)
    boxd = daemon.sdk()
    boxd.machines.files.upload("rl-base", "/home/boxd/rollout.py", open("rollout.py").read())
    result = boxd.machines.exec("rl-base", "python3 /home/boxd/rollout.py --seed 42")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip().startswith("seed=42 draw=")
    again = boxd.machines.exec("rl-base", "python3 /home/boxd/rollout.py --seed 42")
    assert again.stdout == result.stdout
    assert boxd.machines.files.download("rl-base", "/home/boxd/rollout.py") == ROLLOUT.encode()

    payload = os.urandom(3 * 1024 * 1024)
    (tmp_path / "blob").write_bytes(payload)
    daemon.cli("machine", "files", "upload", "rl-base", str(tmp_path / "blob"), "/home/boxd/blob")
    daemon.cli("machine", "files", "download", "rl-base", "/home/boxd/blob", str(tmp_path / "back"))
    assert (tmp_path / "back").read_bytes() == payload

    streamed = [e.type for e in boxd.machines.exec_stream("rl-base", ["sh", "-c", "echo a; sleep 0.2; echo b"])]
    assert streamed[0] == "started" and streamed[-1] == "exit" and streamed.count("stdout") >= 1

    # The seed's rollout(): fork, wait, exec, delete; same seed, same output.
    def rollout(name: str, seed: int) -> str:
        fork = boxd.machines.fork("rl-base", name)
        assert fork.parent is not None and fork.name == name
        boxd.machines.wait_until_ready(fork.id)
        result = boxd.machines.exec(fork.id, f"python3 /home/boxd/rollout.py --seed {seed}")
        boxd.machines.delete(fork.id)
        return result.stdout.strip()

    assert rollout("check-a", 42) == rollout("check-b", 42) == result.stdout.strip()
    forked = daemon.cli("machine", "fork", "rl-base", "cli-fork")
    assert "running" in forked.stdout
    assert daemon.cli("machine", "exec", "cli-fork", "--", "cat /home/boxd/blob | wc -c").stdout.strip() == str(len(payload))
    daemon.cli("machine", "delete", "cli-fork")

    daemon.cli("machine", "delete", "rl-base")
    assert "rl-base" not in daemon.cli("machine", "list").stdout
    with pytest.raises(NotFound):
        boxd.machines.get("rl-base")
    boxd.close()


def test_accounts_keys_and_quota(daemon):
    daemon.cli("accounts", "set", "team", "--max-machines", "1")
    team_key = daemon.cli("keys", "create", "--account", "team", "--name", "test").stdout.strip()
    team = daemon.sdk(team_key)
    local = daemon.sdk()
    machine = team.machines.new("q1")
    try:
        with pytest.raises(QuotaExceeded) as over:
            team.machines.new("q2")
        assert "at most 1" in over.value.message and "1 are running" in over.value.message
        over_cli = daemon.cli("machine", "new", "q2", key=team_key, check=False)
        assert over_cli.returncode == 1 and over_cli.stderr.startswith("error: quota exceeded")

        # Another account sees none of it, by name or by id.
        for ref in ("q1", machine.id):
            with pytest.raises(NotFound):
                local.machines.get(ref)
        assert "q1" not in [m.name for m in local.machines.list()]
    finally:
        team.machines.delete(machine)

    no_key = httpx.get(f"{daemon.url}/v1/machines")
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "unauthorized"
    daemon.cli("keys", "revoke", team_key[5:17])
    with pytest.raises(AuthError):
        team.machines.list()
    revoked_cli = daemon.cli("machine", "list", key=team_key, check=False)
    assert revoked_cli.returncode == 1 and "revoked" in revoked_cli.stderr
    admin_over_tcp = httpx.get(f"{daemon.url}/v1/admin/keys")
    assert admin_over_tcp.status_code == 403
    team.close()
    local.close()


def test_a_killed_daemon_comes_back_to_its_running_machine(daemon):
    with daemon.sdk() as boxd:
        machine = boxd.machines.new("survivor")
        boxd.machines.wait_until_ready(machine, timeout=180)
        boxd.machines.exec(machine, "echo before > /home/boxd/mark")
    daemon.kill9()
    assert socket_path(daemon.home).exists()  # left behind: the next daemon replaces it

    daemon.start()
    with daemon.sdk() as boxd:
        assert boxd.machines.get("survivor").state.value == "running"
        result = boxd.machines.exec("survivor", "cat /home/boxd/mark")
        assert result.stdout == "before\n"
        assert "machine.adopted" in daemon.log()
        boxd.machines.delete("survivor")
    # The embedded CLI works against the restarted daemon too.
    assert daemon.cli("machine", "list").returncode == 0


def test_checkpoints_and_versioned_snapshots_through_the_cli_and_a_daemon_restart(daemon):
    daemon.cli("machine", "new", "baseline")
    daemon.cli("machine", "exec", "baseline", "--", "echo v1 > /home/boxd/env")
    machine_id = daemon.sdk().machines.get("baseline").id

    # a checkpoint rewinds in place: same machine, same id
    daemon.cli("machine", "checkpoint", "save", "baseline", "clean")
    daemon.cli("machine", "exec", "baseline", "--", "echo dirty > /home/boxd/env")
    declined = daemon.cli("machine", "checkpoint", "restore", "baseline", "clean", check=False, answer="n\n")
    assert declined.returncode != 0
    assert daemon.cli("machine", "exec", "baseline", "--", "cat /home/boxd/env").stdout == "dirty\n"
    daemon.cli("machine", "checkpoint", "restore", "baseline", "clean", "-y")
    assert daemon.cli("machine", "exec", "baseline", "--", "cat /home/boxd/env").stdout == "v1\n"
    assert "clean" in daemon.cli("machine", "checkpoint", "list", "baseline").stdout
    with daemon.sdk() as boxd:
        assert boxd.machines.get("baseline").id == machine_id

        # two versions of one name; neither overwrites the other
        first = boxd.snapshots.save("baseline", "env")
        boxd.machines.exec("baseline", "echo v2 > /home/boxd/env")
        second = boxd.snapshots.save("baseline", "env")
        assert (first.ref, second.ref) == ("env@1", "env@2")
        assert first.digest != second.digest and first.state.value == second.state.value == "ready"
        boxd.machines.delete("baseline")
    assert "env@2" in daemon.cli("snapshots", "list").stdout

    daemon.kill9()
    daemon.start()
    daemon.cli("machine", "new", "from-old", "--from-snapshot", "env@1")
    daemon.cli("machine", "new", "from-new", "--from-snapshot", "env")
    daemon.cli("machine", "new", "from-digest", "--from-snapshot", first.digest[:16])
    assert daemon.cli("machine", "exec", "from-old", "--", "cat /home/boxd/env").stdout == "v1\n"
    assert daemon.cli("machine", "exec", "from-new", "--", "cat /home/boxd/env").stdout == "v2\n"
    assert daemon.cli("machine", "exec", "from-digest", "--", "cat /home/boxd/env").stdout == "v1\n"
    for name in ("from-old", "from-new", "from-digest"):
        daemon.cli("machine", "delete", name)
    daemon.cli("snapshots", "delete", "env")
    assert "env@" not in daemon.cli("snapshots", "list").stdout
    assert not any((daemon.home / "snapshots").iterdir())


# The SDK and what it imports; a machine's image has python3 and nothing of ours.
SDK_PACKAGES = (
    "boxd", "pydantic", "pydantic_core", "annotated_types", "typing_extensions", "typing_inspection",
    "httpx", "httpcore", "h11", "anyio", "sniffio", "idna", "certifi",
)

INSIDE = """
from boxd import Boxd
boxd = Boxd()  # no URL, no key: inside a machine it finds both by itself
print(" ".join(sorted(m.name for m in boxd.machines.list())))
child = boxd.machines.fork("trainer", "from-inside")
boxd.machines.wait_until_ready(child, timeout=120)
print(child.name, boxd.machines.exec(child, "cat /home/boxd/mark").stdout.strip())
"""


def sdk_bundle(destination: Path) -> Path:
    """This host's copy of the SDK and its dependencies, as a tarball to unpack in a guest."""
    with tarfile.open(destination, "w:gz") as bundle:
        for name in SDK_PACKAGES:
            origin = Path(importlib.import_module(name).__file__)
            if origin.name == "__init__.py":
                bundle.add(origin.parent, arcname=name, filter=lambda m: None if "__pycache__" in m.name else m)
            else:
                bundle.add(origin, arcname=origin.name)
    return destination


def test_the_sdk_inside_a_machine_needs_no_key_and_its_key_dies_with_the_machine(daemon, tmp_path):
    with daemon.sdk() as boxd:
        boxd.machines.wait_until_ready(boxd.machines.new("trainer"), timeout=180)
        boxd.machines.files.upload("trainer", "/home/boxd/sdk.tgz", sdk_bundle(tmp_path / "sdk.tgz").read_bytes())
        boxd.machines.files.upload("trainer", "/home/boxd/inside.py", INSIDE)
        boxd.machines.exec("trainer", "mkdir -p /home/boxd/sdk && tar -xzf /home/boxd/sdk.tgz -C /home/boxd/sdk")
        boxd.machines.exec("trainer", "echo inherited > /home/boxd/mark")

        result = boxd.machines.exec("trainer", "PYTHONPATH=/home/boxd/sdk python3 /home/boxd/inside.py", timeout=300)
        assert result.exit_code == 0, result.stderr
        listed, forked = result.stdout.strip().splitlines()
        assert "trainer" in listed.split()
        assert forked == "from-inside inherited"
        assert boxd.machines.get("from-inside").parent == boxd.machines.get("trainer").id

        # the fork got a key of its own; the trainer's is revoked with the trainer
        trainer_key = boxd.machines.exec("trainer", "cat /etc/boxd/api-key").stdout.strip()
        fork_key = boxd.machines.exec("from-inside", "cat /etc/boxd/api-key").stdout.strip()
        assert trainer_key.startswith("boxd_") and fork_key.startswith("boxd_") and trainer_key != fork_key
        with daemon.sdk(trainer_key) as as_trainer:
            assert "trainer" in [m.name for m in as_trainer.machines.list()]
        boxd.machines.delete("trainer")
        with daemon.sdk(trainer_key) as as_trainer, pytest.raises(AuthError):
            as_trainer.machines.list()
        boxd.machines.delete("from-inside")


def test_a_machine_url_and_its_sleep_states_through_the_daemon(daemon):
    daemon.cli("machine", "new", "web")
    daemon.cli(
        "machine", "exec", "web", "--",
        "cd /home/boxd && echo hi > index.txt && (nohup python3 -m http.server 8080 >/dev/null 2>&1 &)",
    )
    key = daemon.local_key()

    def visit(with_key: bool = True) -> httpx.Response:
        headers = {"host": f"web.localhost:{daemon.port}"}
        if with_key:
            headers["authorization"] = f"Bearer {key}"
        return httpx.get(f"{daemon.url}/index.txt", headers=headers, timeout=120)

    deadline = time.monotonic() + 60
    while visit().status_code != 200:  # the server in the guest is still starting
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert visit().text == "hi\n"
    assert visit(with_key=False).status_code == 401
    with daemon.sdk() as boxd:
        assert boxd.machines.get("web").url == f"http://web.localhost:{daemon.port}/"

        boxd.machines.suspend("web")
        assert boxd.machines.get("web").state.value == "paused"
        assert visit().text == "hi\n"  # the request woke it
        assert boxd.machines.get("web").state.value == "running"

        boxd.machines.hibernate("web")
        assert "stopped" in daemon.cli("machine", "list").stdout
        assert boxd.machines.exec("web", "cat /home/boxd/index.txt").stdout == "hi\n"  # woke again
        assert visit().text == "hi\n"  # and its server with it, same process
        boxd.machines.delete("web")
