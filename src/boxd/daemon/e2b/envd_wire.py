"""envd's messages (E2B's process.proto and filesystem.proto) in their proto3 JSON form.

Field names are lowerCamelCase on the way out and either spelling on the way in; bytes
are base64; enums travel by name (numbers are accepted); fields a newer SDK sends that
this server does not know are ignored, as a protobuf parser would.
"""

from __future__ import annotations

import base64
import binascii
import enum
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel


class _Message(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


def decode_bytes(value: str) -> bytes:
    """proto3 JSON bytes: standard or URL-safe base64, padded or not."""
    text = value.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except binascii.Error:
        raise ValueError("not base64") from None


def encode_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _enum_by_name_or_number(kind: type[enum.Enum], value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return kind(value)
    if isinstance(value, str) and value in kind.__members__:
        return kind[value]
    return value


# -- process ------------------------------------------------------------------------------


class Signal(enum.IntEnum):
    SIGNAL_UNSPECIFIED = 0
    SIGNAL_SIGTERM = 15
    SIGNAL_SIGKILL = 9


class PTYSize(_Message):
    cols: int = Field(default=80, ge=0, le=65535)
    rows: int = Field(default=24, ge=0, le=65535)

    def window(self) -> dict[str, int]:
        """For the agent; proto3 sends a 0 it leaves out as 0, which means the default here."""
        return {"rows": self.rows or 24, "cols": self.cols or 80}


class PTY(_Message):
    size: PTYSize = Field(default_factory=PTYSize)


class ProcessConfig(_Message):
    cmd: str = Field(min_length=1)
    args: list[str] = Field(default_factory=list)
    envs: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None


class ProcessSelector(_Message):
    pid: int | None = Field(default=None, ge=1)
    tag: str | None = None


class StartRequest(_Message):
    process: ProcessConfig
    pty: PTY | None = None
    tag: str | None = None
    stdin: bool | None = None  # unset: the SDK predates the field, whose default kept stdin open


class ConnectRequest(_Message):
    process: ProcessSelector


class ProcessInput(_Message):
    stdin: str | None = None
    pty: str | None = None

    @field_validator("stdin", "pty")
    @classmethod
    def _base64(cls, value: str | None) -> str | None:
        if value is not None:
            decode_bytes(value)
        return value

    def data(self) -> bytes:
        return decode_bytes(self.stdin or self.pty or "")


class SendInputRequest(_Message):
    process: ProcessSelector
    input: ProcessInput = Field(default_factory=ProcessInput)


class StreamInputStart(_Message):
    process: ProcessSelector


class StreamInputData(_Message):
    input: ProcessInput = Field(default_factory=ProcessInput)


class StreamInputRequest(_Message):
    start: StreamInputStart | None = None
    data: StreamInputData | None = None
    keepalive: dict | None = None


class CloseStdinRequest(_Message):
    process: ProcessSelector


class SendSignalRequest(_Message):
    process: ProcessSelector
    signal: Signal = Signal.SIGNAL_UNSPECIFIED

    @field_validator("signal", mode="before")
    @classmethod
    def _by_name(cls, value: Any) -> Any:
        return _enum_by_name_or_number(Signal, value)


class UpdateRequest(_Message):
    process: ProcessSelector
    pty: PTY | None = None


class ListRequest(_Message):
    pass


class Empty(_Message):
    pass


class ProcessInfo(_Message):
    config: ProcessConfig
    pid: int
    tag: str | None = None


class ListResponse(_Message):
    processes: list[ProcessInfo]


class StartEvent(_Message):
    pid: int


class DataEvent(_Message):
    stdout: str | None = None
    stderr: str | None = None
    pty: str | None = None


class EndEvent(_Message):
    exit_code: int
    exited: bool
    status: str
    error: str | None = None


class ProcessEvent(_Message):
    start: StartEvent | None = None
    data: DataEvent | None = None
    end: EndEvent | None = None
    keepalive: Empty | None = None


class ProcessEventMessage(_Message):
    """StartResponse and ConnectResponse alike."""

    event: ProcessEvent


# -- filesystem ---------------------------------------------------------------------------


class FileType(str, enum.Enum):
    FILE = "FILE_TYPE_FILE"
    DIRECTORY = "FILE_TYPE_DIRECTORY"


class EventType(str, enum.Enum):
    CREATE = "EVENT_TYPE_CREATE"
    WRITE = "EVENT_TYPE_WRITE"
    REMOVE = "EVENT_TYPE_REMOVE"
    RENAME = "EVENT_TYPE_RENAME"
    CHMOD = "EVENT_TYPE_CHMOD"


class PathRequest(_Message):
    """StatRequest, MakeDirRequest and RemoveRequest."""

    path: str = Field(min_length=1)


class ListDirRequest(_Message):
    path: str = Field(min_length=1)
    depth: int = Field(default=1, ge=0, le=64)


class MoveRequest(_Message):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


class WatchDirRequest(_Message):
    path: str = Field(min_length=1)
    recursive: bool = False
    include_entry: bool = False


class WatcherRequest(_Message):
    """GetWatcherEventsRequest and RemoveWatcherRequest."""

    watcher_id: str = Field(min_length=1)


class EntryInfo(_Message):
    name: str
    type: FileType
    path: str
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    modified_time: str
    symlink_target: str | None = None
    is_symlink: bool = False

    @classmethod
    def of(cls, entry: dict[str, Any], target: dict[str, Any] | None = None) -> "EntryInfo":
        """From the agent's entry; a symlink is described by what it points to (``target``),
        as envd does, since the oldest SDKs know no symlink file type."""
        pointed = target or entry
        mode = int(entry["mode"])
        is_dir = pointed["type"] == "dir"
        return cls(
            name=entry["name"],
            type=FileType.DIRECTORY if is_dir else FileType.FILE,
            path=entry["path"],
            size=int(pointed["size"]),
            mode=mode,
            permissions=_permissions(mode, is_dir),
            owner=entry["owner"],
            group=entry["group"],
            modified_time=datetime.fromtimestamp(entry["mtime"], tz=UTC).isoformat().replace("+00:00", "Z"),
            symlink_target=entry.get("target"),
            is_symlink=entry["type"] == "symlink",
        )


def _permissions(mode: int, is_dir: bool) -> str:
    bits = "".join(
        letter if mode & (1 << (8 - index)) else "-" for index, letter in enumerate("rwxrwxrwx")
    )
    return ("d" if is_dir else "-") + bits


class EntryMessage(_Message):
    """StatResponse, MakeDirResponse and MoveResponse."""

    entry: EntryInfo


class ListDirResponse(_Message):
    entries: list[EntryInfo]


class FilesystemEvent(_Message):
    name: str
    type: EventType


class WatchDirResponse(_Message):
    start: Empty | None = None
    filesystem: FilesystemEvent | None = None
    keepalive: Empty | None = None


class CreateWatcherResponse(_Message):
    watcher_id: str


class GetWatcherEventsResponse(_Message):
    events: list[FilesystemEvent]
