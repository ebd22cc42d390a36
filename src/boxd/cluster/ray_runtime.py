"""The runtime interface over a Ray cluster: placement, routing, hosts that come and go.

``RayRuntime`` keeps one host agent on every live node that offers ``boxd_host`` (it
starts the missing ones itself, so a new node joins on its own), places each new machine
on the best of K hosts by what they report, and sends every later call about a machine
to the host that owns it. Forks land on their source's host. A node that dies takes its
machines with it: ``lost()`` names them, and the daemon marks them lost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from boxd.cluster.host_agent import HostAgent
from boxd.cluster.placement import HostLoad, candidates
from boxd.config import DEFAULT_USER
from boxd.errors import BoxdError, HostError, NotFound, VMError
from boxd.runtime.agent_client import ExecEvent
from boxd.runtime.interface import CheckpointTaken, ExecRequest, VMInfo, VMSpec
from boxd.runtime.snapshots import SnapshotManifest

log = logging.getLogger(__name__)

HOST_RESOURCE = "boxd_host"
# A node may also say how much guest RAM its host may commit (default: its RAM).
MEMORY_RESOURCE = "boxd_memory_mib"
NAMESPACE = "boxd"
CHECK_EVERY_S = 2.0
INFO_TIMEOUT_S = 10.0  # a host that does not say how a machine is within this is taken as unreachable
UPLOAD_PART = 1024 * 1024
MOVED_KEPT = 256


@dataclasses.dataclass
class _Host:
    name: str
    node_id: str
    address: str  # the node's IP: where a migration to it goes
    handle: Any  # the actor
    alive: bool = True


def agent_name(node_id: str) -> str:
    return f"boxd-host-{node_id[:16]}"


class RayRuntime:
    def __init__(
        self,
        address: str | None,
        *,
        host_root: Path,
        api_address: tuple[str, int] | None = None,
        daemon_home: Path | None = None,
        ports: range | None = None,
        check_every_s: float = CHECK_EVERY_S,
    ) -> None:
        """``host_root``: each node's agent keeps its state in ``host_root/<node id>``
        (on that node's own disk); ``daemon_home``: the daemon's, whose guest images a
        node that can see them uses instead of building its own; ``ports``: the range each
        host's machine URLs and incoming forks take their ports from, on that host."""
        self.address = address
        self.host_root = Path(host_root)
        self.api_address = api_address
        self.daemon_home = daemon_home
        self.ports = ports
        self.check_every_s = check_every_s
        self._hosts: dict[str, _Host] = {}
        self._owners: dict[str, str] = {}  # machine -> host
        self._snapshot_hosts: dict[str, set[str]] = {}  # digest -> hosts holding it
        # Memory promised to creates still under way: a burst must not all see the same room.
        self._reserved_mib: dict[str, int] = {}
        # What the latest forks across hosts carried (benchmarks read it); bounded, as a daemon runs long.
        self.moved: collections.deque[dict[str, Any]] = collections.deque(maxlen=MOVED_KEPT)
        self._watch: asyncio.Task | None = None

    # -- hosts ------------------------------------------------------------------------

    async def start(self) -> None:
        if not ray.is_initialized():
            ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False,
                     logging_level=logging.WARNING, configure_logging=False)
        await self.refresh_hosts()
        for host in self._live_hosts():
            for vm_id in await self._ask(host, host.handle.machine_ids.remote()):
                self._owners[vm_id] = host.name
            for digest in await self._ask(host, host.handle.snapshot_digests.remote()):
                self._snapshot_hosts.setdefault(digest, set()).add(host.name)
        self._watch = asyncio.create_task(self._watch_hosts(), name="ray-hosts")

    def _live_hosts(self) -> list[_Host]:
        return [host for host in self._hosts.values() if host.alive]

    async def refresh_hosts(self) -> None:
        """Start an agent on every live node that offers hosts; note the nodes that died."""
        nodes = await asyncio.to_thread(ray.nodes)
        alive = {node["NodeID"] for node in nodes if node["Alive"]}
        for node in nodes:
            node_id = node["NodeID"]
            name = agent_name(node_id)
            resources = node["Resources"]
            if node_id in alive and resources.get(HOST_RESOURCE, 0) >= 1 and name not in self._hosts:
                capacity = resources.get(MEMORY_RESOURCE)
                handle = self._deploy(node_id, int(capacity) if capacity else None)
                self._hosts[name] = _Host(name, node_id, node["NodeManagerAddress"], handle)
                log.info("host %s joined on node %s", name, node_id)
        for host in self._hosts.values():
            if host.alive and host.node_id not in alive:
                host.alive = False
                log.warning("host %s is gone with its node %s", host.name, host.node_id)

    def _deploy(self, node_id: str, capacity_mib: int | None) -> Any:
        agent = ray.remote(HostAgent).options(
            name=agent_name(node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            resources={HOST_RESOURCE: 1}, num_cpus=0, max_concurrency=1000,
            max_restarts=-1,  # a crashed agent comes back on its node and adopts its machines
        )
        daemon_home = str(self.daemon_home) if self.daemon_home else None
        return agent.remote(agent_name(node_id), node_id, str(self.host_root / node_id[:16]),
                            self.api_address, daemon_home, capacity_mib, self.ports)

    async def _watch_hosts(self) -> None:
        while True:
            await asyncio.sleep(self.check_every_s)
            try:
                await self.refresh_hosts()
            except Exception as error:  # the GCS may be restarting: look again later
                log.warning("cannot list the cluster's nodes: %s", error)

    async def loads(self) -> list[HostLoad]:
        answers = await asyncio.gather(
            *(self._ask(host, host.handle.load.remote()) for host in self._live_hosts()), return_exceptions=True
        )
        return [
            dataclasses.replace(answer, committed_mib=answer.committed_mib + self._reserved_mib.get(answer.host, 0))
            for answer in answers
            if isinstance(answer, HostLoad)
        ]

    def host_of(self, vm_id: str) -> str | None:
        return self._owners.get(vm_id)

    async def lost(self) -> list[str]:
        return [vm_id for vm_id, name in self._owners.items() if not self._hosts[name].alive]

    async def close(self) -> None:
        """Stop watching; the agents and their machines keep running."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch

    # -- calls ------------------------------------------------------------------------

    async def _ask(self, host: _Host, reference: Any) -> Any:
        """An agent's answer; its boxd errors come back as themselves."""
        try:
            return await reference
        except ray.exceptions.RayTaskError as error:
            cause = error.cause
            if isinstance(cause, BoxdError):
                raise cause from None
            raise VMError(f"host {host.name}: {type(cause).__name__}: {cause}") from None
        except ray.exceptions.RayError as error:  # the actor died, its node is gone, it cannot be placed...
            raise HostError(f"host {host.name} cannot be reached: {type(error).__name__}") from None

    def _owner(self, vm_id: str) -> _Host:
        name = self._owners.get(vm_id)
        if name is None:
            raise NotFound(f"machine {vm_id}: on no host")
        host = self._hosts[name]
        if not host.alive:
            raise HostError(f"machine {vm_id}: its host {name} is gone")
        return host

    async def _call(self, vm_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        host = self._owner(vm_id)
        return await self._ask(host, host.handle.call.remote(method, vm_id, *args, **kwargs))

    def _info(self, info: VMInfo, host: _Host) -> VMInfo:
        return dataclasses.replace(info, host=host.name)

    async def _stream(self, vm_id: str, start: Callable[[Any], Any]) -> AsyncIterator[Any]:
        """What one of the agent's streaming calls yields; an agent that dies ends it with HostError."""
        host = self._owner(vm_id)
        references = start(host.handle)
        while True:
            try:
                reference = await anext(references)
            except StopAsyncIteration:
                return
            except ray.exceptions.RayError as error:
                raise HostError(f"host {host.name} cannot be reached: {type(error).__name__}") from None
            yield await self._ask(host, reference)

    # -- the runtime interface --------------------------------------------------------

    async def create(
        self, vm_id: str, spec: VMSpec, *, snapshot: str | None = None, host: str | None = None
    ) -> VMInfo:
        """On ``host`` or else the best host for it; from a snapshot, that host first copies
        the snapshot from one that holds it, if it does not hold it itself."""
        loads = await self.loads()
        if host is not None:
            pinned = await self._live_host(host)
            loads = [load for load in loads if load.host == pinned.name]
        tried = []
        for load in candidates(loads, spec.memory_mib):
            target = self._hosts[load.host]
            self._reserved_mib[target.name] = self._reserved_mib.get(target.name, 0) + spec.memory_mib
            try:
                if snapshot is not None:
                    await self._bring_snapshot(snapshot, target)
                info = await self._ask(target, target.handle.call.remote("create", vm_id, spec, snapshot=snapshot))
            except HostError as error:  # full after all (disk, tmpfs): the next one
                tried.append(f"{target.name}: {error.message}")
                continue
            finally:
                self._reserved_mib[target.name] -= spec.memory_mib
            self._owners[vm_id] = target.name
            return self._info(info, target)
        where = "; ".join(tried) or f"{len(loads)} host(s) up, none with {spec.memory_mib} MiB to spare"
        raise HostError(f"memory_mib: no host can take this machine ({where})", field="memory_mib")

    async def adopt(self, vm_id: str) -> VMInfo:
        host = self._owner(vm_id)
        return self._info(await self._call(vm_id, "adopt"), host)

    async def info(self, vm_id: str) -> VMInfo:
        try:
            info = await asyncio.wait_for(self._call(vm_id, "info"), INFO_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise HostError(f"machine {vm_id}: its host {self._owners.get(vm_id)} does not answer") from None
        return self._info(info, self._owner(vm_id))

    async def wait_ready(self, vm_id: str, timeout: float) -> None:
        await self._call(vm_id, "wait_ready", timeout)

    def exec(self, vm_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        return self._stream(vm_id, lambda agent: agent.exec.remote(vm_id, request))

    def attach(self, vm_id: str, pid: int) -> AsyncIterator[ExecEvent]:
        return self._stream(vm_id, lambda agent: agent.attach.remote(vm_id, pid))

    def read_file(self, vm_id: str, path: str) -> AsyncIterator[bytes]:
        return self._stream(vm_id, lambda agent: agent.read_file.remote(vm_id, path))

    def watch(self, vm_id: str, path: str, *, recursive: bool = False) -> AsyncIterator[tuple[str, str]]:
        return self._stream(vm_id, lambda agent: agent.watch.remote(vm_id, path, recursive))

    async def write_file(
        self, vm_id: str, path: str, chunks: AsyncIterator[bytes], *, mode: int | None = None, user: str = DEFAULT_USER
    ) -> int:
        host = self._owner(vm_id)
        upload = await self._ask(host, host.handle.begin_upload.remote(vm_id, path, mode, user))
        try:
            async for chunk in chunks:
                for start in range(0, len(chunk), UPLOAD_PART):
                    await self._ask(host, host.handle.upload_part.remote(upload, chunk[start : start + UPLOAD_PART]))
            return await self._ask(host, host.handle.end_upload.remote(upload))
        except BaseException:
            with contextlib.suppress(BoxdError):
                await self._ask(host, host.handle.abort_upload.remote(upload))
            raise

    async def fs(self, vm_id: str, op: str, **fields: Any) -> dict[str, Any]:
        return await self._call(vm_id, "fs", op, **fields)

    async def process(self, vm_id: str, op: str, **fields: Any) -> dict[str, Any]:
        return await self._call(vm_id, "process", op, **fields)

    async def fork(self, source_id: str, new_ids: list[str], *, host: str | None = None) -> list[VMInfo]:
        """Forks land on ``host``, or on their source's host while it has room (one capture
        there serves them all), or else on the best other host."""
        source = self._owner(source_id)
        spec: VMSpec = await self._call(source_id, "spec_of")
        if host is not None:
            target = await self._live_host(host)
        else:
            target = await self._fork_target(source, spec.memory_mib * len(new_ids))
        if target is source:
            infos = await self._call(source_id, "fork", new_ids)
        else:
            infos = await self._fork_across(source, source_id, spec, target, new_ids)
        for info in infos:
            self._owners[info.id] = target.name
        return [self._info(info, target) for info in infos]

    async def hosts(self) -> list[str]:
        return sorted(host.name for host in self._live_hosts())

    async def _live_host(self, name: str) -> _Host:
        host = self._hosts.get(name)
        if host is None or not host.alive:
            raise NotFound(f"host: no live host {name} (hosts: {', '.join(await self.hosts())})", field="host")
        return host

    async def _fork_target(self, source: _Host, memory_mib: int) -> _Host:
        loads = {load.host: load for load in await self.loads()}
        if source.name in loads and loads[source.name].headroom_mib >= memory_mib:
            return source
        others = candidates([load for name, load in loads.items() if name != source.name], memory_mib)
        if not others:
            raise HostError(f"memory_mib: no host can take {memory_mib} MiB of forks", field="memory_mib")
        return self._hosts[others[0].host]

    async def _fork_across(self, source: _Host, source_id: str, spec: VMSpec, target: _Host,
                           new_ids: list[str]) -> list[VMInfo]:
        """The source streams an instant of itself into a template on the target (QEMU
        migration over TCP) and exports its disk chain as one layer, which the target
        copies unless it has it; then the forks start on the target."""
        started = time.monotonic()
        capture_id, port = await self._ask(target, target.handle.call.remote("receive_capture", spec, target.address))
        try:
            layer, pause_s, ram_bytes = await self._ask(
                source, source.handle.call.remote("capture_to", source_id, f"tcp:{target.address}:{port}")
            )
        except BaseException:
            with contextlib.suppress(BoxdError):
                await self._ask(target, target.handle.call.remote("drop_capture", capture_id))
            raise
        try:
            size = await self._ask(source, source.handle.call.remote("export_size", layer))
            _, copied = await asyncio.gather(
                self._ask(target, target.handle.call.remote("finish_capture", capture_id)),
                self._ask(target, target.handle.import_layer.remote(capture_id, layer, size, source.handle,
                                                                    spec.image)),
            )
            infos = await self._ask(target, target.handle.call.remote("fork_from", capture_id, layer, spec, new_ids))
        except BaseException:
            # Nothing is started on the capture now; the target lets go of its RAM and layer.
            with contextlib.suppress(BoxdError):
                await self._ask(target, target.handle.call.remote("drop_capture", capture_id))
            raise
        finally:
            with contextlib.suppress(BoxdError):
                await self._ask(source, source.handle.call.remote("drop_export", layer))
        log.info("fork across hosts source=%s from=%s to=%s pause_ms=%.1f ram_bytes=%d layer_bytes=%d seconds=%.2f",
                 source_id, source.name, target.name, pause_s * 1000, ram_bytes, copied, time.monotonic() - started)
        self.moved.append({"source": source_id, "ram_bytes": ram_bytes, "layer_bytes": copied, "pause_s": pause_s})
        return infos

    async def delete(self, vm_id: str) -> None:
        await self._call(vm_id, "delete")
        self._owners.pop(vm_id, None)

    async def checkpoint(self, vm_id: str) -> CheckpointTaken:
        return await self._call(vm_id, "checkpoint")

    async def restore(self, vm_id: str, checkpoint_id: str) -> VMInfo:
        return self._info(await self._call(vm_id, "restore", checkpoint_id), self._owner(vm_id))

    async def drop_checkpoint(self, vm_id: str, checkpoint_id: str) -> None:
        await self._call(vm_id, "drop_checkpoint", checkpoint_id)

    async def save_snapshot(
        self, vm_id: str, checkpoint_id: str, progress: Callable[[int, int], None] | None = None
    ) -> SnapshotManifest:
        """Written on the machine's host; new machines from it are placed there."""
        manifest = await self._call(vm_id, "save_snapshot", checkpoint_id)
        self._snapshot_hosts.setdefault(manifest.digest, set()).add(self._owner(vm_id).name)
        return manifest

    async def _bring_snapshot(self, digest: str, host: _Host) -> None:
        holders = self._snapshot_hosts.setdefault(digest, set())
        if host.name in holders:
            return
        sources = [self._hosts[name] for name in holders if self._hosts[name].alive]
        if not sources:
            raise NotFound(f"snapshot {digest[:12]}: no live host holds it", field="snapshot")
        copied = await self._ask(host, host.handle.fetch_snapshot.remote(digest, sources[0].handle))
        holders.add(host.name)
        log.info("snapshot %s copied from %s to %s: %d bytes", digest[:12], sources[0].name, host.name, copied)

    async def delete_snapshot(self, digest: str) -> None:
        for name in self._snapshot_hosts.pop(digest, set()):
            host = self._hosts[name]
            if host.alive:
                await self._ask(host, host.handle.call.remote("delete_snapshot", digest))

    async def suspend(self, vm_id: str) -> None:
        await self._call(vm_id, "suspend")

    async def hibernate(self, vm_id: str, *, keep_memory: bool = True) -> None:
        await self._call(vm_id, "hibernate", keep_memory=keep_memory)

    async def resume(self, vm_id: str) -> None:
        await self._call(vm_id, "resume")

    async def collect_garbage(self) -> None:
        for host in self._live_hosts():
            await self._ask(host, host.handle.call.remote("collect_garbage"))
