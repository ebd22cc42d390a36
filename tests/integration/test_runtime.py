"""Real machines under the runtime: boot, commands, files, timeouts, and a clean delete."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from boxd.errors import HostError, ImageError, NotFound, Timeout, VMError
from boxd.runtime.interface import ExecRequest, VMSpec
from boxd.runtime.qemu import process_alive

pytestmark = pytest.mark.vm


async def run_command(runtime, vm_id, **request):
    events = [event async for event in runtime.exec(vm_id, ExecRequest(**request))]
    stdout = b"".join(e.data for e in events if e.kind == "stdout")
    stderr = b"".join(e.data for e in events if e.kind == "stderr")
    return stdout, stderr, events[-1]


def test_boot_then_commands_files_stdin_timeout_and_bytes(machines, runtime):
    vm = machines.new()

    stdout, _, end = machines.run(run_command(runtime, vm, shell="uname -r"))
    assert end.exit_code == 0 and stdout.decode().strip().endswith("-amd64")

    stdout, _, end = machines.run(
        run_command(runtime, vm, argv=["python3", "-c", "import sys; print(sys.version_info[:2])"])
    )
    assert stdout.strip() == b"(3, 11)"

    stdout, _, _ = machines.run(run_command(runtime, vm, shell="id -un; pwd"))
    assert stdout.split() == [b"boxd", b"/home/boxd"]

    payload = os.urandom(50 * 1024 * 1024)

    async def chunks():
        for start in range(0, len(payload), 1 << 20):
            yield payload[start : start + (1 << 20)]

    async def round_trip():
        written = await runtime.write_file(vm, "/home/boxd/data/blob.bin", chunks(), mode=0o640)
        back = b"".join([chunk async for chunk in runtime.read_file(vm, "/home/boxd/data/blob.bin")])
        return written, back

    written, back = machines.run(round_trip())
    assert written == len(payload)
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(payload).hexdigest()
    stdout, _, _ = machines.run(run_command(runtime, vm, shell="sha256sum /home/boxd/data/blob.bin; stat -c %a:%U /home/boxd/data/blob.bin"))
    digest, _, owner = stdout.decode().split()
    assert digest == hashlib.sha256(payload).hexdigest() and owner == "640:boxd"

    stdout, _, end = machines.run(run_command(runtime, vm, argv=["wc", "-c"], stdin=b"z" * 12345))
    assert stdout.strip() == b"12345" and end.exit_code == 0

    stdout, _, end = machines.run(run_command(runtime, vm, shell="echo begun; sleep 60", timeout=2))
    assert end.timed_out and end.exit_code == 137 and stdout == b"begun\n"

    stdout, _, end = machines.run(run_command(runtime, vm, argv=["printf", r"\377\376\000\200ok"]))
    assert stdout == b"\xff\xfe\x00\x80ok"

    _, stderr, end = machines.run(run_command(runtime, vm, shell="no-such-command-here"))
    assert end.exit_code == 127 and b"not found" in stderr
    with pytest.raises(NotFound):
        machines.run(run_command(runtime, vm, argv=["no-such-command-here"]))


def processes_naming(path: Path) -> list[int]:
    """Live (not zombie) processes whose command line names ``path``."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and process_alive(int(p.name), str(path))]


def test_delete_leaves_no_process_socket_or_file(machines, runtime):
    vm = machines.new()
    info = machines.run(runtime.info(vm))
    run_dir = runtime.shm_dir / vm
    vm_dir = runtime.vms_dir / vm
    layers_before = {p.name for p in runtime.layers_dir.iterdir()}
    assert process_alive(info.pid, "qemu") and run_dir.exists() and vm_dir.exists()

    assert processes_naming(run_dir)  # QEMU and its network process

    machines.run(runtime.delete(vm))

    assert not process_alive(info.pid, "qemu") and not processes_naming(run_dir)
    assert not run_dir.exists() and not vm_dir.exists()
    assert not any(p.name.startswith(vm) for p in runtime.layers_dir.iterdir())
    assert {p.name for p in runtime.layers_dir.iterdir()} <= layers_before
    with pytest.raises(NotFound):
        machines.run(runtime.info(vm))


def test_a_killed_qemu_shows_failed_and_still_cleans_up(machines, runtime):
    vm = machines.new()
    info = machines.run(runtime.info(vm))
    os.kill(info.pid, 9)
    machines.run(asyncio.sleep(0.5))
    assert machines.run(runtime.info(vm)).state.value == "failed"
    machines.run(runtime.delete(vm))
    assert not (runtime.shm_dir / vm).exists()


def test_a_new_runtime_adopts_a_running_machine(machines, runtime, runtime_home, loop_thread):
    """What a daemon restart does: new connections to the same QEMU and agent."""
    from boxd.runtime.local import LocalRuntime

    vm = machines.new()
    machines.run(run_command(runtime, vm, shell="echo kept > /tmp/state"))

    async def from_a_fresh_runtime():
        # QEMU serves one agent connection at a time: let go of ours, as a dead daemon would.
        await runtime.close()
        fresh = LocalRuntime(runtime_home)
        try:
            await fresh.adopt(vm)
            await fresh.wait_ready(vm, timeout=30)
            return await run_command(fresh, vm, shell="cat /tmp/state")
        finally:
            await fresh.close()

    stdout, _, _ = machines.run(from_a_fresh_runtime())
    assert stdout == b"kept\n"
    # and the first runtime's connection still works after someone else used the socket
    stdout, _, _ = machines.run(run_command(runtime, vm, shell="echo still"))
    assert stdout == b"still\n"


