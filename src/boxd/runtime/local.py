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
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boxd.config import boxd_home, shm_dir, vms_dir
from boxd.errors import AgentUnavailable, Conflict, HostError, InvalidInput, NotFound, Timeout, VMError
from boxd.guest.image import Image, load_image
from boxd.runtime.accel import Accelerator, detect_accelerator
from boxd.runtime.agent_client import AgentClient, ExecEvent
from boxd.runtime.interface import ExecRequest, VMInfo, VMSpec, VMState
from boxd.runtime.qemu import Launch, create_overlay, kill_qemu, process_alive, read_pid, start_qemu

log = logging.getLogger(__name__)

VM_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
QBOOT = Path("/usr/share/qemu/qboot.rom")


@dataclass
class Machine:
    """What the runtime knows of one machine, persisted as machine.json."""

    id: str
    spec: VMSpec
    image_path: str
    disk_top: str
    disk_frozen: list[str] = field(default_factory=list)
    pid: int | None = None
    paused: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "spec": self.spec.to_dict(),
            "image_path": self.image_path,
            "disk_top": self.disk_top,
            "disk_frozen": self.disk_frozen,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Machine":
        return cls(
            id=data["id"],
            spec=VMSpec.from_dict(data["spec"]),
            image_path=data["image_path"],
            disk_top=data["disk_top"],
            disk_frozen=list(data.get("disk_frozen", [])),
        )


