"""envd's file descriptions, metadata and watch entries: the guest agent's side on real
files of this host (extended attributes and all), and the E2B API over a FakeRuntime
whose file operations are the agent's own, run on a folder standing for the guest's /."""

from __future__ import annotations

import asyncio
import os
import pwd
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fakes import ControlPlane, FakeRuntime

from boxd.daemon.e2b import envd_wire as wire
from boxd.daemon.e2b import signing
from boxd.guest.agent import Agent, Channel
from boxd.runtime.agent_client import WATCH_STARTED

pytestmark = pytest.mark.anyio

E2B = "/e2b"


def agent() -> Agent:
    return Agent(Channel(-1))  # its file operations never use the port


# -- the agent ----------------------------------------------------------------------------


def test_an_entry_carries_its_stat_its_metadata_and_where_a_link_leads(tmp_path):
    target = tmp_path / "data.txt"
    target.write_text("four")
    os.chmod(target, 0o644)
    os.setxattr(target, "user.e2b.author", b"mish")
    os.setxattr(target, "user.other", b"not ours")
    (tmp_path / "link").symlink_to("data.txt")
    (tmp_path / "dangling").symlink_to("nowhere")

    entry = agent().op_stat({"path": str(target)})["entry"]
    assert entry["metadata"] == {"author": "mish"} and entry["st_mode"] == stat.S_IFREG | 0o644
    assert entry["mtime_ns"] == target.stat().st_mtime_ns
    link = agent().op_stat({"path": str(tmp_path / "link")})["entry"]
    assert link["type"] == "symlink" and link["resolved"] == str(target)
    assert link["pointed"] == {"type": "file", "mode": 0o644} and link["metadata"] == {"author": "mish"}
    dangling = agent().op_stat({"path": str(tmp_path / "dangling")})["entry"]
    assert dangling["resolved"] == str(tmp_path / "dangling") and "pointed" not in dangling


def test_stat_replaces_metadata_when_asked_and_tells_the_filesystems_size(tmp_path):
    target = tmp_path / "f"
    target.write_text("x")
    os.setxattr(target, "user.e2b.stale", b"1")
    os.setxattr(target, "user.other", b"kept")
    answer = agent().op_stat({"path": str(target), "set_metadata": {"a": "1", "b": "2"}, "filesystem": True})
    assert answer["entry"]["metadata"] == {"a": "1", "b": "2"}
    assert os.getxattr(target, "user.other") == b"kept"
    usage = os.statvfs(target)
    assert answer["filesystem"] == {"total": usage.f_blocks * usage.f_frsize,
                                    "available": usage.f_bavail * usage.f_frsize}
    assert agent().op_stat({"path": str(target), "set_metadata": {}})["entry"]["metadata"] == {}


def test_a_file_written_again_loses_its_metadata(tmp_path):
    """Why an upload without metadata needs no call of its own: the write makes a new file."""
    target = tmp_path / "f"
    target.write_text("old")
    os.setxattr(target, "user.e2b.author", b"mish")
    user = pwd.getpwuid(os.getuid()).pw_name
    agent().op_write_file({"path": str(target), "upload": "u", "offset": 0, "last": True, "data": "", "user": user})
    assert agent().op_stat({"path": str(target)})["entry"]["metadata"] == {}


# -- the wire -----------------------------------------------------------------------------


def test_an_entry_reads_as_envd_describes_it(tmp_path):
    folder = tmp_path / "dir"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o1755)
    (tmp_path / "link").symlink_to("dir")
    (tmp_path / "dangling").symlink_to("nowhere")

    described = wire.EntryInfo.of(agent().op_stat({"path": str(folder)})["entry"])
    assert described.type is wire.FileType.DIRECTORY and described.mode == 0o755
    assert described.permissions == "dtrwxr-xr-x" and described.metadata is None
    link = wire.EntryInfo.of(agent().op_stat({"path": str(tmp_path / "link")})["entry"])
    assert link.type is wire.FileType.DIRECTORY and link.mode == 0o755 and link.permissions == "Lrwxrwxrwx"
    assert link.symlink_target == str(folder) and link.size == len("dir")
    dangling = wire.EntryInfo.of(agent().op_stat({"path": str(tmp_path / "dangling")})["entry"])
    shown = dangling.model_dump(by_alias=True, exclude_none=True)
    assert "type" not in shown and shown["mode"] == 0 and shown["symlinkTarget"] == str(tmp_path / "dangling")


def test_an_older_agents_entry_still_reads():
    entry = {"name": "a", "path": "/h/a", "type": "file", "size": 4, "mode": 0o4755, "mtime": 0.5,
             "owner": "user", "group": "user"}
    info = wire.EntryInfo.of(entry).model_dump(by_alias=True, exclude_none=True)
    assert info["permissions"] == "urwxr-xr-x" and info["mode"] == 0o755
    assert info["modifiedTime"] == "1970-01-01T00:00:00.500Z" and "metadata" not in info


