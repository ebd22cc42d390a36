"""E2B sandboxes as boxd machines: what each control-plane call does to them.

A sandbox is a machine this API created, with a row of its own (template, metadata,
environment, the token its envd calls carry, when it expires). It never sleeps for being
idle; ``pause`` hibernates it (its memory and processes to disk, or its disk alone, nothing
held) and clears its expiry until it is resumed; a sandbox whose time runs out is killed, or
paused if it asked for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal, TypeVar

from pydantic import field_validator

from boxd.daemon.e2b import control_wire as wire
from boxd.daemon.logs import event
from boxd.daemon.machines import MachineService
from boxd.daemon.snapshots import SnapshotService
from boxd.daemon.store import SandboxRecord, Store
from boxd.errors import AgentUnavailable, AuthError, BoxdError, Conflict, InvalidInput, NotFound, Unreachable
from boxd.models import ExecBody, Machine, MachineCreate, MachineFork, MachineState, SnapshotCreate, SnapshotState

log = logging.getLogger(__name__)

# The templates that mean "boxd's own image"; any other templateID names a snapshot.
IMAGE_TEMPLATES = frozenset({"base", "boxd"})
EXPIRY_CHECK_S = 1.0
SNAPSHOT_POLL_S = 0.2
GUEST_CHECK_S = 5.0  # how long a guest agent has to answer before a pause that needs it is refused
_PAUSED = (MachineState.PAUSED, MachineState.STOPPED)
_GONE = (MachineState.FAILED, MachineState.LOST)  # kept on record, but no sandbox any more
Item = TypeVar("Item")


@dataclass(frozen=True)
class SandboxQuery:
    """Which sandboxes a list asks for, by E2B's filters (all of them must hold)."""

    metadata: dict[str, str] = field(default_factory=dict)
    states: frozenset[str] = frozenset({"running", "paused"})
    started_after: datetime | None = None  # at or after; naive means UTC
    template: str | None = None

    def matches(self, record: SandboxRecord, machine: Machine) -> bool:
        if _state(machine) not in self.states:
            return False
        if any(record.metadata.get(key) != value for key, value in self.metadata.items()):
            return False
        if self.started_after is not None:
            bound = self.started_after if self.started_after.tzinfo else self.started_after.replace(tzinfo=UTC)
            if machine.created_at < bound:
                return False
        return self.template is None or _same_template(record.template, self.template)


@dataclass(frozen=True)
class Target:
    """The machine an envd call is for, and whose it is."""

    machines: MachineService
    account: str
    machine: str
    env: dict[str, str]


def _state(machine: Machine) -> str:
    return "paused" if machine.state in _PAUSED else "running"


def _same_template(asked: str, other: str) -> bool:
    return asked == other or (asked in IMAGE_TEMPLATES and other in IMAGE_TEMPLATES)


def page_of(items: Sequence[Item], ids: Sequence[str], limit: int, after: str | None) -> tuple[list[Item], str | None]:
    """One page of ``items`` and the token of the next (the id of its first item), if any."""
    start = 0
    if after is not None:
        if after not in ids:
            raise InvalidInput(f"nextToken: {after!r} is not a token this server gave", field="nextToken")
        start = ids.index(after)
    following = ids[start + limit] if start + limit < len(ids) else None
    return list(items[start : start + limit]), following


class _E2BSnapshotCreate(SnapshotCreate):
    """A snapshot saved through the E2B API takes E2B's name rule, which allows '_' too."""

    @field_validator("name")
    @classmethod
    def _name_is_a_label(cls, name: str) -> str:  # replaces boxd's own rule (a DNS label)
        return wire.check_snapshot_name(name)


def parse_metadata_filter(query: str | None) -> dict[str, str]:
    """``metadata=k%3Dv%26k2%3Dv2``: the SDK url-encodes key=value pairs, each quoted."""
    if not query:
        return {}
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    return {urllib.parse.unquote(key): urllib.parse.unquote(value) for key, value in pairs}


