"""The VM runtime of one host: QEMU processes, their disks, RAM files and agents.

On disk, per machine:
- ``vms/<id>/machine.json``: what the machine is (spec, image, disk chain); written
  atomically, it is what a restarted daemon re-adopts the machine from.
- ``vms/<id>/console.log``: the guest's serial console.
- ``layers/*.qcow2``: disk layers. A machine writes only its own top layer; frozen
  layers under it may be shared with forks and are removed once nothing uses them.
- ``<shm>/<id>/``: the RAM file and the sockets, on tmpfs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boxd.config import MACHINE_API_PORT, boxd_home, shm_dir, vms_dir
from boxd.durable import fsync_path, sha256_file
from boxd.errors import (
    AgentUnavailable,
    BoxdError,
    Conflict,
    HostError,
    InvalidInput,
    NotFound,
    Timeout,
    Unsupported,
    VMError,
)
from boxd.guest.image import Image, load_image
from boxd.runtime.accel import Accelerator, detect_accelerator
from boxd.runtime.agent_client import AgentClient, ExecEvent
from boxd.runtime.interface import DEFAULT_USER, CheckpointTaken, ExecRequest, VMInfo, VMSpec, VMState
from boxd.runtime.network import start_passt
from boxd.runtime.snapshots import (
    PieceReader,
    Progress,
    SnapshotManifest,
    check_usable,
    fetch_into,
    read_manifest,
    read_piece,
    remove_partials,
    remove_snapshot,
    unpack_ram_and_state,
    verify_files,
    write_snapshot,
    zstd_binary,
)
from boxd.runtime.qemu import (
    Launch,
    Monitor,
    create_overlay,
    fault_in_mapping,
    free_port,
    stop_process,
    process_alive,
    qemu_binary,
    qemu_release,
    read_pid,
    resume,
    run_tool,
    set_capabilities,
    start_qemu,
    wait_incoming,
    wait_migration,
    wait_running,
)

log = logging.getLogger(__name__)

VM_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# Captures a machine's disk chain may hold before it is streamed back to one layer.
MAX_FROZEN_LAYERS = 4
# Bytes per second: QEMU refuses more than SIZE_MAX, and nothing local comes close to this.
UNLIMITED_BANDWIDTH = 1 << 40
EXPORTED_LAYER = re.compile(r"^layer-([0-9a-f]{32})\.qcow2$")  # named by its SHA-256's first half
# Live pre-copy into a template gave good clones from QEMU 10.0 on (on 7.2 half were broken).
PRECOPY_FROM_QEMU = (10, 0)
MULTIFD_CHANNELS = 2  # parallel streams of a pre-copy; more did not help on 2 cores
# What a pre-copy may leave for the final, stopped phase: QEMU stops the source once the
# rest fits this long at the measured rate (auto-converge slows a guest that outruns it).
PRECOPY_DOWNTIME_MS = 50


async def stop_processes(run_dir: Path) -> None:
    """QEMU and its network process, whichever of them runs from ``run_dir``."""
    await stop_process(read_pid(run_dir / "qemu.pid"), str(run_dir) + "/")
    await stop_process(read_pid(run_dir / "passt.pid"), str(run_dir / "net.sock"))


def _layer_digest(name: str) -> str:
    """The content digest an exported layer's name carries; any other name is refused."""
    named = EXPORTED_LAYER.match(name)
    if named is None:
        raise InvalidInput(f"layer: {name!r} is not an exported layer", field="layer")
    return named.group(1)


def _refuse_host(host: str | None) -> None:
    if host is not None:
        raise InvalidInput("host: this daemon runs machines on one host (boxd serve --ray spans several)",
                           field="host")


@dataclass
class Machine:
    """What the runtime knows of one machine, persisted as machine.json."""

    id: str
    spec: VMSpec
    image_path: str
    disk_top: str
    disk_frozen: list[str] = field(default_factory=list)
    top_node: str = "root"  # QMP node name of the top layer; each capture adds a new one
    ram_capture: str | None = None  # a fork maps this capture's RAM copy-on-write
    # Captures kept for this machine (its checkpoints), each with its disk chain then.
    checkpoints: dict[str, list[str]] = field(default_factory=dict)
    url_port: int | None = None  # host port forwarded to the guest's http_port; kept across restarts
    suspended: bool = False  # its vCPUs stopped on purpose
    hibernated: bool = False  # no process; its state is in hibernation.zst
    pid: int | None = None

    @property
    def runs_while_captured(self) -> bool:
        """Whether a capture lets it run on while its memory moves (a background snapshot).
        A fork's RAM is a private mapping of its own capture, which userfaultfd could not
        write-protect here (the snapshot hung): such a machine stays stopped meanwhile."""
        return self.ram_capture is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "spec": self.spec.to_dict(),
            "image_path": self.image_path,
            "disk_top": self.disk_top,
            "disk_frozen": self.disk_frozen,
            "top_node": self.top_node,
            "ram_capture": self.ram_capture,
            "checkpoints": self.checkpoints,
            "url_port": self.url_port,
            "suspended": self.suspended,
            "hibernated": self.hibernated,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Machine":
        return cls(
            id=data["id"],
            spec=VMSpec.from_dict(data["spec"]),
            image_path=data["image_path"],
            disk_top=data["disk_top"],
            disk_frozen=list(data.get("disk_frozen", [])),
            top_node=data.get("top_node", "root"),
            ram_capture=data.get("ram_capture"),
            checkpoints=dict(data.get("checkpoints", {})),
            url_port=data.get("url_port"),
            suspended=data.get("suspended", False),
            hibernated=data.get("hibernated", False),
        )


@dataclass
class _Batch:
    """Fork requests waiting for the next capture of one source."""

    frozen: asyncio.Future  # the Capture once its instant is fixed; its memory still streams in
    done: asyncio.Future  # the same Capture once forks can load it
    forks: int = 0  # requests in it; each holds the capture until its forks have started


@dataclass(frozen=True)
class Capture:
    """One frozen instant of a machine: RAM file, device state, and the disk layer under it."""

    id: str
    folder: Path
    disk_frozen: list[str]  # the source's chain at the instant, its last entry the newest
    pause_s: float = 0.0  # how long the source's vCPUs stood still for it

    @property
    def ram(self) -> Path:
        return self.folder / "ram"

    @property
    def state(self) -> Path:
        return self.folder / "state"


