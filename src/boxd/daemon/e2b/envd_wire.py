"""envd's messages (E2B's process.proto and filesystem.proto) in their proto3 JSON form.

Field names are lowerCamelCase on the way out and either spelling on the way in; bytes
are base64; enums travel by name (numbers are accepted); fields a newer SDK sends that
this server does not know are ignored, as a protobuf parser would.
"""

from __future__ import annotations

import base64
import binascii
import enum
import stat
from collections.abc import Iterable
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
    """Never SYMLINK: envd describes a link by what it leads to (unspecified, hence left
    out, if that is nothing or neither a file nor a directory)."""

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
    """WatchDirRequest and CreateWatcherRequest. boxd's guests mount no network filesystems,
    so ``allow_network_mounts`` changes nothing."""

    path: str = Field(min_length=1)
    recursive: bool = False
    include_entry: bool = False
    allow_network_mounts: bool = False


class WatcherRequest(_Message):
    """GetWatcherEventsRequest and RemoveWatcherRequest."""

    watcher_id: str = Field(min_length=1)


class EntryInfo(_Message):
    name: str
    type: FileType | None = None
    path: str
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    modified_time: str
    symlink_target: str | None = None
    metadata: dict[str, str] | None = None

    @classmethod
    def of(cls, entry: dict[str, Any]) -> "EntryInfo":
        """From the agent's entry, as envd tells it: a link's type and permission bits are
        those of what it leads to (``pointed``), its target the fully resolved path; the
        size, permission string and time are the link's own."""
        st_mode = entry.get("st_mode", _st_mode_of(entry))
        if entry["type"] == "symlink":
            pointed = entry.get("pointed") or {}
            kind, mode = pointed.get("type"), int(pointed.get("mode", 0))
        else:
            kind, mode = entry["type"], int(entry["mode"])
        return cls(
            name=entry["name"],
            type=_FILE_TYPES.get(kind),
            path=entry["path"],
            size=int(entry["size"]),
            mode=mode & 0o777,
            permissions=go_mode_string(st_mode),
            owner=entry["owner"],
            group=entry["group"],
            modified_time=timestamp(entry.get("mtime_ns", round(entry["mtime"] * 1e9))),
            symlink_target=entry.get("resolved", entry.get("target")) if entry["type"] == "symlink" else None,
            metadata=entry.get("metadata") or None,
        )


_FILE_TYPES = {"file": FileType.FILE, "dir": FileType.DIRECTORY}
_FORMAT_BITS = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK}


def _st_mode_of(entry: dict[str, Any]) -> int:
    """An older agent's entry has no ``st_mode``: its type and permission bits make one."""
    return _FORMAT_BITS.get(entry["type"], 0) | int(entry["mode"])


# Go's os.FileMode.String(), which envd's permissions are: a letter for each of these that
# is set (none: "-"), then rwx three times.
_GO_MODE_LETTERS = (
    ("d", lambda m: stat.S_ISDIR(m)), ("L", lambda m: stat.S_ISLNK(m)),
    ("D", lambda m: stat.S_ISBLK(m) or stat.S_ISCHR(m)), ("p", lambda m: stat.S_ISFIFO(m)),
    ("S", lambda m: stat.S_ISSOCK(m)), ("u", lambda m: bool(m & stat.S_ISUID)),
    ("g", lambda m: bool(m & stat.S_ISGID)), ("c", lambda m: stat.S_ISCHR(m)),
    ("t", lambda m: bool(m & stat.S_ISVTX)),
)


def go_mode_string(st_mode: int) -> str:
    letters = "".join(letter for letter, is_set in _GO_MODE_LETTERS if is_set(st_mode)) or "-"
    return letters + "".join(
        letter if st_mode & (1 << (8 - index)) else "-" for index, letter in enumerate("rwxrwxrwx")
    )


def timestamp(nanoseconds: int) -> str:
    """A google.protobuf.Timestamp in proto3 JSON: RFC 3339 in UTC, with 0, 3, 6 or 9
    fractional digits, as few as hold it."""
    seconds, nanos = divmod(nanoseconds, 1_000_000_000)
    text = datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")
    if nanos:
        digits = 3 if nanos % 1_000_000 == 0 else 6 if nanos % 1000 == 0 else 9
        text += "." + f"{nanos:09d}"[:digits]
    return text + "Z"


# -- /files ------------------------------------------------------------------------------

# An upload's ``X-Metadata-<key>: <value>`` headers become the files' user metadata (extended
# attributes ``user.e2b.<key>``), with envd's limits: a key fits the 255-byte xattr name
# with its prefix, and all of it (prefix counted per key) fits one 4 KiB filesystem block.
METADATA_HEADER_PREFIX = "x-metadata-"
METADATA_XATTR_PREFIX = "user.e2b."  # as the guest agent stores it
MAX_METADATA_KEY_BYTES = 255 - len(METADATA_XATTR_PREFIX)
MAX_METADATA_BYTES = 4096


def upload_metadata(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The metadata an upload's headers carry: keys lower-cased, the first of repeated
    headers kept. Raises ValueError, naming the fault, if envd would refuse it."""
    metadata: dict[str, str] = {}
    for name, value in headers:
        if name.lower().startswith(METADATA_HEADER_PREFIX):
            metadata.setdefault(name[len(METADATA_HEADER_PREFIX):].lower(), value)
    total = 0
    for key, value in metadata.items():
        if not key:
            raise ValueError("metadata key must not be empty")
        if len(key) > MAX_METADATA_KEY_BYTES:
            raise ValueError(f"metadata key {key!r} exceeds {MAX_METADATA_KEY_BYTES} bytes")
        for label, text in (("key", key), (f"value for key {key!r}", value)):
            if not all(" " <= char <= "~" for char in text):
                raise ValueError(f"metadata {label} holds a character that is not printable ASCII")
        total += len(METADATA_XATTR_PREFIX) + len(key) + len(value)
    if total > MAX_METADATA_BYTES:
        raise ValueError(f"total metadata size {total} exceeds {MAX_METADATA_BYTES} bytes")
    return metadata


class EntryMessage(_Message):
    """StatResponse, MakeDirResponse and MoveResponse."""

    entry: EntryInfo


class ListDirResponse(_Message):
    entries: list[EntryInfo]


class FilesystemEvent(_Message):
    name: str
    type: EventType
    entry: EntryInfo | None = None  # when asked for, and the event's path still holds something


class WatchDirResponse(_Message):
    start: Empty | None = None
    filesystem: FilesystemEvent | None = None
    keepalive: Empty | None = None


class CreateWatcherResponse(_Message):
    watcher_id: str


class GetWatcherEventsResponse(_Message):
    events: list[FilesystemEvent]