class SandboxService:
    def __init__(self, store: Store, machines: MachineService, snapshots: SnapshotService) -> None:
        self._store = store
        self.machines = machines
        self._snapshots = snapshots
        self._expiry_watch: asyncio.Task | None = None

    # -- lookups ----------------------------------------------------------------------

    def _find(self, account: str, sandbox_id: str) -> tuple[SandboxRecord, Machine]:
        """An alive sandbox of this account; any other is not found (as E2B says it)."""
        record = self._store.find_sandbox(sandbox_id)
        try:
            machine = self._store.find_machine(account, sandbox_id) if record else None
        except NotFound:
            machine = None
        if record is None or machine is None or machine.state in _GONE:
            raise NotFound(f"sandbox {sandbox_id} was not found", field="sandboxID")
        return record, machine

    async def envd_target(self, sandbox_id: str | None, token: str | None) -> Target:
        """The sandbox an envd call names (``E2b-Sandbox-Id``), if its token is right.
        Without the header the token alone names it: e2b 2.7's ``Sandbox.connect`` sends
        no sandbox id, and every sandbox has a token of its own."""
        if not token:
            raise AuthError("X-Access-Token: missing; envd calls carry the sandbox's envdAccessToken")
        if not sandbox_id:
            record = self._store.find_sandbox_by_token(token)
            if record is None:
                raise AuthError("X-Access-Token: not the envd access token of any sandbox")
            sandbox_id = record.machine
        record = self._store.find_sandbox(sandbox_id)
        if record is None:
            raise Unreachable(f"The sandbox {sandbox_id} was not found")
        if not hmac.compare_digest(token, record.access_token):
            raise AuthError("X-Access-Token: not this sandbox's envd access token")
        account = self._store.account_of(sandbox_id)
        try:
            machine = self._store.find_machine(account, sandbox_id)
        except NotFound:
            raise Unreachable(f"The sandbox {sandbox_id} was not found") from None
        if machine.state in _GONE:
            raise Unreachable(f"The sandbox {sandbox_id} was not found: its machine is {machine.state.value} "
                              f"({machine.reason})")
        return Target(self.machines, account, machine.id, record.env)

    def signer_of(self, signed_with: Callable[[str], bool], sandbox_id: str | None) -> SandboxRecord | None:
        """The sandbox whose envd access token made a signature (``signed_with`` checks one
        token): the one named, else any, since a signed file URL need not name its sandbox."""
        if sandbox_id:
            record = self._store.find_sandbox(sandbox_id)
            return record if record is not None and signed_with(record.access_token) else None
        return next((record for record, _ in self._store.live_sandboxes() if signed_with(record.access_token)), None)

    def _answer(self, record: SandboxRecord) -> wire.Sandbox:
        return wire.Sandbox(template_id=record.template, sandbox_id=record.machine,
                            envd_access_token=record.access_token)

    def _detail(self, record: SandboxRecord, machine: Machine, *, with_token: bool) -> wire.SandboxDetail:
        ends = record.expires_at if record.expires_at is not None else time.time() + wire.MAX_TIMEOUT_S
        return wire.SandboxDetail(
            template_id=record.template,
            sandbox_id=machine.id,
            alias=machine.name,
            started_at=machine.created_at,
            end_at=datetime.fromtimestamp(ends, tz=UTC),
            envd_access_token=record.access_token if with_token else None,
            cpu_count=machine.vcpus,
            memory_mb=machine.memory_mib,
            disk_size_mb=machine.disk_gib * 1024,
            metadata=record.metadata,
            state=_state(machine),
        )

    # -- sandboxes --------------------------------------------------------------------

    async def create(self, account: str, request: wire.NewSandbox) -> wire.Sandbox:
        from_snapshot = None
        if request.template_id not in IMAGE_TEMPLATES:
            try:
                snapshot = self._store.find_snapshot(account, request.template_id)
            except NotFound:
                raise NotFound(
                    f"template {request.template_id} was not found: use 'base' (boxd's image) or a snapshot's "
                    "name, NAME@VERSION or id", field="templateID",
                ) from None
            if snapshot.state is not SnapshotState.READY:
                raise Conflict(f"snapshot {snapshot.ref} is {snapshot.state.value}", field="templateID")
            from_snapshot = snapshot.ref
        # No idle sleeping: a sandbox's life is its timeout and its pauses, as in E2B.
        machine = await self.machines.create(account, MachineCreate(
            name=_new_name(), isolated=request.isolated, from_snapshot=from_snapshot,
            suspend_after_s=0, hibernate_after_s=0,
        ))
        record = SandboxRecord(
            machine=machine.id, template=request.template_id, metadata=request.metadata, env=request.env_vars,
            access_token=secrets.token_urlsafe(32), expires_at=self._booting_expiry(request.timeout),
            auto_pause=request.auto_pause, auto_pause_memory=request.auto_pause_memory,
        )
        return await self._ready(account, machine, record, request.timeout)

    def _booting_expiry(self, timeout_s: int) -> float:
        """A sandbox's time runs from when it is up (as in E2B, where that is at once); this
        bound only holds while it boots, should the daemon stop meanwhile."""
        return time.time() + self.machines.limits.ready_timeout_s + timeout_s

    async def _ready(self, account: str, machine: Machine, record: SandboxRecord, timeout_s: int) -> wire.Sandbox:
        """Record a new sandbox and wait for its machine, whose ``timeout_s`` then starts;
        one that never comes up is deleted."""
        self._store.add_sandbox(record)
        try:
            await self.machines.wait_ready(account, machine.id, self.machines.limits.ready_timeout_s)
        except BaseException:
            with contextlib.suppress(BoxdError):
                await self.machines.delete(account, machine.id)
            raise
        self._store.set_sandbox_expiry(machine.id, time.time() + timeout_s)
        event(log, "e2b.sandbox_created", machine=machine.id, template=record.template)
        return self._answer(record)

    async def connect(
        self, account: str, sandbox_id: str, timeout: int, *, memory: bool = True
    ) -> tuple[wire.Sandbox, bool]:
        """Resume the sandbox if it is paused; its time is extended, never shortened.
        Returns whether it had to be resumed. ``memory=False`` (boot a paused sandbox from
        its disk) is refused: boxd cannot drop the memory a pause kept."""
        record, machine = self._find(account, sandbox_id)
        was_paused = machine.state in _PAUSED
        if was_paused and not memory:
            raise InvalidInput("memory: boxd cannot drop a paused sandbox's memory when resuming it", field="memory")
        await self.machines.resume(account, sandbox_id)
        await self.machines.wait_ready(account, sandbox_id, self.machines.limits.ready_timeout_s)
        expires = time.time() + timeout
        # A paused sandbox had no expiry; a running one without one (made before timeouts
        # of 0 meant "now") never expires.
        if was_paused or (record.expires_at is not None and expires > record.expires_at):
            self._store.set_sandbox_expiry(sandbox_id, expires)
        return self._answer(record), was_paused

    async def resume(self, account: str, sandbox_id: str, request: wire.ResumeSandbox) -> wire.Sandbox:
        _, machine = self._find(account, sandbox_id)
        if machine.state not in _PAUSED:
            raise Conflict(f"sandbox {sandbox_id} is already running", field="sandboxID")
        answer, _ = await self.connect(account, sandbox_id, request.timeout, memory=request.memory)
        if request.auto_pause is not None:
            self._store.set_sandbox_auto_pause(sandbox_id, request.auto_pause)
        return answer

    async def pause(self, account: str, sandbox_id: str, request: wire.PauseSandbox) -> None:
        _, machine = self._find(account, sandbox_id)
        if machine.state in _PAUSED:
            raise Conflict(f"sandbox {sandbox_id} is already paused", field="sandboxID")
        # As E2B, a pause without memory always needs the guest, to sync its disk first.
        if request.require_healthy_guest or not request.memory:
            await self._check_guest_answers(account, sandbox_id)
        await self.machines.hibernate(account, sandbox_id, keep_memory=request.memory)
        self._store.set_sandbox_expiry(sandbox_id, None)
        event(log, "e2b.sandbox_paused", machine=sandbox_id)

    async def _check_guest_answers(self, account: str, sandbox_id: str) -> None:
        try:
            async with asyncio.timeout(GUEST_CHECK_S):
                await self.machines.exec(account, sandbox_id, ExecBody(argv=["true"]))
        except (BoxdError, TimeoutError) as error:
            why = error.message if isinstance(error, BoxdError) else f"no answer in {GUEST_CHECK_S:g} s"
            raise AgentUnavailable(
                f"sandbox {sandbox_id} was not paused: its guest agent does not answer ({why})",
                field="requireHealthyGuest",
            ) from None

    async def kill(self, account: str, sandbox_id: str) -> None:
        self._find(account, sandbox_id)
        await self.machines.delete(account, sandbox_id)
        event(log, "e2b.sandbox_killed", machine=sandbox_id)

    def info(self, account: str, sandbox_id: str) -> wire.SandboxDetail:
        record, machine = self._find(account, sandbox_id)
        return self._detail(record, machine, with_token=True)

    async def set_timeout(self, account: str, sandbox_id: str, timeout: int) -> None:
        """The sandbox's time now ends in ``timeout`` s, sooner or later than it did; 0 or
        less ends it now, as in E2B: it is killed, or paused if it asked for that."""
        record, machine = self._find(account, sandbox_id)
        if machine.state in _PAUSED:
            raise Conflict(f"sandbox {sandbox_id} is paused: its time starts again when it is resumed",
                           field="sandboxID")
        if timeout <= 0:
            await self._time_is_up(account, record, machine)
        else:
            self._store.set_sandbox_expiry(sandbox_id, time.time() + timeout)

    def list(
        self, account: str, query: SandboxQuery, *, order: Literal["asc", "desc"] = "desc", limit: int,
        after: str | None,
    ) -> tuple[list[wire.SandboxDetail], str | None]:
        """One page, newest first unless ``order`` is asc (as in E2B), and the next page's token."""
        found = []
        for machine in self._store.list_machines(account):  # oldest first
            record = self._store.find_sandbox(machine.id)
            if record is not None and machine.state not in _GONE and query.matches(record, machine):
                found.append(self._detail(record, machine, with_token=False))
        if order == "desc":
            found.reverse()
        return page_of(found, [sandbox.sandbox_id for sandbox in found], limit, after)

    async def fork(self, account: str, sandbox_id: str, request: wire.ForkSandbox) -> list[wire.ForkResult]:
        """``count`` children at once: boxd shares one capture of the source among them."""
        record, _ = self._find(account, sandbox_id)
        children = await asyncio.gather(
            *(self.machines.fork(account, sandbox_id, MachineFork(name=_new_name())) for _ in range(request.count)),
            return_exceptions=True,
        )

        async def settle(child: Machine | BaseException) -> wire.ForkResult:
            if isinstance(child, BoxdError):
                return wire.ForkResult(error={"code": child.status, "message": child.message})
            if isinstance(child, BaseException):
                raise child
            copy = SandboxRecord(
                machine=child.id, template=record.template, metadata=record.metadata, env=record.env,
                access_token=secrets.token_urlsafe(32), expires_at=self._booting_expiry(request.timeout),
                auto_pause=record.auto_pause, auto_pause_memory=record.auto_pause_memory,
            )
            try:
                return wire.ForkResult(sandbox=await self._ready(account, child, copy, request.timeout))
            except BoxdError as error:
                return wire.ForkResult(error={"code": error.status, "message": error.message})

        return list(await asyncio.gather(*(settle(child) for child in children)))

    # -- snapshots --------------------------------------------------------------------

    async def snapshot(self, account: str, sandbox_id: str, name: str | None) -> wire.SnapshotInfo:
        """Save a boxd snapshot of the sandbox and answer once it is usable as a templateID."""
        self._find(account, sandbox_id)
        saving = await self._snapshots.save(account, _E2BSnapshotCreate(machine=sandbox_id, name=name or _new_name()))
        while saving.state is SnapshotState.SAVING:
            await asyncio.sleep(SNAPSHOT_POLL_S)
            saving = self._snapshots.get(account, saving.ref)
        if saving.state is not SnapshotState.READY:
            raise Conflict(f"snapshot {saving.ref} failed: {saving.reason}", field="sandboxID")
        event(log, "e2b.snapshot_created", machine=sandbox_id, snapshot=saving.ref)
        return wire.SnapshotInfo(snapshot_id=saving.ref, names=[saving.name])

    def list_snapshots(
        self, account: str, *, sandbox_id: str | None, name: str | None, limit: int, after: str | None
    ) -> tuple[list[wire.SnapshotInfo], str | None]:
        """One page of the ready snapshots, of one sandbox or of one name if asked."""
        found = [
            snapshot for snapshot in self._snapshots.list(account)
            if snapshot.state is SnapshotState.READY and sandbox_id in (None, snapshot.machine)
            and (name is None or snapshot.name == name.strip().lower())
        ]
        infos = [wire.SnapshotInfo(snapshot_id=snapshot.ref, names=[snapshot.name]) for snapshot in found]
        return page_of(infos, [snapshot.ref for snapshot in found], limit, after)

    async def delete_snapshot(self, account: str, ref: str) -> None:
        await self._snapshots.delete(account, ref)

    # -- expiry -----------------------------------------------------------------------

    def start_expiry_watch(self) -> None:
        self._expiry_watch = asyncio.create_task(self._watch_expiry(), name="e2b-expiry")

    async def close(self) -> None:
        if self._expiry_watch is not None:
            self._expiry_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_watch

    async def _watch_expiry(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            await self.enforce_expiry()

    async def enforce_expiry(self) -> None:
        """One pass: kill (or pause, if it asked) every sandbox whose time ran out."""
        for record, machine in self._store.expired_sandboxes(time.time()):
            try:
                await self._time_is_up(self._store.account_of(machine.id), record, machine)
            except BoxdError as error:
                event(log, "e2b.expiry_failed", level=logging.WARNING, machine=machine.id, reason=error.message)

    async def _time_is_up(self, account: str, record: SandboxRecord, machine: Machine) -> None:
        """Kill the sandbox, or pause it if it asked (then it has no expiry until resumed)."""
        pausing = record.auto_pause and machine.state not in _GONE
        if pausing:
            if machine.state not in _PAUSED:
                await self.machines.hibernate(account, machine.id, keep_memory=record.auto_pause_memory)
            self._store.set_sandbox_expiry(machine.id, None)
        else:
            await self.machines.delete(account, machine.id)
        event(log, "e2b.sandbox_expired", machine=machine.id, paused=pausing)


def _new_name() -> str:
    return f"e2b-{secrets.token_hex(4)}"

