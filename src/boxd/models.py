"""What crosses the wire between the SDK and the daemon.

The daemon validates requests with these models and the SDK parses answers into them, so
both sides agree on one definition. Binary payloads travel base64-encoded in ``*_b64``
fields; the models offer them decoded as well.
"""

from __future__ import annotations

import base64
import enum
import re
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from boxd.config import DEFAULT_USER

# A DNS label, so that a machine name can become a host name later.
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_MACHINE_ID = re.compile(r"^m-[0-9a-f]{12}$")

MAX_DISK_GIB = 256
MIN_MEMORY_MIB = 128


def check_machine_name(name: str) -> str:
    check_dns_label(name, "a machine name")
    if _MACHINE_ID.match(name):
        # Every call accepts a name or an id; a name shaped like an id would be ambiguous.
        raise ValueError(f"a machine name may not look like a machine id (got {name!r})")
    return name


def check_dns_label(value: str, what: str) -> str:
    if not _DNS_LABEL.match(value):
        raise ValueError(
            f"{what} must be 1-63 lowercase letters, digits or hyphens, "
            f"not starting or ending with a hyphen (got {value!r})"
        )
    return value


class _Wire(BaseModel):
    # Unknown request fields are an error, so that a typo never passes silently.
    model_config = ConfigDict(extra="forbid")


# -- machines ----------------------------------------------------------------------------


class MachineState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"
    FAILED = "failed"
    LOST = "lost"  # its host died with it: kept on record, no longer counted
    DELETED = "deleted"


# The states that hold host resources and count against an account's quota.
ALIVE_STATES = frozenset({MachineState.STARTING, MachineState.RUNNING, MachineState.PAUSED})


class MachineCreate(_Wire):
    name: str
    vcpus: int = Field(default=1, ge=1)
    memory_mib: int = Field(default=512, ge=MIN_MEMORY_MIB)
    disk_gib: int = Field(default=4, ge=1, le=MAX_DISK_GIB)
    isolated: bool = False
    suspend_after_s: float | None = Field(
        default=None, ge=0, description="idle seconds before it suspends; unset: the daemon's default, 0: never"
    )
    hibernate_after_s: float | None = Field(
        default=None, ge=0, description="further idle seconds before it hibernates; unset: the daemon's default, 0: never"
    )
    http_port: int = Field(default=8080, ge=1, le=65535, description="the guest port its URL leads to")
    public: bool = Field(default=False, description="its URL answers without the account's key")
    from_snapshot: str | None = Field(
        default=None,
        description="start at a snapshot's instant: NAME (its newest version), NAME@VERSION or its digest; "
        "the machine then takes its size and isolation from the snapshot",
    )
    host: str | None = Field(default=None, description="on a cluster: the host to start it on (default: boxd's choice)")

    @field_validator("name")
    @classmethod
    def _name_is_a_label(cls, name: str) -> str:
        return check_machine_name(name)


class MachineFork(_Wire):
    """A fork takes its size from its source; only its name is its own."""

    name: str
    host: str | None = Field(
        default=None, description="on a cluster: the host to fork onto (default: the source's while it has room)"
    )

    @field_validator("name")
    @classmethod
    def _name_is_a_label(cls, name: str) -> str:
        return check_machine_name(name)


class Machine(BaseModel):
    id: str
    name: str
    state: MachineState
    vcpus: int
    memory_mib: int
    disk_gib: int
    isolated: bool
    image: str | None = None
    suspend_after_s: float | None = None
    hibernate_after_s: float | None = None
    http_port: int = 8080
    public: bool = False
    url: str | None = Field(default=None, description="served by the daemon, proxied to http_port in the guest")
    parent: str | None = Field(default=None, description="the machine this one was forked from")
    host: str | None = Field(default=None, description="the host that runs it, in a cluster")
    reason: str | None = Field(default=None, description="why the machine failed, when it did")
    created_at: datetime
    updated_at: datetime


# -- checkpoints and snapshots -----------------------------------------------------------


class CheckpointCreate(_Wire):
    name: str

    @field_validator("name")
    @classmethod
    def _name_is_a_label(cls, name: str) -> str:
        return check_dns_label(name, "a checkpoint name")


