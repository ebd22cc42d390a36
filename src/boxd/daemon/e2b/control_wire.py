"""The E2B control plane's JSON: requests as its SDKs send them, answers with every field
their generated ``from_dict`` requires. Names are E2B's own (``templateID``,
``allow_internet_access``), hence explicit aliases."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

# The envd version the SDKs are told, which unlocks what boxd serves: stdin control (0.3),
# a default user (0.4), closing stdin (0.5.2), octet-stream uploads (0.5.7), file metadata
# (0.6.2), entries in watch events (0.6.3), watches allowed on network mounts (0.6.4).
ENVD_VERSION = "0.6.4"
CLIENT_ID = "boxd"
DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 30 * 24 * 3600
MAX_FORK_COUNT = 32
# E2B's name for every IPv4 destination: denying it alone is what an isolated machine does.
ALL_TRAFFIC = "0.0.0.0/0"
# E2B's snapshot name rule (trimmed and lowercased first, as E2B does), within boxd's length
# for names; boxd has no namespaces ("team/") or tags (":tag").
_SNAPSHOT_NAME = re.compile(r"^[a-z0-9_-]{1,63}$")


def check_snapshot_name(name: str) -> str:
    cleaned = name.strip().lower()
    if not _SNAPSHOT_NAME.match(cleaned):
        raise ValueError(
            f"a snapshot name is 1-63 letters, digits, '-' or '_' (no namespace or tag), got {name!r}"
        )
    return cleaned


class _Request(BaseModel):
    """Every field E2B's SDKs (2.0 to 2.63) send is declared. One this server does not know
    is refused, not ignored: it may ask for something (a fence, a mount) boxd would not do."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @model_validator(mode="after")
    def _no_unknown_fields(self) -> Self:
        if self.model_extra:
            names = ", ".join(sorted(self.model_extra))
            raise ValueError(f"unknown field(s) {names}: boxd's E2B API refuses what it does not know")
        return self


def _unserved(why: str) -> AfterValidator:
    """A field asking for what boxd does not do: any value but its empty default is refused
    (400, naming the field), so that no client believes it done."""

    def refuse_if_set(value: Any) -> Any:
        if value:
            raise ValueError(why)
        return value

    return AfterValidator(refuse_if_set)


class SandboxNetwork(_Request):
    """E2B's network options. boxd can cut all egress (an isolated machine); finer fences are
    refused until boxd enforces them."""

    # Either way nothing is public: boxd serves no per-port sandbox URLs (2.45 sends E2B's
    # default, true, with any network option).
    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")
    allow_out: Annotated[
        list[str], _unserved(f"boxd does not enforce egress allow lists yet; it can only deny all ({ALL_TRAFFIC})")
    ] = Field(default_factory=list, alias="allowOut")
    deny_out: list[str] = Field(default_factory=list, alias="denyOut")
    # Only used for allowOut's domains, which are refused: nothing to do.
    dns_servers: list[str] | None = Field(default=None, alias="dnsServers")
    egress_proxy: Annotated[
        dict[str, Any] | None, _unserved("boxd does not tunnel a sandbox's egress through a proxy")
    ] = Field(default=None, alias="egressProxy")
    mask_request_host: Annotated[
        str | None, _unserved("boxd does not rewrite the Host of requests to a sandbox")
    ] = Field(default=None, alias="maskRequestHost")
    https_ports: Annotated[
        list[int], _unserved("boxd serves no per-port sandbox URLs")
    ] = Field(default_factory=list, alias="httpsPorts")
    rules: Annotated[dict[str, Any], _unserved("boxd does not transform a sandbox's egress requests")] = Field(
        default_factory=dict
    )

    @field_validator("deny_out")
    @classmethod
    def _all_or_nothing(cls, deny_out: list[str]) -> list[str]:
        if any(entry != ALL_TRAFFIC for entry in deny_out):
            raise ValueError(f"boxd can deny all egress ({ALL_TRAFFIC!r}) but not single destinations yet")
        return deny_out


class AutoResume(_Request):
    enabled: Annotated[
        bool, _unserved("boxd does not wake a paused sandbox on traffic; resume it with connect()")
    ] = False


class SandboxIam(_Request):
    tokens: Annotated[dict[str, Any], _unserved("boxd issues no workload identity tokens")] = Field(
        default_factory=dict
    )


def _keeps_memory(why: str) -> AfterValidator:
    """``memory: false`` asks to drop a sandbox's memory: refused where boxd cannot."""

    def refuse_false(memory: bool) -> bool:
        if not memory:
            raise ValueError(why)
        return memory

    return AfterValidator(refuse_false)



class _Answer(BaseModel):
    model_config = ConfigDict(populate_by_name=True)