def test_permissions_and_times_are_spelled_as_go_spells_them():
    assert wire.go_mode_string(stat.S_IFCHR | 0o666) == "Dcrw-rw-rw-"
    assert wire.go_mode_string(stat.S_IFIFO | 0o600) == "prw-------"
    assert wire.go_mode_string(stat.S_IFREG | stat.S_ISGID | 0o755) == "grwxr-xr-x"
    assert wire.go_mode_string(stat.S_IFREG | 0o644) == "-rw-r--r--"
    assert wire.timestamp(0) == "1970-01-01T00:00:00Z"
    assert wire.timestamp(1_500_000_000_123_456_789) == "2017-07-14T02:40:00.123456789Z"
    assert wire.timestamp(1_000_001_000) == "1970-01-01T00:00:01.000001Z"


def test_upload_metadata_comes_from_its_headers_as_envd_reads_them():
    headers = [("content-type", "text/plain"), ("x-metadata-Author", "mish"), ("X-Metadata-author", "second"),
               ("x-metadata-purpose", "upload")]
    assert wire.upload_metadata(headers) == {"author": "mish", "purpose": "upload"}
    for bad in ([("x-metadata-", "v")], [("x-metadata-k", "caf\u00e9")], [("x-metadata-" + "k" * 247, "v")],
                [(f"x-metadata-k{i}", "v" * 100) for i in range(40)]):
        with pytest.raises(ValueError):
            wire.upload_metadata(bad)


# -- the E2B API --------------------------------------------------------------------------