class Checkpoint(BaseModel):
    name: str
    machine: str = Field(description="the id of the machine it belongs to")
    pause_ms: float = Field(description="how long the machine stood still while it was taken")
    created_at: datetime


class SnapshotCreate(_Wire):
    machine: str = Field(min_length=1, description="the machine to save, by name or id")
    name: str

    @field_validator("name")
    @classmethod
    def _name_is_a_label(cls, name: str) -> str:
        return check_dns_label(name, "a snapshot name")


class SnapshotState(str, enum.Enum):
    SAVING = "saving"
    READY = "ready"
    FAILED = "failed"


class Snapshot(BaseModel):
    """One version of a named snapshot; a version never changes once ready."""

    name: str
    version: int
    ref: str = Field(description="NAME@VERSION")
    state: SnapshotState
    digest: str | None = Field(default=None, description="SHA-256 of its content, once ready")
    machine: str = Field(description="the id of the machine it was saved from")
    vcpus: int
    memory_mib: int
    disk_gib: int
    isolated: bool
    size_bytes: int | None = Field(default=None, description="on disk, compressed")
    pause_ms: float | None = None
    progress: float | None = Field(default=None, description="0 to 1 while saving")
    reason: str | None = Field(default=None, description="why saving failed, when it did")
    created_at: datetime


# -- commands ----------------------------------------------------------------------------


class ExecBody(_Wire):
    """A command: ``cmd`` is a shell string, ``argv`` a program and its arguments."""

    cmd: str | None = Field(default=None, min_length=1)
    # Validated even when left out, by the check that exactly one of cmd and argv is there.
    argv: list[str] | None = Field(default=None, min_length=1, validate_default=True)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str = Field(default=DEFAULT_USER, min_length=1)
    timeout: float | None = Field(default=None, gt=0)
    stdin_b64: str | None = None

    @field_validator("argv")
    @classmethod
    def _one_command(cls, argv: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if (info.data.get("cmd") is None) == (argv is None):
            raise ValueError("give exactly one of cmd (a shell string) or argv (a list)")
        return argv

    @field_validator("stdin_b64")
    @classmethod
    def _stdin_is_base64(cls, value: str | None) -> str | None:
        if value is not None:
            base64.b64decode(value, validate=True)
        return value


def _decode(data_b64: str) -> bytes:
    return base64.b64decode(data_b64)


class ExecResult(BaseModel):
    """What a finished command left: its output, its exit code, whether it ran out of time.

    ``exit_code`` follows the shell's convention: 128 + N for a command killed by signal N.
    """

    stdout_b64: str
    stderr_b64: str
    exit_code: int
    timed_out: bool = False
    duration_s: float

    @property
    def stdout_bytes(self) -> bytes:
        return _decode(self.stdout_b64)

    @property
    def stderr_bytes(self) -> bytes:
        return _decode(self.stderr_b64)

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")


class ExecEvent(BaseModel):
    """One line of a streamed command: ``started``, then ``stdout``/``stderr``, then ``exit``.

    A stream that breaks after it began ends with an ``error`` event instead of ``exit``;
    the SDK raises it as the matching ``BoxdError``.
    """

    type: Literal["started", "stdout", "stderr", "exit", "error"]
    data_b64: str = ""
    pid: int | None = None
    exit_code: int | None = None
    timed_out: bool = False
    error: dict | None = None

    @property
    def data(self) -> bytes:
        return _decode(self.data_b64)


class FileWritten(BaseModel):
    path: str
    size: int


# -- accounts and keys -------------------------------------------------------------------


class Account(BaseModel):
    name: str
    max_machines: int
    created_at: datetime


class AccountSet(_Wire):
    """Create an account, or change one; an omitted limit keeps the current one (50 when new)."""

    max_machines: int | None = Field(default=None, ge=0)


class KeyCreate(_Wire):
    account: str = "local"
    name: str | None = Field(default=None, max_length=200)


class ApiKey(BaseModel):
    id: str
    account: str
    name: str | None
    created_at: datetime
    revoked_at: datetime | None = None


class CreatedKey(ApiKey):
    key: str = Field(description="the secret; shown this once and never again")


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    version: str


class ErrorDetail(BaseModel):
    code: str
    message: str
    field: str | None = None
    details: dict | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