class LocalRuntime:
    def __init__(self, home: Path | None = None, *, accelerator: Accelerator | None = None) -> None:
        self.home = Path(home) if home else boxd_home()
        self.vms_dir = vms_dir(self.home)
        self.layers_dir = self.home / "layers"
        self.shm_dir = shm_dir(self.home)
        for folder in (self.vms_dir, self.layers_dir, self.shm_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self.accelerator = accelerator or detect_accelerator()
        self._machines: dict[str, Machine] = {}
        self._agents: dict[str, AgentClient] = {}
        self._layers_lock = asyncio.Lock()
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
        values: dict[str, Any] = dict(
            name=machine.id,
            run_dir=run_dir,
            ram_file=run_dir / "ram",
            ram_shared=True,
            disk=self.layers_dir / machine.disk_top,
            kernel=image.kernel,
            initrd=image.initrd,
            console_log=self.console_log(machine.id),
            accelerator=self.accelerator,
            vcpus=machine.spec.vcpus,
            memory_mib=machine.spec.memory_mib,
            isolated=machine.spec.isolated,
            bios=QBOOT if QBOOT.exists() else None,
        )
        values.update(overrides)
        return Launch(**values)

    def _save(self, machine: Machine) -> None:
        path = self._vm_dir(machine.id) / "machine.json"
        partial = path.with_suffix(".json.part")
        partial.write_text(json.dumps(machine.to_dict(), indent=2))
        os.replace(partial, path)

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

    async def create(self, vm_id: str, spec: VMSpec) -> VMInfo:
        if not VM_ID.match(vm_id):
            raise InvalidInput(f"id: {vm_id!r} is not a valid machine id", field="id")
        if self._vm_dir(vm_id).exists():
            raise Conflict(f"machine {vm_id}: already exists", field="id")
        image = load_image(spec.image, home=self.home)
        self._check_room(spec)
        machine = Machine(id=vm_id, spec=spec, image_path=str(image.path), disk_top=f"{vm_id}-{secrets.token_hex(4)}.qcow2")
        self._vm_dir(vm_id).mkdir(parents=True)
        self._machines[vm_id] = machine
        try:
            await create_overlay(self.layers_dir / machine.disk_top, image.rootfs, spec.disk_gib)
            self._save(machine)
            machine.pid = await start_qemu(self._launch(machine, image))
        except BaseException:
            await self._remove(vm_id)
            raise
        log.info("machine started id=%s pid=%s", vm_id, machine.pid)
        return await self.info(vm_id)

    def _check_room(self, spec: VMSpec) -> None:
        shm = os.statvfs(self.shm_dir)
        free_mib = shm.f_bavail * shm.f_frsize // (1024 * 1024)
        if free_mib < spec.memory_mib:
            raise HostError(
                f"memory: {spec.memory_mib} MiB of guest RAM asked, {free_mib} MiB free in {self.shm_dir}",
                field="memory_mib",
            )
        disk = os.statvfs(self.layers_dir)
        if disk.f_bavail * disk.f_frsize < 256 * 1024 * 1024:
            raise HostError(f"disk: less than 256 MiB free under {self.layers_dir}")

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
        if process_alive(machine.pid, self._marker(vm_id)):
            state = VMState.PAUSED if machine.paused else VMState.RUNNING
        else:
            state = VMState.FAILED
        return VMInfo(
            id=vm_id,
            state=state,
            pid=machine.pid,
            accelerator=self.accelerator.name,
            console_log=str(self.console_log(vm_id)),
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
                if not process_alive(machine.pid, self._marker(vm_id)):
                    raise VMError(
                        f"machine {vm_id}: QEMU exited while booting; console: {self._console_tail(vm_id)}"
                    )
                await asyncio.wait({connecting}, timeout=0.1)
            connecting.result()
        except AgentUnavailable:
            raise Timeout(
                f"machine {vm_id}: not ready after {timeout:.0f} s; console: {self._console_tail(vm_id)}"
            ) from None
        finally:
            if not connecting.done():
                connecting.cancel()
                with contextlib.suppress(BaseException):
                    await connecting

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
        await self._remove(vm_id)
        log.info("machine deleted id=%s", vm_id)

    async def _remove(self, vm_id: str) -> None:
        """The one cleanup path, for deletes and for failed starts alike."""
        machine = self._machines.pop(vm_id, None)
        agent = self._agents.pop(vm_id, None)
        if agent is not None:
            await agent.close()
        pid = machine.pid if machine else read_pid(self._run_dir(vm_id) / "qemu.pid")
        await kill_qemu(pid, self._marker(vm_id))
        shutil.rmtree(self._run_dir(vm_id), ignore_errors=True)
        shutil.rmtree(self._vm_dir(vm_id), ignore_errors=True)
        await self.collect_layers()

    async def collect_layers(self) -> None:
        """Remove disk layers that no machine's chain uses any more."""
        async with self._layers_lock:
            used: set[str] = set()
            for record in self.vms_dir.glob("*/machine.json"):
                with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                    data = json.loads(record.read_text())
                    used.add(data["disk_top"])
                    used.update(data.get("disk_frozen", []))
            for layer in self.layers_dir.glob("*.qcow2"):
                if layer.name not in used:
                    layer.unlink(missing_ok=True)

    async def close(self) -> None:
        """Let go of connections; machines keep running (they outlive the daemon)."""
        for agent in list(self._agents.values()):
            await agent.close()
        self._agents.clear()

    # -- inside the guest -------------------------------------------------------------

    async def exec(self, vm_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        async for event in self._agent(vm_id).exec(
            argv=request.argv,
            shell=request.shell,
            env=request.env,
            cwd=request.cwd,
            user=request.user,
            stdin=request.stdin,
            timeout=request.timeout,
        ):
            yield event

    async def write_file(
        self, vm_id: str, path: str, chunks: AsyncIterator[bytes], *, mode: int | None = None, user: str | None = None
    ) -> int:
        return await self._agent(vm_id).write_file(path, chunks, mode=mode, user=user)

    async def read_file(self, vm_id: str, path: str) -> AsyncIterator[bytes]:
        async for chunk in self._agent(vm_id).read_file(path):
            yield chunk

    async def fs(self, vm_id: str, op: str, **fields: Any) -> dict[str, Any]:
        if op not in {"stat", "list_dir", "make_dir", "remove", "move"}:
            raise InvalidInput(f"op: unknown file operation {op!r}", field="op")
        answer = await self._agent(vm_id).call(op, **fields)
        answer.pop("id", None)
        answer.pop("type", None)
        return answer
