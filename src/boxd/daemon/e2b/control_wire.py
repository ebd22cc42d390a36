"""The E2B control plane's JSON: requests as its SDKs send them, answers with every field
their generated ``from_dict`` requires. Names are E2B's own (``templateID``,
``allow_internet_access``), hence explicit aliases."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# The envd version the SDKs are told: stdin control (0.3), a default user (0.4), closing
# stdin (0.5.2), octet-stream uploads (0.5.7). File metadata (0.6.2) and watch entries
# (0.6.3) are not served, so the SDKs refuse those themselves, with a clear error.
ENVD_VERSION = "0.5.7"
CLIENT_ID = "boxd"
DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 30 * 24 * 3600
MAX_FORK_COUNT = 32


class _Request(BaseModel):
    # E2B's SDKs add fields over time; one this server does not know is left alone.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Answer(BaseModel):
    model_config = ConfigDict(populate_by_name=True)


class NewSandbox(_Request):
    template_id: str = Field(alias="templateID", min_length=1)
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=0, le=MAX_TIMEOUT_S)
    auto_pause: bool = Field(default=False, alias="autoPause")
    secure: bool = True
    allow_internet_access: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict, alias="envVars")


class Timeout(_Request):
    timeout: int = Field(ge=0, le=MAX_TIMEOUT_S)


class ConnectSandbox(_Request):
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=0, le=MAX_TIMEOUT_S)


class ResumeSandbox(_Request):
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=0, le=MAX_TIMEOUT_S)
    auto_pause: bool = Field(default=False, alias="autoPause")


class ForkSandbox(_Request):
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=0, le=MAX_TIMEOUT_S)
    count: int = Field(default=1, ge=1, le=MAX_FORK_COUNT)


class SnapshotSandbox(_Request):
    name: str | None = None


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


class Error(_Answer):
    code: int
    message: str
