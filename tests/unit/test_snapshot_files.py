"""The snapshot folder format: written whole or not at all, named by its content, checked before use."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from boxd.errors import NotFound, SnapshotUnusable
from boxd.runtime import snapshots
from boxd.runtime.snapshots import (
    check_usable,
    read_manifest,
    remove_partials,
    unpack_ram_and_state,
    verify_files,
    write_snapshot,
)

MACHINE = {"vcpus": 1, "memory_mib": 4, "disk_gib": 1, "isolated": False, "image": "0" * 64, "accelerator": "tcg"}


@pytest.fixture
def capture(tmp_path: Path) -> dict[str, Path]:
    """A small stand-in for one capture: a sparse RAM file, device state, a disk layer over a base."""
    ram = tmp_path / "ram"
    with open(ram, "wb") as handle:
        handle.truncate(4 * 1024 * 1024)
        handle.seek(1024 * 1024)
        handle.write(os.urandom(64 * 1024))
    state = tmp_path / "state"
    state.write_bytes(os.urandom(5000))
    base, top = tmp_path / "base.qcow2", tmp_path / "top.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "16M"], check=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(top)], check=True)
    return {"ram": ram, "state": state, "disk_top": top, "image_rootfs": base}


def write(root: Path, capture: dict[str, Path], **changes) -> snapshots.SnapshotManifest:
    return asyncio.run(write_snapshot(root, machine={**MACHINE, **changes}, **capture))


def test_a_snapshot_round_trips_and_its_digest_names_its_content(tmp_path, capture):
    root = tmp_path / "snapshots"
    seen = []
    manifest = asyncio.run(
        write_snapshot(root, machine=MACHINE, progress=lambda done, total: seen.append((done, total)), **capture)
    )
    assert sorted(p.name for p in (root / manifest.digest).iterdir()) == [
        "disk.qcow2", "manifest.json", "ram.zst", "state.zst",
    ]
    assert seen[-1][0] == seen[-1][1] and all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    assert read_manifest(root, manifest.digest) == manifest
    verify_files(root, manifest)
    assert manifest.size_bytes < capture["ram"].stat().st_size  # compressed

    unpacked = tmp_path / "unpacked"
    asyncio.run(unpack_ram_and_state(root, manifest, unpacked))
    assert (unpacked / "ram").read_bytes() == capture["ram"].read_bytes()
    assert (unpacked / "state").read_bytes() == capture["state"].read_bytes()

    # the same bytes again: the same digest and no second folder; other bytes: another one
    assert write(root, capture).digest == manifest.digest
    assert write(root, capture, vcpus=2).digest != manifest.digest
    assert len([p for p in root.iterdir()]) == 2


def test_a_corrupt_or_missing_file_is_refused(tmp_path, capture):
    root = tmp_path / "snapshots"
    manifest = write(root, capture)
    state = root / manifest.digest / "state.zst"
    data = bytearray(state.read_bytes())
    data[-1] ^= 1
    state.write_bytes(bytes(data))
    with pytest.raises(SnapshotUnusable, match="state.zst is corrupt"):
        verify_files(root, manifest)
    state.unlink()
    with pytest.raises(SnapshotUnusable, match="state.zst is missing"):
        verify_files(root, manifest)


def test_a_manifest_that_does_not_match_its_digest_is_refused(tmp_path, capture):
    root = tmp_path / "snapshots"
    manifest = write(root, capture)
    path = root / manifest.digest / "manifest.json"
    data = json.loads(path.read_text())
    data["memory_mib"] = 8
    path.write_text(json.dumps(data))
    with pytest.raises(SnapshotUnusable, match="does not match its digest"):
        read_manifest(root, manifest.digest)
    with pytest.raises(NotFound):
        read_manifest(root, "f" * 64)
    with pytest.raises(SnapshotUnusable, match="not a snapshot digest"):
        read_manifest(root, "../etc")


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("qemu", "QEMU emulator version 9.9.9", "QEMU only loads device state of its own version"),
        ("machine_type", "pc", "machine type 'pc'"),
        ("accelerator", "kvm", "made under kvm, this host runs machines under tcg"),
        ("format", 99, "format 99"),
    ],
)
def test_a_snapshot_from_another_qemu_machine_type_or_accelerator_is_refused(tmp_path, capture, field, value, why):
    manifest = write(tmp_path / "snapshots", capture)
    check_usable(manifest, "tcg")
    changed = snapshots.SnapshotManifest(manifest.digest, {**manifest.data, field: value})
    with pytest.raises(SnapshotUnusable, match=why):
        check_usable(changed, "tcg")


def test_a_save_that_fails_leaves_nothing_and_partials_of_a_crash_are_removed(tmp_path, capture):
    root = tmp_path / "snapshots"
    root.mkdir()
    capture["disk_top"] = tmp_path / "no-such-layer.qcow2"
    with pytest.raises(FileNotFoundError):
        write(root, capture)
    assert list(root.iterdir()) == []
    (root / ".partial-123-abcd").mkdir()
    (root / ".partial-123-abcd" / "ram.zst").write_bytes(b"half")
    remove_partials(root)
    assert list(root.iterdir()) == []


def copy_between(source: Path, destination: Path, digest: str, *, spoil: str | None = None) -> int:
    """What a host does to copy a snapshot from another, with the transfer in process."""

    async def fetch(name: str, offset: int, length: int) -> bytes:
        data = snapshots.read_chunk(source, digest, name, offset, length)
        return b"X" * len(data) if name == spoil and offset == 0 else data

    return asyncio.run(snapshots.receive_snapshot(destination, digest, fetch))


def test_a_snapshot_copied_to_another_host_is_whole_and_checked(tmp_path, capture, monkeypatch):
    source, destination = tmp_path / "a", tmp_path / "b"
    destination.mkdir()
    manifest = write(source, capture)
    monkeypatch.setattr(snapshots, "TRANSFER_CHUNK", 4096)  # many pieces even for a small snapshot
    copied = copy_between(source, destination, manifest.digest)
    assert copied == manifest.size_bytes
    assert snapshots.snapshot_digests(destination) == [manifest.digest]
    verify_files(destination, read_manifest(destination, manifest.digest))
    assert copy_between(source, destination, manifest.digest) == 0  # held already: nothing moves
    with pytest.raises(NotFound):
        snapshots.read_chunk(source, manifest.digest, "../../etc/passwd", 0, 10)


def test_a_corrupt_transfer_leaves_nothing_behind(tmp_path, capture):
    source, destination = tmp_path / "a", tmp_path / "b"
    destination.mkdir()
    manifest = write(source, capture)
    with pytest.raises(SnapshotUnusable):
        copy_between(source, destination, manifest.digest, spoil="ram.zst")
    assert list(destination.iterdir()) == []