def test_pip_installs_a_pure_python_package_inside(machines, runtime):
    vm = machines.new()
    stdout, stderr, end = machines.run(
        run_command(runtime, vm, shell="pip install --no-cache-dir six==1.16.0 2>&1; python3 -c 'import six; print(six.__version__)'", timeout=300)
    )
    text = stdout.decode(errors="replace")
    if "Could not find a version" in text or "NewConnectionError" in text or "Temporary failure in name resolution" in text:
        pytest.skip(f"the package registry is unreachable from the guest: {text[-300:]}")
    assert text.strip().endswith("1.16.0"), text[-800:]


def test_a_guest_that_never_answers_times_out_and_leaves_nothing(machines, runtime):
    vm = machines.new(ready=False)
    with pytest.raises(Timeout, match="not ready"):
        machines.run(runtime.wait_ready(vm, timeout=0.5))
    info = machines.run(runtime.info(vm))
    machines.run(runtime.delete(vm))
    assert not process_alive(info.pid, "qemu") and not (runtime.shm_dir / vm).exists()


def test_unknown_and_corrupt_images_are_refused_and_start_nothing(runtime, loop_thread, tmp_path, guest_image):
    before = set(runtime.vms_dir.iterdir())
    with pytest.raises(ImageError):
        loop_thread.run(runtime.create("img-unknown", VMSpec(image="0" * 64)))
    corrupt = tmp_path / guest_image.digest
    corrupt.mkdir()
    for item in guest_image.path.iterdir():
        if item.name != "rootfs.qcow2":
            (corrupt / item.name).write_bytes(item.read_bytes())
    (corrupt / "rootfs.qcow2").write_bytes(b"not a qcow2 image" * 100)
    with pytest.raises(ImageError):
        loop_thread.run(runtime.create("img-corrupt", VMSpec(image=str(corrupt))))
    assert set(runtime.vms_dir.iterdir()) == before
    assert not (runtime.shm_dir / "img-corrupt").exists()


def test_no_qemu_on_the_host_is_a_clear_error(runtime, loop_thread, guest_image, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(HostError, match="qemu-system-x86"):
        loop_thread.run(runtime.create("no-qemu", VMSpec(image=str(guest_image.path))))
    assert not (runtime.vms_dir / "no-qemu").exists()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


@needs_root
def test_no_room_for_guest_ram_is_a_clear_error(tmp_path, loop_thread, guest_image, monkeypatch):
    from boxd.runtime.local import LocalRuntime

    with small_tmpfs(tmp_path / "small-shm", "64m") as small:
        monkeypatch.setenv("BOXD_SHM", str(small))
        tight = LocalRuntime(tmp_path / "home")
        with pytest.raises(HostError, match="memory"):
            loop_thread.run(tight.create("too-big", VMSpec(image=str(guest_image.path), memory_mib=256)))
        assert not list((tmp_path / "home" / "vms").iterdir())


@needs_root
def test_no_room_for_disks_is_a_clear_error(tmp_path, loop_thread, guest_image):
    from boxd.runtime.local import LocalRuntime

    with small_tmpfs(tmp_path / "small-home", "100m") as home:
        tight = LocalRuntime(home)
        with pytest.raises(HostError, match="disk"):
            loop_thread.run(tight.create("no-disk", VMSpec(image=str(guest_image.path))))
        assert not list((home / "vms").iterdir()) and not list((home / "layers").iterdir())
        assert not (tight.shm_dir / "no-disk").exists()


def test_qemu_that_dies_while_booting_is_reported_with_its_console(machines, runtime):
    vm = machines.new(ready=False)
    os.kill(machines.run(runtime.info(vm)).pid, 9)
    with pytest.raises(VMError, match="exited while booting"):
        machines.run(runtime.wait_ready(vm, timeout=120))


# Every address at once, each answer on a line of its own: a dropped probe waits out its timeout.
PROBE = """
import socket, sys
from concurrent.futures import ThreadPoolExecutor
port = int(sys.argv[1])
def probe(host):
    try:
        connection = socket.create_connection((host, port), timeout=4)
        connection.settimeout(4)
        connection.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
        return connection.recv(4096).decode(errors="replace").replace("\\n", " ")
    except OSError as error:
        return "unreachable " + type(error).__name__
with ThreadPoolExecutor(8) as pool:
    for host, answer in zip(sys.argv[2:], pool.map(probe, sys.argv[2:])):
        print(host, answer)
"""


@pytest.fixture
def host_loopback_service():
    """An HTTP server on the host's 127.0.0.1 whose answer carries a secret."""
    import http.server
    import secrets
    import threading

    secret = secrets.token_hex(16)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(secret.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], secret
    server.shutdown()


def host_addresses() -> list[str]:
    output = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout
    return output.split()


def test_machines_never_reach_the_hosts_loopback_services(machines, runtime, host_loopback_service):
    port, secret = host_loopback_service
    default, isolated = machines.new_many({}, {"isolated": True})
    addresses = ["10.0.2.2", *host_addresses()]
    for vm in (default, isolated):
        stdout, _, _ = machines.run(run_command(runtime, vm, argv=["python3", "-c", PROBE, str(port), *addresses]))
        answers = stdout.decode().splitlines()
        assert [line.split()[0] for line in answers] == addresses, answers
        assert secret not in stdout.decode(), (vm, answers)
    # an isolated machine reaches nothing at all, not even a name server
    stdout, _, _ = machines.run(run_command(runtime, isolated, argv=["python3", "-c", PROBE, "80", "10.0.2.2"]))
    assert stdout.startswith(b"10.0.2.2 unreachable")
    stdout, _, _ = machines.run(run_command(runtime, isolated, shell="timeout 5 getent hosts pypi.org || echo no-dns"))
    assert stdout.strip() == b"no-dns"