class NewSandbox(_Request):
    template_id: str = Field(alias="templateID", min_length=1)
    # As in E2B: a sandbox that starts needs some time (its SDKs send their default for 0).
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=1, le=MAX_TIMEOUT_S)
    auto_pause: bool = Field(default=False, alias="autoPause")
    # False: pausing when its time runs out keeps only its disk (it boots when resumed).
    auto_pause_memory: bool = Field(default=True, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    # E2B itself now ignores it: every sandbox's envd calls need its token, and the SDKs
    # send the token they are given either way.
    secure: bool = True
    allow_internet_access: bool = True
    network: SandboxNetwork | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict, alias="envVars")
    mcp: Annotated[dict[str, Any] | None, _unserved("boxd starts no MCP gateway in a sandbox")] = None
    iam: SandboxIam | None = None
    volume_mounts: Annotated[list[dict[str, Any]], _unserved("boxd mounts no E2B volumes")] = Field(
        default_factory=list, alias="volumeMounts"
    )

    @property
    def isolated(self) -> bool:
        """No egress at all: what ``allow_internet_access=False`` and ``denyOut: [0.0.0.0/0]`` both ask."""
        return not self.allow_internet_access or (self.network is not None and ALL_TRAFFIC in self.network.deny_out)


class Timeout(_Request):
    timeout: int = Field(le=MAX_TIMEOUT_S)  # 0 or less: now, as in E2B


class Refresh(_Request):
    """Older SDKs' keep-alive."""

    duration: int | None = Field(default=None, ge=0, le=MAX_TIMEOUT_S)


class ConnectSandbox(_Request):
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=0, le=MAX_TIMEOUT_S)
    # False asks to boot a paused sandbox from its disk, dropping the memory it kept.
    memory: bool = True


class ResumeSandbox(ConnectSandbox):
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=1, le=MAX_TIMEOUT_S)
    auto_pause: bool | None = Field(default=None, alias="autoPause")  # None: as the sandbox had it


class PauseSandbox(_Request):
    memory: bool = True  # False: keep only the disk; resuming boots it, its processes gone
    # True: refuse (503) to pause a sandbox whose guest agent does not answer.
    require_healthy_guest: bool = Field(default=False, alias="requireHealthyGuest")


class ForkSandbox(_Request):
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=1, le=MAX_TIMEOUT_S)
    count: int = Field(default=1, ge=1, le=MAX_FORK_COUNT)


class SnapshotSandbox(_Request):
    name: str | None = None

    @field_validator("name")
    @classmethod
    def _e2b_name(cls, name: str | None) -> str | None:
        return None if name is None else check_snapshot_name(name)
    memory: Annotated[bool, _keeps_memory("boxd snapshots always hold the sandbox's memory")] = True


class Sandbox(_Answer):
    template_id: str = Field(serialization_alias="templateID")
    sandbox_id: str = Field(serialization_alias="sandboxID")
    client_id: str = Field(default=CLIENT_ID, serialization_alias="clientID")
    envd_version: str = Field(default=ENVD_VERSION, serialization_alias="envdVersion")
    envd_access_token: str = Field(serialization_alias="envdAccessToken")
    alias: str | None = None
    domain: str | None = None


class SandboxDetail(_Answer):
    template_id: str = Field(serialization_alias="templateID")
    sandbox_id: str = Field(serialization_alias="sandboxID")
    client_id: str = Field(default=CLIENT_ID, serialization_alias="clientID")
    alias: str | None = None
    started_at: datetime = Field(serialization_alias="startedAt")
    end_at: datetime = Field(serialization_alias="endAt")
    envd_version: str = Field(default=ENVD_VERSION, serialization_alias="envdVersion")
    envd_access_token: str | None = Field(default=None, serialization_alias="envdAccessToken")
    cpu_count: int = Field(serialization_alias="cpuCount")
    memory_mb: int = Field(serialization_alias="memoryMB")
    disk_size_mb: int = Field(serialization_alias="diskSizeMB")
    metadata: dict[str, str] = Field(default_factory=dict)
    state: Literal["running", "paused"]
    domain: str | None = None


class ForkResult(_Answer):
    sandbox: Sandbox | None = None
    error: dict | None = None


class SnapshotInfo(_Answer):
    snapshot_id: str = Field(serialization_alias="snapshotID")
    names: list[str]


class SandboxMetric(_Answer):
    timestamp: datetime  # E2B's deprecated spelling of timestamp_unix
    timestamp_unix: int = Field(serialization_alias="timestampUnix")
    cpu_count: int = Field(serialization_alias="cpuCount")
    cpu_used_pct: float = Field(serialization_alias="cpuUsedPct")
    mem_used: int = Field(serialization_alias="memUsed")
    mem_total: int = Field(serialization_alias="memTotal")
    mem_cache: int = Field(serialization_alias="memCache")
    disk_used: int = Field(serialization_alias="diskUsed")
    disk_total: int = Field(serialization_alias="diskTotal")


class Error(_Answer):
    code: int
    message: str