class LocalRuntime:
    def __init__(
        self,
        home: Path | None = None,
        *,
        accelerator: Accelerator | None = None,
        api_address: tuple[str, int] | None = None,
        ports: range | None = None,
    ) -> None:
        """``api_address``: where the boxd API listens (TCP, never the admin socket); with
        it, each machine's agent serves it inside the guest on MACHINE_API_PORT.
        ``ports``: the host ports its machines' URLs and incoming forks may take
        (default: any free one)."""
        self.home = Path(home) if home else boxd_home()
        self.ports = ports
        self.api_address = api_address
        self.vms_dir = vms_dir(self.home)
        self.layers_dir = self.home / "layers"
        self.shm_dir = shm_dir(self.home)
        self.captures_dir = self.shm_dir / "captures"
        self.snapshots_dir = self.home / "snapshots"
        for folder in (self.vms_dir, self.layers_dir, self.shm_dir, self.captures_dir, self.snapshots_dir):
            folder.mkdir(parents=True, exist_ok=True)
        # Saves that a dead daemon left half written; nothing else writes here yet.
        remove_partials(self.snapshots_dir)
        self.accelerator = accelerator or detect_accelerator()
        self._machines: dict[str, Machine] = {}
        self._agents: dict[str, AgentClient] = {}
        self._monitors: dict[str, Monitor] = {}
        self._images: dict[str, Image] = {}
        self._layers_lock = asyncio.Lock()
        # Layers being made or about to be used that no machine names yet (a capture's
        # new top layer, another host's layer waiting for its forks): kept by collection.
        self._held_layers: collections.Counter[str] = collections.Counter()
        # A capture in use -> the disk chain its forks go on (kept even if its source goes).
        self._capture_layers: dict[str, list[str]] = {}
        self._capture_locks: dict[str, asyncio.Lock] = {}
        self._next_capture: dict[str, _Batch] = {}
        self._captures_in_use: collections.Counter[str] = collections.Counter()
        self._background: set[asyncio.Task] = set()
        self._ram_mapped: set[int] = set()  # QEMU pids whose guest RAM is faulted in
        self._receiving: dict[str, Monitor] = {}  # captures streaming in from another host
        self.exports_dir = self.home / "exports"  # disk layers for other hosts to copy
        log.info("runtime accelerator=%s reason=%r", self.accelerator.name, self.accelerator.reason)

    # -- paths ------------------------------------------------------------------------

    def _vm_dir(self, vm_id: str) -> Path:
        return self.vms_dir / vm_id

    def _run_dir(self, vm_id: str) -> Path:
        return self.shm_dir / vm_id

    def console_log(self, vm_id: str) -> Path:
        return self._vm_dir(vm_id) / "console.log"

    def _launch(self, machine: Machine, image: Image, **overrides: Any) -> Launch:
        run_dir = self._run_dir(machine.id)
        capture = machine.ram_capture
        values: dict[str, Any] = dict(
            name=machine.id,
            run_dir=run_dir,
            ram_file=self.captures_dir / capture / "ram" if capture else run_dir / "ram",
            ram_shared=capture is None,
            incoming=capture is not None,
            disk=self.layers_dir / machine.disk_top,
            kernel=image.kernel,
            initrd=image.initrd,
            console_log=self.console_log(machine.id),
            accelerator=self.accelerator,
            vcpus=machine.spec.vcpus,
            memory_mib=machine.spec.memory_mib,
            isolated=machine.spec.isolated,
            forward=(machine.url_port, machine.spec.http_port) if machine.url_port else None,
        )
        values.update(overrides)
        return Launch(**values)

    async def _image(self, reference: str) -> Image:
        """An image, checked once: checking runs qemu-img, too slow to repeat per fork."""
        image = self._images.get(reference)
        if image is None:
            image = self._images[reference] = await asyncio.to_thread(load_image, reference, home=self.home)
        return image

    def _save(self, machine: Machine) -> None:
        path = self._vm_dir(machine.id) / "machine.json"
        partial = path.with_suffix(".json.part")
        partial.write_text(json.dumps(machine.to_dict(), indent=2))
        os.replace(partial, path)

    def committed_memory_mib(self) -> int:
        """Guest RAM of the machines this runtime holds that hold memory (not hibernated)."""
        return sum(m.spec.memory_mib for m in self._machines.values() if not m.hibernated)

    def _machine(self, vm_id: str) -> Machine:
        machine = self._machines.get(vm_id)
        if machine is None:
            raise NotFound(f"machine {vm_id}: not known to this runtime")
        return machine

    def _agent(self, vm_id: str) -> AgentClient:
        self._machine(vm_id)
        agent = self._agents.get(vm_id)
        if agent is None:
            agent = self._agents[vm_id] = AgentClient(self._run_dir(vm_id) / "agent.sock", name=vm_id)
        return agent

    # -- lifecycle --------------------------------------------------------------------

    def _check_new_id(self, vm_id: str) -> None:
        if not VM_ID.match(vm_id):
            raise InvalidInput(f"id: {vm_id!r} is not a valid machine id", field="id")
        if vm_id in self._machines or self._vm_dir(vm_id).exists():
            raise Conflict(f"machine {vm_id}: already exists", field="id")

    async def create(
        self, vm_id: str, spec: VMSpec, *, snapshot: str | None = None, host: str | None = None
    ) -> VMInfo:
        """Boot a new machine from its image, or, given a snapshot's digest, start it at that instant."""
        _refuse_host(host)
        self._check_new_id(vm_id)
        qemu_binary()  # before anything else: no QEMU is the most basic thing to report
        image = await self._image(spec.image)
        self._check_room(spec)
        machine = self._new_machine(vm_id, spec, str(image.path))
        try:
            if snapshot is None:
                await create_overlay(self.layers_dir / machine.disk_top, image.rootfs, spec.disk_gib)
                self._save(machine)
                machine.pid = await self._start(machine, image)
            else:
                await self._create_from_snapshot(machine, image, snapshot)
        except BaseException:
            await self._remove(vm_id)
            raise
        log.info("machine started id=%s pid=%s", vm_id, machine.pid)
        return await self.info(vm_id)

    def _new_machine(self, vm_id: str, spec: VMSpec, image_path: str, **fields: Any) -> Machine:
        """A machine known here, with its folder, the name of its own top layer and a URL
        port of its own (forks never share one); nothing started yet."""
        machine = Machine(
            id=vm_id,
            spec=spec,
            image_path=image_path,
            disk_top=f"{vm_id}-{secrets.token_hex(4)}.qcow2",
            url_port=free_port(self.ports),
            **fields,
        )
        self._vm_dir(vm_id).mkdir(parents=True)
        self._machines[vm_id] = machine
        return machine

    async def _start(self, machine: Machine, image: Image) -> int:
        return await self._start_processes(self._launch(machine, image))

    async def _start_processes(self, launch: Launch) -> int:
        """The network first (QEMU connects to it), then QEMU; returns QEMU's pid."""
        if launch.needs_network_process:
            launch.run_dir.mkdir(parents=True, exist_ok=True)
            await start_passt(launch.run_dir, launch.forward)
        return await start_qemu(launch)


    def _check_room(self, spec: VMSpec) -> None:
        shm = os.statvfs(self.shm_dir)
        free_mib = shm.f_bavail * shm.f_frsize // (1024 * 1024)
        if free_mib < spec.memory_mib:
            raise HostError(
                f"memory: {spec.memory_mib} MiB of guest RAM asked, {free_mib} MiB free in {self.shm_dir}",
                field="memory_mib",
            )
        disk = os.statvfs(self.layers_dir)
        free_bytes = disk.f_bavail * disk.f_frsize
        if free_bytes < 256 * 1024 * 1024:
            raise HostError(f"disk: less than 256 MiB free under {self.layers_dir}")
        if spec.disk_gib * 1024**3 > free_bytes:
            # Disks are thin, but a machine may fill its own: refuse one the host cannot hold.
            raise HostError(
                f"disk_gib: {spec.disk_gib} GiB asked, {free_bytes / 1024**3:.1f} GiB free under {self.layers_dir}",
                field="disk_gib",
            )

    async def adopt(self, vm_id: str) -> VMInfo:
        path = self._vm_dir(vm_id) / "machine.json"
        try:
            machine = Machine.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise NotFound(f"machine {vm_id}: no state on this host") from None
        machine.pid = read_pid(self._run_dir(vm_id) / "qemu.pid")
        self._machines[vm_id] = machine
        return await self.info(vm_id)

    async def info(self, vm_id: str) -> VMInfo:
        machine = self._machine(vm_id)
        if machine.hibernated:
            state = VMState.STOPPED
        elif not process_alive(machine.pid, self._marker(vm_id)):
            state = VMState.FAILED
        else:
            state = VMState.PAUSED if machine.suspended else VMState.RUNNING
        return VMInfo(
            id=vm_id,
            state=state,
            pid=None if machine.hibernated else machine.pid,
            accelerator=self.accelerator.name,
            console_log=str(self.console_log(vm_id)),
            url_port=None if machine.hibernated else machine.url_port,
        )

    def _marker(self, vm_id: str) -> str:
        # Every QEMU of ours names its run dir on its command line.
        return str(self._run_dir(vm_id)) + "/"

    async def wait_ready(self, vm_id: str, timeout: float) -> None:
        """Until the agent answers, watching that QEMU is still alive meanwhile."""
        machine = self._machine(vm_id)
        agent = self._agent(vm_id)
        connecting = asyncio.create_task(agent.connect(timeout))
        try:
            while not connecting.done():
                self._check_alive(machine)
                await asyncio.wait({connecting}, timeout=0.1)
            connecting.result()
            # A fork or a restored machine wakes with the clock of its capture.
            await agent.set_time()
            await self._serve_api(machine, agent)
        except AgentUnavailable:
            # The agent's connection also breaks when QEMU dies just after it connected.
            self._check_alive(machine)
            raise Timeout(
                f"machine {vm_id}: not ready after {timeout:.0f} s; console: {self._console_tail(vm_id)}"
            ) from None
        finally:
            if not connecting.done():
                connecting.cancel()
                with contextlib.suppress(BaseException):
                    await connecting

    async def _serve_api(self, machine: Machine, agent: AgentClient) -> None:
        """The boxd API inside the guest, tunnelled through the agent to ``api_address``."""
        if self.api_address is None:
            return
        host, port = self.api_address
        try:
            await agent.serve_tunnels(MACHINE_API_PORT, lambda: asyncio.open_connection(host, port))
        except (Unsupported, Conflict) as error:  # an agent from before tunnels, or the port taken in the guest
            log.warning("no API inside the machine id=%s reason=%s", machine.id, error.message)

    def _check_alive(self, machine: Machine) -> None:
        if not process_alive(machine.pid, self._marker(machine.id)):
            raise VMError(
                f"machine {machine.id}: QEMU exited while booting; console: {self._console_tail(machine.id)}"
            )

    def _console_tail(self, vm_id: str, lines: int = 5) -> str:
        try:
            text = self.console_log(vm_id).read_text(errors="replace")
        except FileNotFoundError:
            return "(no console output)"
        return " | ".join(text.strip().splitlines()[-lines:]) or "(no console output)"

    async def delete(self, vm_id: str) -> None:
        if vm_id not in self._machines:
            with contextlib.suppress(NotFound):
                await self.adopt(vm_id)
        self._machine(vm_id)
        # After a capture or rewind under way: it changes the files and processes removed here.
        async with self._capture_lock(vm_id):
            await self._remove(vm_id)
        self._capture_locks.pop(vm_id, None)
        log.info("machine deleted id=%s", vm_id)

    async def _remove(self, vm_id: str) -> None:
        """The one cleanup path, for deletes and for failed starts alike."""
        machine = self._machines.pop(vm_id, None)
        await self._disconnect(vm_id)
        if machine is not None:  # its pid may be known while its pidfile is not written yet
            await stop_process(machine.pid, self._marker(vm_id))
        await stop_processes(self._run_dir(vm_id))
        shutil.rmtree(self._run_dir(vm_id), ignore_errors=True)
        shutil.rmtree(self._vm_dir(vm_id), ignore_errors=True)
        await self.collect_garbage()

    async def hosts(self) -> list[str]:
        return []

    async def lost(self) -> list[str]:
        return []  # one host: if it is gone, so is this process

    async def collect_garbage(self) -> None:
        """Remove disk layers and captures that no machine uses any more."""
        async with self._layers_lock:
            # What is kept is read with no await in between, and every file is named here
            # (by a machine known in memory, a record, or a hold) before it is made: so a
            # machine being made never loses a layer to a delete that runs meanwhile.
            captures: set[str] = set(self._captures_in_use)
            layers: set[str] = set(self._held_layers)
            for capture_id in captures:
                layers.update(self._capture_layers.get(capture_id, ()))
            records = [machine.to_dict() for machine in self._machines.values()]
            for record in self.vms_dir.glob("*/machine.json"):  # machines not adopted yet
                with contextlib.suppress(FileNotFoundError, ValueError):
                    records.append(json.loads(record.read_text()))
            for data in records:
                with contextlib.suppress(KeyError, TypeError):
                    layers.add(data["disk_top"])
                    layers.update(data.get("disk_frozen", []))
                    captures.add(data.get("ram_capture") or "")
                    for capture_id, chain in data.get("checkpoints", {}).items():
                        captures.add(capture_id)
                        layers.update(chain)
            for layer in self.layers_dir.glob("*.qcow2"):
                if layer.name not in layers:
                    layer.unlink(missing_ok=True)
            for capture in self.captures_dir.iterdir():
                if capture.name not in captures:
                    # A daemon that died mid-capture left its template QEMU waiting.
                    await stop_processes(capture / "template")
                    shutil.rmtree(capture, ignore_errors=True)

    async def close(self) -> None:
        """Let go of connections; machines keep running (they outlive the daemon)."""
        for agent in list(self._agents.values()):
            await agent.close()
        self._agents.clear()
        for monitor in list(self._monitors.values()):
            await monitor.close()
        self._monitors.clear()

    # -- inside the guest -------------------------------------------------------------

    async def exec(self, vm_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        async for event in self._agent(vm_id).exec(
            argv=request.argv,
            shell=request.shell,
            env=request.env,
            cwd=request.cwd,
            user=request.user,
            stdin=request.stdin,
            keep_stdin=request.keep_stdin,
            timeout=request.timeout,
            tag=request.tag,
            pty=request.pty,
        ):
            yield event

    async def attach(self, vm_id: str, pid: int) -> AsyncIterator[ExecEvent]:
        async for event in self._agent(vm_id).attach(pid):
            yield event

    async def process(self, vm_id: str, op: str, **fields: Any) -> dict[str, Any]:
        return await self._agent_op(vm_id, op, {"processes", "stdin", "close_stdin", "signal", "resize"}, fields)

    async def write_file(
        self, vm_id: str, path: str, chunks: AsyncIterator[bytes], *, mode: int | None = None, user: str = DEFAULT_USER
    ) -> int:
        return await self._agent(vm_id).write_file(path, chunks, mode=mode, user=user)

    async def read_file(self, vm_id: str, path: str) -> AsyncIterator[bytes]:
        async for chunk in self._agent(vm_id).read_file(path):
            yield chunk

    async def fs(self, vm_id: str, op: str, **fields: Any) -> dict[str, Any]:
        return await self._agent_op(vm_id, op, {"stat", "list_dir", "make_dir", "remove", "move"}, fields)

    async def watch(self, vm_id: str, path: str, *, recursive: bool = False) -> AsyncIterator[tuple[str, str]]:
        async for change in self._agent(vm_id).watch(path, recursive=recursive):
            yield change

    async def _agent_op(self, vm_id: str, op: str, allowed: set[str], fields: dict[str, Any]) -> dict[str, Any]:
        if op not in allowed:
            raise InvalidInput(f"op: unknown operation {op!r}", field="op")
        answer = await self._agent(vm_id).call(op, **fields)
        answer.pop("id", None)
        answer.pop("type", None)
        return answer

    # -- fork -------------------------------------------------------------------------

    async def _monitor(self, vm_id: str) -> Monitor:
        monitor = self._monitors.get(vm_id)
        if monitor is None or not monitor.connected:
            if monitor is not None:
                await monitor.close()
            monitor = Monitor(self._run_dir(vm_id) / "qmp.sock", vm_id)
            await monitor.connect()
            self._monitors[vm_id] = monitor
        return monitor

    async def fork(self, source_id: str, new_ids: list[str], *, host: str | None = None) -> list[VMInfo]:
        """New machines that continue from one instant of a running machine.

        Forks asked for while no capture of the source is under way share the next one,
        so a burst of forks pauses the source once.
        """
        _refuse_host(host)
        source = self._machine(source_id)
        for new_id in new_ids:
            self._check_new_id(new_id)
        if not process_alive(source.pid, self._marker(source_id)):
            raise Conflict(f"machine {source_id}: not running, so it cannot be forked")
        batch = self._join_capture(source)
        capture = await asyncio.shield(batch.frozen)
        try:
            results = await asyncio.gather(
                *(self._start_clone(source, batch, capture, new_id) for new_id in new_ids), return_exceptions=True
            )
        finally:
            self._release(capture.id)
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            for new_id, result in zip(new_ids, results):
                if not isinstance(result, BaseException):
                    await self._remove(new_id)
            await self.collect_garbage()
            raise failures[0]
        return list(results)

    def _join_capture(self, source: Machine) -> _Batch:
        """The next capture of ``source``, held for this request until it calls ``_release``."""
        batch = self._next_capture.get(source.id)
        if batch is None:
            loop = asyncio.get_running_loop()
            batch = self._next_capture[source.id] = _Batch(loop.create_future(), loop.create_future())
            self._in_background(self._take_capture(source, batch))
        batch.forks += 1
        return batch

    def _release(self, capture_id: str) -> None:
        """One user less; garbage collection may take a capture nobody holds or maps."""
        self._captures_in_use[capture_id] -= 1
        if self._captures_in_use[capture_id] <= 0:
            del self._captures_in_use[capture_id]
            self._capture_layers.pop(capture_id, None)

    @contextlib.contextmanager
    def _holding_layers(self, *names: str):
        """Garbage collection keeps these layers meanwhile (made before a record names them)."""
        self._held_layers.update(names)
        try:
            yield
        finally:
            self._held_layers.subtract(names)
            for name in names:
                if self._held_layers[name] <= 0:
                    del self._held_layers[name]

    def _in_background(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        # The loop holds tasks weakly: without this reference a pending one can be
        # collected half-way.
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background work failed: %s", task.exception())

    def _capture_lock(self, vm_id: str) -> asyncio.Lock:
        """Held while a machine is captured, rewound, put to sleep, woken or deleted: each
        changes its processes and disk chain."""
        return self._capture_locks.setdefault(vm_id, asyncio.Lock())

    def _check_not_deleted(self, machine: Machine) -> None:
        """Under its capture lock: a delete that held the lock before may have removed it."""
        if self._machines.get(machine.id) is not machine:
            raise NotFound(f"machine {machine.id}: deleted meanwhile")

    async def _take_capture(self, source: Machine, batch: _Batch) -> None:
        async with self._capture_lock(source.id):
            try:
                capture = await self._capture(source, batch)
                batch.done.set_result(capture)
            except asyncio.CancelledError:
                batch.frozen.cancel()
                batch.done.cancel()
                raise
            except Exception as error:
                for future in (batch.frozen, batch.done):
                    if not future.done():
                        future.set_exception(error)
                        future.exception()  # marked retrieved: waiters that went away leave no warning
                return
            finally:
                # A capture that failed before its instant must not take later forks down with it.
                if self._next_capture.get(source.id) is batch:
                    del self._next_capture[source.id]
            await self._after_capture(source, capture)

    async def _after_capture(self, source: Machine, capture: Capture) -> None:
        """Tidy up after a capture; the caller holds the source's capture lock."""
        # The template wrote every page, zero or not: give the zero ones back to
        # tmpfs. Safe while forks map the file: a punched page reads as zeros still.
        self._in_background(run_tool("fallocate", "--dig-holes", str(capture.ram)))
        with contextlib.suppress(BoxdError):
            # The source's guest clock stood still while it was stopped.
            await self._agent(source.id).set_time()
        if len(source.disk_frozen) > MAX_FROZEN_LAYERS:
            # Under the capture lock: a capture would change the chain being streamed.
            await self._shorten_chain(source)

    async def _shorten_chain(self, source: Machine) -> None:
        """Pull the frozen layers' data into the top layer: the chain is top on image again.

        Every capture adds a layer under the source, and every read that misses the top
        walks the chain. The frozen layers stay for the forks that use them.
        """
        image = await self._image(source.image_path)
        monitor = await self._monitor(source.id)
        job = f"stream-{secrets.token_hex(4)}"
        started = time.monotonic()
        await monitor.execute(
            "block-stream",
            {"job-id": job, "device": source.top_node, "base": str(image.rootfs), "auto-dismiss": False},
        )
        while True:
            status = next((j for j in await monitor.execute("query-jobs") if j["id"] == job), None)
            if status is None or status["status"] == "concluded":
                break
            await asyncio.sleep(0.05)
        await monitor.execute("job-dismiss", {"id": job})
        if status is not None and status.get("error"):
            log.warning("chain not shortened machine=%s error=%r", source.id, status["error"])
            return
        dropped, source.disk_frozen = source.disk_frozen, []
        self._save(source)
        await self.collect_garbage()
        log.info(
            "chain shortened machine=%s layers_dropped=%d seconds=%.2f",
            source.id, len(dropped), time.monotonic() - started,
        )

    async def _capture(self, source: Machine, batch: _Batch | None = None) -> Capture:
        """Freeze one instant of ``source``: its RAM, its device state and its disk.

        The source stops only while its disk gets a new top layer and QEMU takes its
        device state and write-protects its RAM (a background snapshot, through
        userfaultfd); it then runs on while its RAM streams into a template QEMU that
        never runs. The template's RAM file is the capture that forks map
        copy-on-write, beside its device state. So the pause does not grow with RAM.

        Two simpler ways were measured and dropped: pre-copy live migration (under TCG
        on QEMU 7.2 its captures had stale pages and forked kernels crashed), and
        copying the RAM file with the source stopped (correct, but the pause grows with
        the RAM the source uses).
        """
        self._check_not_deleted(source)
        image = await self._image(source.image_path)
        capture_id = f"{source.id}-{secrets.token_hex(4)}"
        folder = self.captures_dir / capture_id
        folder.mkdir(parents=True)
        self._captures_in_use[capture_id] += 1
        template = self._template(source, image, folder)
        stream = template.run_dir / "migrate.sock"
        template_monitor = None
        try:
            try:
                template_monitor = await self._open_template(
                    template, image, source.spec.disk_gib, f"unix:{stream}",
                    map_ram_of=source if self.capture_method(source) == "background" else None,
                )
                # Forks asked for until this instant share it; later ones wait for the next.
                if batch is not None:
                    if self._next_capture.get(source.id) is batch:
                        del self._next_capture[source.id]
                    self._captures_in_use[capture_id] += batch.forks

                def frozen(chain: list[str]) -> None:
                    self._capture_layers[capture_id] = chain
                    if batch is not None:  # its forks may start their QEMUs now
                        batch.frozen.set_result(Capture(id=capture_id, folder=folder, disk_frozen=chain))

                chain, pause_s, _ = await self._send_instant(source, f"unix:{stream}", frozen)
                capture = Capture(id=capture_id, folder=folder, disk_frozen=chain)
                await self._keep_template_state(template_monitor, folder)
            finally:
                # First, while its pidfile is still there to say which process it is.
                await self._end_template(template_monitor, folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            self._captures_in_use.pop(capture_id, None)  # its forks fail with this error
            self._capture_layers.pop(capture_id, None)
            raise
        self._release(capture_id)
        log.info("capture taken source=%s capture=%s pause_ms=%.1f method=%s", source.id, capture_id, pause_s * 1000,
                 self.capture_method(source))
        return dataclasses.replace(capture, pause_s=pause_s)

    def _template(self, machine: Machine, image: Image, folder: Path) -> Launch:
        """A QEMU shaped like ``machine`` that only receives its memory, into ``folder/ram``;
        it never runs, and its disk is a throwaway it never writes."""
        return self._launch(
            machine,
            image,
            name=f"capture-{folder.name}",
            run_dir=folder / "template",
            ram_file=folder / "ram",
            ram_shared=True,
            incoming=True,
            disk=folder / "template.qcow2",
            console_log=folder / "template.console",
            unplugged=True,
            forward=None,  # the source's URL port is the source's (slirp would try to bind it again)
        )

    @functools.cached_property
    def precopy(self) -> bool:
        """Whether captures are live pre-copies (this QEMU) rather than background snapshots."""
        return qemu_release() >= PRECOPY_FROM_QEMU

    async def _open_template(
        self, template: Launch, image: Image, disk_gib: int, uri: str, *, map_ram_of: Machine | None = None
    ) -> Monitor:
        """Start a template and have it wait for a migration on ``uri``; the source's RAM is
        faulted in meanwhile (``map_ram_of``). Returns its monitor."""
        await create_overlay(template.disk, image.rootfs, disk_gib)
        await asyncio.gather(
            self._start_processes(template), self._map_ram_in(map_ram_of) if map_ram_of else asyncio.sleep(0)
        )
        monitor = Monitor(template.qmp_socket, template.name)
        try:
            await monitor.connect()
            if self.precopy:  # the sender's channels must match
                await set_capabilities(monitor, multifd=True)
                await monitor.execute("migrate-set-parameters", {"multifd-channels": MULTIFD_CHANNELS})
            await monitor.execute("migrate-incoming", {"uri": uri})
        except BaseException:
            await monitor.close()
            raise
        return monitor

    async def _keep_template_state(self, monitor: Monitor, folder: Path) -> None:
        """Once the memory is in: the template's device state, written beside its RAM."""
        await wait_incoming(monitor)
        await set_capabilities(monitor, x_ignore_shared=True)
        await monitor.execute("migrate", {"uri": f"exec:cat > {folder / 'state'}"})
        await wait_migration(monitor, {"completed"})

    async def _end_template(self, monitor: Monitor | None, folder: Path) -> None:
        """The template gone, process, run folder and disk; the capture's RAM and state stay."""
        if monitor is not None:
            await monitor.close()
        await stop_processes(folder / "template")
        shutil.rmtree(folder / "template", ignore_errors=True)
        (folder / "template.qcow2").unlink(missing_ok=True)

    def capture_method(self, source: Machine) -> str:
        """How an instant of ``source`` is taken:

        - ``precopy`` (QEMU 10): live migration; the RAM streams over several channels
          while the source runs, QEMU stops it once little is left, and it waits there
          (pause-before-switchover) while its disk gets its new top layer. Works for
          every source, forks and restored machines included: nothing is write-protected.
        - ``background`` (QEMU 7.2, a source that owns its RAM): stopped while its disk
          is frozen and its device state taken; it runs on while write-protected RAM
          streams (a background snapshot through userfaultfd).
        - ``stop-and-copy`` (QEMU 7.2, a fork or restored machine, whose private mapping
          userfaultfd could not write-protect): stopped until all of its RAM went.
        """
        if self.precopy:
            return "precopy"
        return "background" if source.runs_while_captured else "stop-and-copy"

    async def _send_instant(
        self, source: Machine, uri: str, on_frozen: Callable[[list[str]], None] | None = None
    ) -> tuple[list[str], float, dict[str, Any]]:
        """Migrate an instant of the source to ``uri``, its disk given a new top layer at
        that instant (``capture_method`` says how). Returns the frozen chain, how long the
        vCPUs stood still, and the migration's last status. ``on_frozen`` gets the chain as
        soon as it is fixed."""
        method = self.capture_method(source)
        monitor = await self._monitor(source.id)
        # x-ignore-shared off (a fork had it on to load its own state): all of the memory must go.
        await set_capabilities(monitor, background_snapshot=method == "background", multifd=method == "precopy",
                               pause_before_switchover=method == "precopy", auto_converge=method == "precopy")
        # QEMU caps migration at 128 MiB/s by default, a limit meant for networks: the
        # stream here is a local socket (or a cluster's network), and every fork waits for its end.
        parameters: dict[str, Any] = {"max-bandwidth": UNLIMITED_BANDWIDTH}
        if method == "precopy":
            parameters.update({"multifd-channels": MULTIFD_CHANNELS, "downtime-limit": PRECOPY_DOWNTIME_MS})
        await monitor.execute("migrate-set-parameters", parameters)
        try:
            if method == "precopy":
                return await self._precopy(source, monitor, uri, on_frozen)
            await monitor.execute("stop")
            paused_at = time.monotonic()
            chain = await self._freeze_disk(source, monitor)
            if on_frozen is not None:
                on_frozen(chain)
            await monitor.execute("migrate", {"uri": uri})
            if method == "background":
                # The snapshot restarts the vCPUs itself once the state is taken, at the
                # instant the disk was frozen.
                await wait_running(monitor)
            else:
                await wait_migration(monitor, {"completed"})
                await monitor.execute("cont")
        except BaseException:
            await resume(monitor)
            raise
        pause_s = time.monotonic() - paused_at
        return chain, pause_s, await wait_migration(monitor, {"completed"})

    async def _precopy(
        self, source: Machine, monitor: Monitor, uri: str, on_frozen: Callable[[list[str]], None] | None
    ) -> tuple[list[str], float, dict[str, Any]]:
        await monitor.execute("migrate", {"uri": uri})
        # QEMU stops the source here, before the last pages and the device state go.
        await wait_migration(monitor, {"pre-switchover"}, timeout=600)
        chain = await self._freeze_disk(source, monitor)
        if on_frozen is not None:
            on_frozen(chain)
        await monitor.execute("migrate-continue", {"state": "pre-switchover"})
        status = await wait_migration(monitor, {"completed"})
        completed_at = time.monotonic()
        await monitor.execute("cont")
        # QEMU's downtime runs from its stop until the migration completed; cont follows.
        pause_s = status.get("downtime", 0) / 1000 + (time.monotonic() - completed_at)
        return chain, pause_s, status

    async def _map_ram_in(self, source: Machine) -> None:
        """Fault all of the source's guest RAM into its QEMU's page tables now, while it runs.

        A background snapshot first touches every page of guest RAM, with the vCPUs
        stopped; a page that QEMU never mapped costs a page fault then (and tmpfs
        allocates it). On a first capture that was most of the pause: 270-300 ms for a
        512 MiB guest against about 30 ms for later ones. Once per QEMU process.
        """
        if source.pid is None or source.pid in self._ram_mapped:
            return
        ram = self._run_dir(source.id) / "ram"
        try:
            await asyncio.to_thread(fault_in_mapping, source.pid, ram)
        except OSError as error:  # e.g. ptrace rules that forbid reading its memory: only slower
            log.info("guest RAM not faulted in ahead machine=%s error=%s", source.id, error)
        self._ram_mapped.add(source.pid)

    async def _freeze_disk(self, source: Machine, monitor: Monitor) -> list[str]:
        """Make the source's top layer read-only and give it a new one; returns the frozen chain."""
        token = secrets.token_hex(4)
        new_top, new_node = f"{source.id}-{token}.qcow2", f"top-{token}"
        with self._holding_layers(new_top):  # QEMU makes the file before the record names it
            await monitor.execute(
                "blockdev-snapshot-sync",
                {
                    "node-name": source.top_node,
                    "snapshot-file": str(self.layers_dir / new_top),
                    "snapshot-node-name": new_node,
                    "format": "qcow2",
                },
            )
            source.disk_frozen.append(source.disk_top)
            source.disk_top, source.top_node = new_top, new_node
            self._save(source)
        return list(source.disk_frozen)

    async def _start_clone(self, source: Machine, batch: _Batch, capture: Capture, new_id: str) -> VMInfo:
        image = await self._image(source.image_path)
        clone = self._new_machine(
            new_id, source.spec, source.image_path, disk_frozen=list(capture.disk_frozen), ram_capture=capture.id
        )
        try:
            await create_overlay(self.layers_dir / clone.disk_top, self.layers_dir / capture.disk_frozen[-1])
            self._save(clone)
            # Started while the capture's memory still streams into the template: it maps
            # the RAM file now but reads it only once the template is gone.
            await self._start_from_capture(clone, image, capture.state, asyncio.shield(batch.done))
        except BaseException:
            await self._remove(new_id)
            raise
        log.info("fork started source=%s id=%s pid=%s", source.id, new_id, clone.pid)
        return await self.info(new_id)

    async def _start_from_capture(
        self, machine: Machine, image: Image, state: Path, loadable: Awaitable[Any] | None = None
    ) -> None:
        """Start ``machine``'s QEMU on its capture's RAM, load the device state and let it run.

        ``loadable``, when given, is awaited between the start and the load.
        """
        machine.pid = await self._start(machine, image)
        monitor = await self._monitor(machine.id)
        await set_capabilities(monitor, x_ignore_shared=True)
        if loadable is not None:
            await loadable
        await monitor.execute("migrate-incoming", {"uri": f"exec:cat {state}"})
        await wait_incoming(monitor)
        await monitor.execute("cont")

    # -- checkpoints and snapshots ----------------------------------------------------

    async def checkpoint(self, vm_id: str) -> CheckpointTaken:
        """Keep this instant of the machine (a capture it holds) so it can come back to it."""
        machine = self._running(vm_id, "checkpointed")
        async with self._capture_lock(vm_id):
            capture = await self._capture(machine)
            # Recorded before any await: garbage collection keeps what machine.json names.
            machine.checkpoints[capture.id] = capture.disk_frozen
            self._save(machine)
            await self._after_capture(machine, capture)
        return CheckpointTaken(id=capture.id, pause_s=capture.pause_s)

    def _running(self, vm_id: str, what: str) -> Machine:
        machine = self._machine(vm_id)
        if not process_alive(machine.pid, self._marker(vm_id)):
            raise Conflict(f"machine {vm_id}: not running, so it cannot be {what}")
        return machine

    def _checkpoint_chain(self, machine: Machine, checkpoint_id: str) -> list[str]:
        chain = machine.checkpoints.get(checkpoint_id)
        if chain is None:
            raise NotFound(f"machine {machine.id}: no checkpoint {checkpoint_id}", field="checkpoint")
        return chain

    async def restore(self, vm_id: str, checkpoint_id: str) -> VMInfo:
        """Rewind the machine in place to a checkpoint: same id, sockets and network, new process.

        Its RAM then maps the checkpoint's copy-on-write, as a fork's does, and its disk
        gets a new top layer on the checkpoint's; so the same checkpoint can be restored
        again and again.
        """
        machine = self._machine(vm_id)
        chain = self._checkpoint_chain(machine, checkpoint_id)
        image = await self._image(machine.image_path)
        async with self._capture_lock(vm_id):
            self._check_not_deleted(machine)
            started = time.monotonic()
            await self._disconnect(vm_id)
            await stop_process(machine.pid, self._marker(vm_id))
            await stop_processes(self._run_dir(vm_id))
            machine.disk_frozen, machine.ram_capture = list(chain), checkpoint_id
            machine.disk_top, machine.top_node = f"{vm_id}-{secrets.token_hex(4)}.qcow2", "root"
            await create_overlay(self.layers_dir / machine.disk_top, self.layers_dir / chain[-1])
            self._save(machine)
            await self._start_from_capture(machine, image, self.captures_dir / checkpoint_id / "state")
        log.info("machine restored id=%s checkpoint=%s seconds=%.3f", vm_id, checkpoint_id, time.monotonic() - started)
        await self.collect_garbage()
        return await self.info(vm_id)

    async def _disconnect(self, vm_id: str) -> None:
        agent = self._agents.pop(vm_id, None)
        if agent is not None:
            await agent.close()
        monitor = self._monitors.pop(vm_id, None)
        if monitor is not None:
            await monitor.close()

    async def drop_checkpoint(self, vm_id: str, checkpoint_id: str) -> None:
        machine = self._machine(vm_id)
        self._checkpoint_chain(machine, checkpoint_id)
        del machine.checkpoints[checkpoint_id]
        self._save(machine)
        await self.collect_garbage()

    async def save_snapshot(self, vm_id: str, checkpoint_id: str, progress: Progress | None = None) -> SnapshotManifest:
        """Write one of the machine's checkpoints out as a durable, compressed snapshot."""
        machine = self._machine(vm_id)
        chain = self._checkpoint_chain(machine, checkpoint_id)
        image = await self._image(machine.image_path)
        folder = self.captures_dir / checkpoint_id
        self._captures_in_use[checkpoint_id] += 1  # even if the checkpoint is dropped meanwhile
        try:
            return await write_snapshot(
                self.snapshots_dir,
                ram=folder / "ram",
                state=folder / "state",
                disk_top=self.layers_dir / chain[-1],
                image_rootfs=image.rootfs,
                machine={**machine.spec.to_dict(), "image": image.digest, "accelerator": self.accelerator.name},
                progress=progress,
            )
        finally:
            self._release(checkpoint_id)

    async def delete_snapshot(self, digest: str) -> None:
        remove_snapshot(self.snapshots_dir, digest)

    async def _create_from_snapshot(self, machine: Machine, image: Image, digest: str) -> None:
        """Start a new machine at a snapshot's instant; its RAM and disk layer are shared by
        every machine started from the same snapshot on this host."""
        manifest = read_manifest(self.snapshots_dir, digest)
        check_usable(manifest, self.accelerator.name)
        if manifest.data["memory_mib"] != machine.spec.memory_mib:
            raise InvalidInput(
                f"memory_mib: snapshot {digest[:12]} holds {manifest.data['memory_mib']} MiB of RAM, "
                f"not {machine.spec.memory_mib}",
                field="memory_mib",
            )
        await asyncio.to_thread(verify_files, self.snapshots_dir, manifest)
        capture_id = f"snapshot-{digest[:16]}"
        capture = self.captures_dir / capture_id
        layer = f"{capture_id}.qcow2"
        self._captures_in_use[capture_id] += 1
        self._capture_layers[capture_id] = [layer]
        try:
            async with self._layers_lock:
                if not (capture / "ready").exists():
                    await unpack_ram_and_state(self.snapshots_dir, manifest, capture)
                    (capture / "ready").touch()
                if not (self.layers_dir / layer).exists():
                    partial = self.layers_dir / f"{layer}.part"
                    shutil.copyfile(self.snapshots_dir / digest / "disk.qcow2", partial)
                    # The layer names its image's root filesystem by path, which may differ here.
                    await run_tool("qemu-img", "rebase", "-u", "-F", "qcow2", "-b", str(image.rootfs), str(partial))
                    os.replace(partial, self.layers_dir / layer)
            await self._start_on_capture(machine, image, capture_id, layer)
        finally:
            self._release(capture_id)

    async def _start_on_capture(self, machine: Machine, image: Image, capture_id: str, layer: str) -> None:
        """Start a new machine on a capture's RAM and state, its disk a new top layer over
        ``layer`` (one layer over the image: a snapshot's disk, or another host's chain)."""
        machine.ram_capture, machine.disk_frozen = capture_id, [layer]
        await create_overlay(self.layers_dir / machine.disk_top, self.layers_dir / layer)
        self._save(machine)
        await self._start_from_capture(machine, image, self.captures_dir / capture_id / "state")

    # -- forks across hosts -----------------------------------------------------------
    #
    # A fork on another host: that host starts a template QEMU waiting for a migration on
    # a TCP port (``receive_capture``); this one streams an instant of the source into it
    # (``capture_to``, the same background snapshot as a local capture) and flattens the
    # source's frozen disk chain into one layer over the image, named by its SHA-256
    # (``export``); the other host keeps the template's RAM and state as a capture
    # (``finish_capture``), copies the layer unless it has it (``import_layer``), and
    # starts the forks on both (``fork_from``).

    def spec_of(self, vm_id: str) -> VMSpec:
        return self._machine(vm_id).spec

    async def receive_capture(self, spec: VMSpec, listen_host: str) -> tuple[str, int]:
        """A template QEMU for ``spec`` waiting for a migration on ``listen_host``; returns
        the capture's id and the TCP port."""
        image = await self._image(spec.image)
        self._check_room(spec)
        capture_id = f"remote-{secrets.token_hex(6)}"
        folder = self.captures_dir / capture_id
        folder.mkdir(parents=True)
        self._captures_in_use[capture_id] += 1
        model = Machine(id=capture_id, spec=spec, image_path=str(image.path), disk_top="")
        port = free_port(self.ports)
        try:
            monitor = await self._open_template(
                self._template(model, image, folder), image, spec.disk_gib, f"tcp:{listen_host}:{port}"
            )
        except BaseException:
            await self.drop_capture(capture_id)
            raise
        self._receiving[capture_id] = monitor
        return capture_id, port

    async def finish_capture(self, capture_id: str) -> None:
        """Once the stream is in: the template's device state beside its RAM, the template gone."""
        monitor = self._receiving.pop(capture_id, None)
        if monitor is None:
            raise NotFound(f"capture {capture_id}: not being received here", field="capture")
        folder = self.captures_dir / capture_id
        try:
            await self._keep_template_state(monitor, folder)
        except BaseException:
            await monitor.close()
            await self.drop_capture(capture_id)
            raise
        await self._end_template(monitor, folder)

    async def drop_capture(self, capture_id: str) -> None:
        """Give up a capture being received (its sender failed)."""
        self._receiving.pop(capture_id, None)
        self._captures_in_use.pop(capture_id, None)
        self._capture_layers.pop(capture_id, None)
        folder = self.captures_dir / capture_id
        await stop_processes(folder / "template")
        shutil.rmtree(folder, ignore_errors=True)

    async def capture_to(self, vm_id: str, uri: str) -> tuple[str, float, int]:
        """Stream this instant of a running machine to a template elsewhere (``uri``: QEMU's
        ``tcp:HOST:PORT``) and export its disk; returns the exported layer's name, how long
        the source stood still, and the bytes of memory sent."""
        source = self._running(vm_id, "forked")
        image = await self._image(source.image_path)
        async with self._capture_lock(vm_id):
            self._check_not_deleted(source)
            if self.capture_method(source) == "background":
                await self._map_ram_in(source)
            frozen, pause_s, status = await self._send_instant(source, uri)
            sent = status.get("ram", {}).get("transferred", 0)
            layer = await self._export_chain(image, frozen[-1])
            with contextlib.suppress(BoxdError):
                await self._agent(vm_id).set_time()  # its guest clock stood still
            if len(source.disk_frozen) > MAX_FROZEN_LAYERS:
                await self._shorten_chain(source)
        log.info("capture sent source=%s uri=%s pause_ms=%.1f ram_bytes=%d layer=%s",
                 vm_id, uri, pause_s * 1000, sent, layer)
        return layer, pause_s, sent

    async def _export_chain(self, image: Image, newest: str) -> str:
        """The disk chain under ``newest``, as one compressed layer over the image, in the
        exports folder (garbage collection leaves it alone) under its content's name."""
        self.exports_dir.mkdir(exist_ok=True)
        partial = self.exports_dir / f".{secrets.token_hex(6)}.part"
        try:
            await run_tool("qemu-img", "convert", "-c", "-O", "qcow2", "-B", str(image.rootfs), "-F", "qcow2",
                           str(self.layers_dir / newest), str(partial))
            name = f"layer-{(await asyncio.to_thread(sha256_file, partial))[:32]}.qcow2"
            os.replace(partial, self.exports_dir / name)
        finally:
            partial.unlink(missing_ok=True)
        return name

    def export_chunk(self, name: str, offset: int, length: int) -> bytes:
        _layer_digest(name)
        return read_piece(self.exports_dir / name, offset, length)

    def drop_export(self, name: str) -> None:
        if EXPORTED_LAYER.match(name):
            (self.exports_dir / name).unlink(missing_ok=True)

    async def import_layer(self, capture_id: str, name: str, size: int, fetch: PieceReader, image_digest: str) -> int:
        """Copy another host's exported layer unless this host has it; it is checked against
        its name (its SHA-256) and put over this host's image, and kept for the forks of
        ``capture_id`` (a capture being received). Returns the bytes copied."""
        digest = _layer_digest(name)
        if capture_id not in self._captures_in_use:
            raise NotFound(f"capture {capture_id}: not being received here", field="capture")
        self._capture_layers[capture_id] = [name]
        if (self.layers_dir / name).exists():
            return 0
        image = await self._image(image_digest)
        partial = self.layers_dir / f"{name}.{secrets.token_hex(4)}.part"
        try:
            copied = await fetch_into(partial, size, fetch)
            if (await asyncio.to_thread(sha256_file, partial))[:32] != digest:
                raise VMError(f"layer {name}: the copy does not match its name (SHA-256)")
            await run_tool("qemu-img", "rebase", "-u", "-F", "qcow2", "-b", str(image.rootfs), str(partial))
            os.replace(partial, self.layers_dir / name)
        finally:
            partial.unlink(missing_ok=True)
        return copied

    def export_size(self, name: str) -> int:
        return (self.exports_dir / name).stat().st_size

    async def fork_from(self, capture_id: str, layer: str, spec: VMSpec, new_ids: list[str]) -> list[VMInfo]:
        """Start forks on a capture received from another host, their disks over ``layer``."""
        image = await self._image(spec.image)
        started: list[str] = []
        try:
            for new_id in new_ids:
                self._check_new_id(new_id)
                machine = self._new_machine(new_id, spec, str(image.path))
                started.append(new_id)
                await self._start_on_capture(machine, image, capture_id, layer)
        except BaseException:
            for new_id in started:
                await self._remove(new_id)
            raise
        finally:
            self._release(capture_id)
        return [await self.info(new_id) for new_id in new_ids]

    # -- idle machines ----------------------------------------------------------------

    async def suspend(self, vm_id: str) -> None:
        machine = self._running(vm_id, "suspended")
        if machine.suspended:
            return
        await (await self._monitor(vm_id)).execute("stop")
        machine.suspended = True
        self._save(machine)

    def _hibernation_file(self, vm_id: str) -> Path:
        return self._vm_dir(vm_id) / "hibernation.zst"

    async def hibernate(self, vm_id: str, *, keep_memory: bool = True) -> None:
        """Save RAM and device state (compressed) to the machine's folder, then end its QEMU.

        A fork or a restored machine lets go of its capture here: it wakes up owning
        its RAM, like any machine. Without ``keep_memory`` only the disk is kept (the
        guest's writes synced first): waking boots the machine from it.
        """
        machine = self._running(vm_id, "hibernated")
        async with self._capture_lock(vm_id):
            self._check_not_deleted(machine)
            if not keep_memory:
                with contextlib.suppress(BoxdError):  # a guest that cannot sync still gets its disk flushed
                    async for _ in self.exec(vm_id, ExecRequest(argv=["sync"], user="root", timeout=60)):
                        pass
            monitor = await self._monitor(vm_id)
            await monitor.execute("stop")  # QEMU flushes the disk layers as it stops
            try:
                if keep_memory:
                    await self._save_memory(monitor, vm_id)
            except BaseException:
                await resume(monitor)
                raise
            machine.hibernated, machine.suspended, machine.ram_capture = True, False, None
            self._save(machine)  # from here on, a crash leaves a machine that wakes from the file
            await self._disconnect(vm_id)
            await stop_process(machine.pid, self._marker(vm_id))
            await stop_processes(self._run_dir(vm_id))
            shutil.rmtree(self._run_dir(vm_id), ignore_errors=True)  # the RAM file with it
            machine.pid = None
        await self.collect_garbage()
        log.info("machine hibernated id=%s memory_kept=%s", vm_id, keep_memory)

    async def _save_memory(self, monitor: Monitor, vm_id: str) -> None:
        """RAM and device state of a stopped machine into its hibernation file."""
        saving = self._hibernation_file(vm_id)
        try:
            # All of the RAM goes to the file, whether it is the machine's or a capture's.
            await set_capabilities(monitor, x_ignore_shared=False, background_snapshot=False)
            await monitor.execute("migrate-set-parameters", {"max-bandwidth": UNLIMITED_BANDWIDTH})
            await monitor.execute("migrate", {"uri": f"exec:{zstd_binary()} -q -1 -T0 -o {saving}.part"})
            await wait_migration(monitor, {"completed"}, timeout=600)
            await asyncio.to_thread(fsync_path, Path(f"{saving}.part"))
            os.replace(f"{saving}.part", saving)
        except BaseException:
            Path(f"{saving}.part").unlink(missing_ok=True)
            raise

    async def resume(self, vm_id: str) -> None:
        machine = self._machine(vm_id)
        if machine.hibernated:
            await self._wake(machine)
        elif machine.suspended:
            await (await self._monitor(vm_id)).execute("cont")
            machine.suspended = False
            # Neither the record (a stale "suspended" only makes a later resume send a
            # harmless cont) nor the guest clock, which stood still, is worth a wake's wait.
            asyncio.get_running_loop().call_soon(self._save, machine)
            self._in_background(self._agent(vm_id).set_time())

    async def _wake(self, machine: Machine) -> None:
        """Back from its hibernation file, or, hibernated without its memory, booted from its disk."""
        image = await self._image(machine.image_path)
        saved = self._hibernation_file(machine.id)
        memory_kept = saved.exists()
        async with self._capture_lock(machine.id):
            self._check_not_deleted(machine)
            self._check_room(machine.spec)
            machine.top_node = "root"  # a new QEMU names its top layer afresh
            machine.pid = await self._start_processes(self._launch(machine, image, incoming=memory_kept))
            if memory_kept:
                monitor = await self._monitor(machine.id)
                await monitor.execute("migrate-incoming", {"uri": f"exec:{zstd_binary()} -q -d -c {saved}"})
                await wait_incoming(monitor, timeout=600)
                await monitor.execute("cont")
            machine.hibernated = False
            self._save(machine)
            saved.unlink(missing_ok=True)
        log.info("machine woke id=%s pid=%s memory_kept=%s", machine.id, machine.pid, memory_kept)
