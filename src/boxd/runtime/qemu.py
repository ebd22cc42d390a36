"""One QEMU process: its command line, its launch, its QMP monitor and its end.

A process is described by a ``Launch``: everything that must be the same on a source and
on a machine that receives its state (devices, memory size, kernel) plus what is its own
(sockets, disk, RAM file). Forks and restores start QEMU from the same description.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient, QMPError

from boxd.errors import HostError, VMError, VMLaunchFailure
from boxd.runtime.accel import Accelerator

log = logging.getLogger(__name__)

QEMU_BINARY = "qemu-system-x86_64"
AGENT_PORT = "org.boxd.agent"
# Guests use QEMU's user-mode network; every machine has its own NAT, so all of them can
# share one address and MAC, which is what lets a fork keep its network configuration.
GUEST_MAC = "52:54:00:12:34:56"
KERNEL_CMDLINE = "console=ttyS0 panic=-1 quiet"
# Device state only loads into the machine type it was saved from; snapshots record it.
MACHINE_TYPE = "q35"


def qemu_binary() -> str:
    """The QEMU on PATH, or the one ``BOXD_QEMU`` names (another version beside it, for a bench)."""
    path = shutil.which(os.environ.get("BOXD_QEMU") or QEMU_BINARY)
    if path is None:
        raise HostError(
            f"{os.environ.get('BOXD_QEMU') or QEMU_BINARY} not found: install the Debian package qemu-system-x86 "
            "(apt-get install qemu-system-x86 qemu-utils)"
        )
    return path


@functools.cache
def _version_of(binary: str) -> str:
    output = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return output.splitlines()[0].strip()


def qemu_version() -> str:
    """The QEMU that runs machines here, as ``qemu-system-x86_64 --version`` says (cached)."""
    return _version_of(qemu_binary())


def qemu_release() -> tuple[int, int]:
    """(major, minor) of the QEMU that runs machines here."""
    found = re.search(r"version (\d+)\.(\d+)", qemu_version())
    if found is None:
        raise HostError(f"QEMU's version is not readable: {qemu_version()!r}")
    return int(found.group(1)), int(found.group(2))


def _firmware_args(binary: str) -> list[str]:
    """A QEMU unpacked outside /usr (side by side with the system's) finds its firmware beside it."""
    data = Path(binary).resolve().parent.parent / "share" / "qemu"
    return ["-L", str(data)] if data.is_dir() and not str(data).startswith("/usr/share") else []


@dataclass(frozen=True)
class Launch:
    """Everything QEMU's command line is made from."""

    name: str
    run_dir: Path  # sockets and pidfile (short paths: unix sockets are limited to 107 bytes)
    ram_file: Path
    ram_shared: bool  # share=on for a machine that owns its RAM; off to map a capture copy-on-write
    disk: Path  # top qcow2 of the machine's disk chain
    kernel: Path
    initrd: Path
    console_log: Path
    accelerator: Accelerator
    vcpus: int
    memory_mib: int
    isolated: bool
    incoming: bool = False  # wait for a migration stream instead of booting
    # The network card's backend goes nowhere: for a capture's template, whose guest
    # never runs. A backend is not part of the device state (slirp's is, so an isolated
    # machine's template keeps slirp).
    unplugged: bool = False
    forward: tuple[int, int] | None = None  # (port on the host's 127.0.0.1, port in the guest)

    @property
    def needs_network_process(self) -> bool:
        return not (self.isolated or self.unplugged)

    @property
    def qmp_socket(self) -> Path:
        return self.run_dir / "qmp.sock"

    @property
    def agent_socket(self) -> Path:
        return self.run_dir / "agent.sock"

    @property
    def net_socket(self) -> Path:
        return self.run_dir / "net.sock"

    @property
    def pidfile(self) -> Path:
        return self.run_dir / "qemu.pid"

    @property
    def stderr_log(self) -> Path:
        return self.run_dir / "qemu.stderr"

    def argv(self) -> list[str]:
        if self.isolated:
            # slirp with restrict=on: the guest reaches nothing outside itself, not even the host.
            netdev = "user,id=net0,restrict=on"
            if self.forward:
                # restrict=on still lets a forward from the host in.
                netdev += f",hostfwd=tcp:127.0.0.1:{self.forward[0]}-:{self.forward[1]}"
        elif self.unplugged:
            netdev = "hubport,id=net0,hubid=0"
        else:
            # The machine's own passt process (see boxd.runtime.network).
            netdev = f"stream,id=net0,server=off,addr.type=unix,addr.path={self.net_socket}"
        binary = qemu_binary()
        args = [
            binary,
            *_firmware_args(binary),
            "-name", f"boxd-{self.name}",
            "-nodefaults", "-no-user-config", "-display", "none",
            "-daemonize", "-pidfile", str(self.pidfile),
            "-machine", f"{MACHINE_TYPE},memory-backend=mem",
            *self.accelerator.qemu_args(),
            "-smp", str(self.vcpus),
            "-m", f"{self.memory_mib}M",
            "-object",
            f"memory-backend-file,id=mem,size={self.memory_mib}M,mem-path={self.ram_file},"
            f"share={'on' if self.ram_shared else 'off'}",
            "-kernel", str(self.kernel), "-initrd", str(self.initrd), "-append", KERNEL_CMDLINE,
            "-blockdev", f"driver=file,node-name=rootfile,filename={self.disk}",
            "-blockdev", "driver=qcow2,node-name=root,file=rootfile",
            "-device", "virtio-blk-pci,id=rootdisk,drive=root",
            "-chardev", f"socket,id=qmp,path={self.qmp_socket},server=on,wait=off",
            "-mon", "chardev=qmp,mode=control",
            "-device", "virtio-serial-pci,id=vser",
            "-chardev", f"socket,id=agent,path={self.agent_socket},server=on,wait=off",
            "-device", f"virtserialport,bus=vser.0,chardev=agent,name={AGENT_PORT}",
            "-netdev", netdev,
            "-device", f"virtio-net-pci,netdev=net0,mac={GUEST_MAC}",
            "-device", "virtio-rng-pci",
            # A new generation id on every start: the guest kernel reseeds its RNG when a
            # restored or forked machine resumes, so forks never share random numbers.
            "-device", f"vmgenid,id=vmgenid0,guid={uuid.uuid4()}",
            "-chardev", f"file,id=console,path={self.console_log}",
            "-serial", "chardev:console",
            "-no-reboot",
        ]
        # SeaBIOS, not qboot: qboot is faster but never boots with a vmgenid device.
        if self.incoming:
            # -S: stay paused after the state arrives, so the clock and identity can be
            # set before the guest runs a single instruction.
            args += ["-S", "-incoming", "defer"]
        return args


def read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def process_alive(pid: int | None, marker: str) -> bool:
    """True when ``pid`` runs and is ours (its command line names ``marker``), not a zombie."""
    if pid is None:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return status != "Z" and marker.encode() in cmdline


async def start_qemu(launch: Launch) -> int:
    """Start QEMU detached from us (it outlives the daemon); returns its pid.

    ``-daemonize`` makes the launching process exit only once QEMU has initialised, so a
    bad command line or a missing file is reported here, with QEMU's own words.
    """
    launch.run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (launch.qmp_socket, launch.agent_socket, launch.pidfile):
        stale.unlink(missing_ok=True)
    argv = launch.argv()
    with open(launch.stderr_log, "wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
            start_new_session=True,
        )
        code = await process.wait()
    output = launch.stderr_log.read_text(errors="replace")
    pid = read_pid(launch.pidfile)
    if code != 0 or pid is None:
        raise VMLaunchFailure(
            f"QEMU would not start machine {launch.name}: {output.strip()[-400:] or f'exit code {code}'}",
            exitcode=code,
            command=argv,
            output=output,
        )
    return pid


class Monitor:
    """A QMP connection to one QEMU, through qemu.qmp."""

    def __init__(self, socket_path: Path, name: str) -> None:
        self.socket_path = socket_path
        self.name = name
        self.client = QMPClient(name)

    async def connect(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self.client.connect(str(self.socket_path))
                return
            except (QMPError, OSError) as error:
                if time.monotonic() >= deadline:
                    raise VMError(f"machine {self.name}: QMP did not answer: {error}") from None
                self.client = QMPClient(self.name)
                await asyncio.sleep(0.01)

    @property
    def connected(self) -> bool:
        return self.client.runstate.name == "RUNNING"

    async def execute(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        try:
            return await self.client.execute(command, arguments)
        except QMPError as error:
            raise VMError(f"machine {self.name}: QMP {command} failed: {error}") from error

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.disconnect()


async def wait_gone(pid: int, marker: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while process_alive(pid, marker):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def stop_process(pid: int | None, marker: str) -> None:
    """End a process of ours (QEMU, passt) for good: SIGTERM, then SIGKILL if it lingers."""
    if not process_alive(pid, marker):
        return
    assert pid is not None
    for signum, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
        if await wait_gone(pid, marker, grace):
            return
    raise VMError(f"process {pid} did not exit after SIGKILL")


def fault_in_mapping(pid: int, path: Path, chunk: int = 1 << 20) -> None:
    """Make process ``pid`` map every page of its mapping of ``path``, by reading it
    through ``/proc/PID/mem`` (which faults the pages into that process, not ours)."""
    with open(f"/proc/{pid}/maps") as maps:
        ranges = [
            tuple(int(bound, 16) for bound in line.split()[0].split("-"))
            for line in maps
            if line.rstrip().endswith(" " + str(path))
        ]
    buffer = bytearray(chunk)
    descriptor = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        for start, end in ranges:
            for offset in range(start, end, chunk):
                os.preadv(descriptor, [memoryview(buffer)[: min(chunk, end - offset)]], offset)
    finally:
        os.close(descriptor)


def free_port(ports: range | None = None) -> int:
    """A TCP port that nothing listens on now: any the system gives, or one of ``ports``."""
    for port in ports or (0,):
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0" if ports else "127.0.0.1", port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise HostError(f"ports: none free in {ports.start}-{ports.stop - 1}", field="ports")


async def run_tool(*argv: str) -> str:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    output, _ = await process.communicate()
    text = output.decode(errors="replace")
    if process.returncode != 0:
        raise VMError(f"{argv[0]} failed: {text.strip()[-400:]}")
    return text


async def create_overlay(path: Path, backing: Path, size_gib: int | None = None) -> None:
    """A new qcow2 whose unwritten blocks read from ``backing``."""
    if shutil.which("qemu-img") is None:
        raise HostError("qemu-img not found: install the Debian package qemu-utils")
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", "qcow2", str(path)]
    if size_gib is not None:
        argv.append(f"{size_gib}G")
    await run_tool(*argv)


async def wait_migration(monitor: Monitor, until: set[str], timeout: float = 120.0) -> dict[str, Any]:
    """Poll ``query-migrate`` until its status is one of ``until``; a failure raises."""
    deadline = time.monotonic() + timeout
    while True:
        status = await monitor.execute("query-migrate")
        state = status.get("status", "none")
        if state in until:
            return status
        if state in {"failed", "cancelled"}:
            raise VMError(f"machine {monitor.name}: migration {state}: {status.get('error-desc', '')}")
        if time.monotonic() >= deadline:
            raise VMError(f"machine {monitor.name}: migration still {state} after {timeout:.0f} s")
        await asyncio.sleep(0.002)


async def wait_incoming(monitor: Monitor, timeout: float = 60.0) -> None:
    """Until a QEMU started with ``-incoming`` has loaded its state (it then sits paused)."""
    deadline = time.monotonic() + timeout
    while True:
        status = (await monitor.execute("query-status"))["status"]
        if status not in {"inmigrate", "prelaunch"}:
            if status != "paused":
                raise VMError(f"machine {monitor.name}: incoming migration ended in state {status}")
            return
        migration = await monitor.execute("query-migrate")
        if migration.get("status") == "failed":
            raise VMError(f"machine {monitor.name}: incoming migration failed: {migration.get('error-desc', '')}")
        if time.monotonic() >= deadline:
            raise VMError(f"machine {monitor.name}: incoming migration not done after {timeout:.0f} s")
        await asyncio.sleep(0.002)


# Every migration capability boxd uses. Each call sets all of them, those not named off,
# so nothing one migration needed (multifd, a background snapshot) leaks into the next.
MIGRATION_CAPABILITIES = ("x-ignore-shared", "background-snapshot", "multifd", "pause-before-switchover",
                          "auto-converge")


async def set_capabilities(monitor: Monitor, **capabilities: bool) -> None:
    wanted = {name.replace("_", "-"): on for name, on in capabilities.items()}
    unknown = set(wanted) - set(MIGRATION_CAPABILITIES)
    if unknown:
        raise ValueError(f"migration capabilities not in MIGRATION_CAPABILITIES: {sorted(unknown)}")
    await monitor.execute(
        "migrate-set-capabilities",
        {"capabilities": [{"capability": name, "state": wanted.get(name, False)} for name in MIGRATION_CAPABILITIES]},
    )


async def wait_running(monitor: Monitor, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (await monitor.execute("query-status"))["status"] != "running":
        if time.monotonic() >= deadline:
            raise VMError(f"machine {monitor.name}: still not running after {timeout:.0f} s")
        await asyncio.sleep(0.001)


async def resume(monitor: Monitor) -> None:
    """Let a machine we stopped run again, whatever went wrong meanwhile."""
    with contextlib.suppress(VMError):
        await monitor.execute("migrate_cancel")
    with contextlib.suppress(VMError):
        if (await monitor.execute("query-status"))["status"] != "running":
            await monitor.execute("cont")