class GuestOnHost(FakeRuntime):
    """Files live under ``root`` (the guest's /), handled by the agent's own operations."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.fs_calls: list[tuple[str, dict[str, Any]]] = []
        self.changes: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    def _on_host(self, path: str) -> str:
        return str(self.root) + path

    def _in_guest(self, entry: dict[str, Any]) -> dict[str, Any]:
        for key in ("path", "resolved"):
            if key in entry:
                entry[key] = entry[key].removeprefix(str(self.root))
        return entry

    async def write_file(self, vm_id: str, path: str, chunks: AsyncIterator[bytes], **_: Any) -> int:
        data = b"".join([chunk async for chunk in chunks])
        on_host = Path(self._on_host(path))
        on_host.parent.mkdir(parents=True, exist_ok=True)
        partial = on_host.with_name(on_host.name + ".part")
        partial.write_bytes(data)
        os.replace(partial, on_host)  # a new file each time, as the agent writes
        return len(data)

    async def fs(self, vm_id: str, op: str, **fields: Any) -> dict[str, Any]:
        self._agent_of(vm_id)
        self.fs_calls.append((op, fields))
        answer = getattr(agent(), f"op_{op}")({**fields, "path": self._on_host(fields["path"])})
        for entry in [answer.get("entry"), *answer.get("entries", [])]:
            if entry is not None:
                self._in_guest(entry)
        return answer

    async def watch(self, vm_id: str, path: str, *, recursive: bool = False) -> AsyncIterator[tuple[str, str]]:
        yield WATCH_STARTED
        while True:
            yield await self.changes.get()


@pytest.fixture
async def guest(tmp_path):
    root = tmp_path / "guest"
    (root / "home" / "user").mkdir(parents=True)
    (tmp_path / "daemon").mkdir()
    plane = ControlPlane(tmp_path / "daemon", GuestOnHost(root))
    async with plane.http() as client:
        client.headers["X-API-KEY"] = plane.key_for("alice")
        created = await client.post(f"{E2B}/v2/sandboxes", json={"templateID": "base"})
        sandbox = created.json()
        client.headers.update({"E2b-Sandbox-Id": sandbox["sandboxID"], "X-Access-Token": sandbox["envdAccessToken"]})
        yield client, plane.runtime, root
    await plane.close()


async def test_an_upload_gives_each_file_its_metadata_and_answers_it(guest):
    client, runtime, root = guest
    headers = {"X-Metadata-Author": "mish", "X-Metadata-purpose": "upload"}
    multipart = await client.post(f"{E2B}/files", headers=headers, files=[("file", ("a.txt", b"A")), ("file", ("b.txt", b"B"))])
    assert multipart.status_code == 200, multipart.text
    assert [info["metadata"] for info in multipart.json()] == [{"author": "mish", "purpose": "upload"}] * 2
    stat_answer = await client.post(f"{E2B}/filesystem.Filesystem/Stat", json={"path": "a.txt"})
    assert stat_answer.json()["entry"]["metadata"] == {"author": "mish", "purpose": "upload"}

    runtime.fs_calls.clear()
    plain = await client.post(f"{E2B}/files", params={"path": "a.txt"}, content=b"again",
                              headers={"content-type": "application/octet-stream"})
    assert plain.json() == [{"name": "a.txt", "type": "file", "path": "/home/user/a.txt"}]
    assert runtime.fs_calls == []  # nothing to set: the new file has no metadata
    listed = await client.post(f"{E2B}/filesystem.Filesystem/ListDir", json={"path": "/home/user"})
    by_name = {entry["name"]: entry for entry in listed.json()["entries"]}
    assert "metadata" not in by_name["a.txt"] and by_name["b.txt"]["metadata"]["author"] == "mish"


async def test_bad_metadata_is_refused_before_anything_is_written(guest):
    client, _, root = guest
    refused = await client.post(f"{E2B}/files", params={"path": "c.txt"}, content=b"x",
                                headers={"content-type": "application/octet-stream", "X-Metadata-k": "tab\there"})
    assert refused.status_code == 400 and refused.json()["message"].startswith("invalid metadata")
    assert not (root / "home" / "user" / "c.txt").exists()


async def test_watch_events_carry_the_entry_when_asked_and_it_still_exists(guest):
    client, runtime, root = guest
    (root / "home" / "user" / "w").mkdir()
    (root / "home" / "user" / "w" / "f.txt").write_text("x")
    for change in (("f.txt", "write"), ("gone.txt", "remove"), ("f.txt", "rename")):
        runtime.changes.put_nowait(change)
    created = await client.post(f"{E2B}/filesystem.Filesystem/CreateWatcher",
                                json={"path": "w", "includeEntry": True, "allowNetworkMounts": True})
    watcher = created.json()["watcherId"]
    events: list[dict] = []
    for _ in range(100):
        answer = await client.post(f"{E2B}/filesystem.Filesystem/GetWatcherEvents", json={"watcherId": watcher})
        events += answer.json()["events"]
        if len(events) == 3:
            break
        await asyncio.sleep(0.01)
    write, remove, rename = events
    assert write["type"] == "EVENT_TYPE_WRITE" and write["entry"]["path"] == "/home/user/w/f.txt"
    assert write["entry"]["name"] == "f.txt" and write["entry"]["type"] == "FILE_TYPE_FILE"
    assert "entry" not in remove and "entry" not in rename


# -- signed file URLs ---------------------------------------------------------------------


def test_a_signature_is_made_as_the_sdks_make_it():
    # What e2b 2.45's get_signature("/home/user/a b.txt", "read", "user", "tok") gives.
    assert signing.file_signature("/home/user/a b.txt", "read", "user", "tok", None) == \
        "v1_PDhK3P0/VVi45RSAUklPxX4trWseAV9dTwwq5slGI3g"


def signed_query(sandbox: dict, path: str, operation: str, expiration: int | None = None) -> dict:
    query = {"path": path, "username": "user",
             "signature": signing.file_signature(path, operation, "user", sandbox["envdAccessToken"], expiration)}
    if expiration is not None:
        query["signature_expiration"] = str(expiration)
    return query


async def test_signed_urls_at_the_daemons_root_find_their_sandbox_by_its_signature(plane):
    async with plane.http() as client:
        client.headers["X-API-KEY"] = plane.key_for("alice")
        others = [(await client.post(f"{E2B}/v2/sandboxes", json={"templateID": "base"})).json() for _ in range(2)]
        sandbox = others.pop()
        del client.headers["X-API-KEY"]  # what urllib sends: the URL alone

        upload = await client.post("/files", params=signed_query(sandbox, "s.txt", signing.WRITE),
                                   files=[("file", ("s.txt", b"signed"))])
        assert upload.status_code == 200, upload.text
        assert upload.json() == [{"name": "s.txt", "type": "file", "path": "/home/user/s.txt"}]
        download = await client.get("/files", params=signed_query(sandbox, "s.txt", signing.READ))
        assert download.status_code == 200 and download.content == b"signed"
        lasting = await client.get("/files", params=signed_query(sandbox, "s.txt", signing.READ, int(time.time()) + 60))
        assert lasting.status_code == 200 and lasting.content == b"signed"

        expired = await client.get("/files", params=signed_query(sandbox, "s.txt", signing.READ, int(time.time()) - 120))
        assert expired.status_code == 401
        assert expired.json() == {"code": 401, "message": "signature is already expired"}
        for refused in (
            await client.post("/files", params=signed_query(sandbox, "s.txt", signing.READ), content=b"x",
                              headers={"content-type": "application/octet-stream"}),  # a read signature
            await client.get("/files", params={**signed_query(sandbox, "s.txt", signing.READ), "path": "t.txt"}),
            await client.get(f"{E2B}/files", params=signed_query(sandbox, "s.txt", signing.READ),
                             headers={"E2b-Sandbox-Id": others[0]["sandboxID"]}),  # not that sandbox's
        ):
            assert refused.status_code == 401 and refused.json() == {"code": 401, "message": "invalid signature"}
