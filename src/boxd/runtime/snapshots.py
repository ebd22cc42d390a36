"""Snapshots on disk: a capture made durable, compressed, and named by its content.

A snapshot is a folder ``snapshots/<digest>/`` holding

- ``ram.zst``: the guest RAM at the captured instant (zstd);
- ``state.zst``: QEMU's device state at that instant;
- ``disk.qcow2``: the machine's disk at that instant as one compressed qcow2 layer over
  its image's root filesystem (the image is content-addressed, so it stays the same);
- ``manifest.json``: what the machine was (size, image, QEMU version, machine type,
  accelerator) and the SHA-256 and size of every file.

The digest is the SHA-256 of the manifest's canonical JSON, so it covers every byte of
the snapshot. A folder is written as ``.partial-*`` and renamed into place once every
file is synced: a crash leaves a partial folder (collected later), never a half snapshot.
Before use every file is checked against the manifest, and a snapshot taken with another
QEMU, machine type or accelerator is refused: its device state would not load.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boxd.durable import fsync_path, sha256_file
from boxd.errors import HostError, NotFound, SnapshotUnusable
from boxd.runtime.qemu import MACHINE_TYPE, qemu_version, run_tool

FORMAT = 1
DIGEST = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 8 * 1024 * 1024
# Called with (bytes done, bytes in all) while a snapshot is written.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class SnapshotManifest:
    digest: str
    data: dict[str, Any]

    @property
    def size_bytes(self) -> int:
        return sum(entry["size"] for entry in self.data["files"].values())


def _digest_of(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def zstd_binary() -> str:
    path = shutil.which("zstd")
    if path is None:
        raise HostError("zstd not found: install the Debian package zstd (apt-get install zstd)")
    return path


async def _compress(source: Path, destination: Path, on_bytes: Callable[[int], None]) -> None:
    """zstd ``source`` into ``destination``, feeding it ourselves so progress is real."""
    process = await asyncio.create_subprocess_exec(
        zstd_binary(), "-q", "-3", "-T0", "-o", str(destination), "-",
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    assert process.stdin is not None and process.stderr is not None
    try:
        with open(source, "rb") as handle:
            while chunk := await asyncio.to_thread(handle.read, CHUNK):
                process.stdin.write(chunk)
                await process.stdin.drain()
                on_bytes(len(chunk))
        process.stdin.close()
        errors = await process.stderr.read()
        if await process.wait() != 0:
            raise HostError(f"zstd failed compressing {source.name}: {errors.decode(errors='replace')[-300:]}")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def write_snapshot(
    root: Path,
    *,
    ram: Path,
    state: Path,
    disk_top: Path,
    image_rootfs: Path,
    machine: dict[str, Any],
    progress: Progress | None = None,
) -> SnapshotManifest:
    """Write a snapshot of one capture under ``root``; returns its manifest and digest."""
    total = ram.stat().st_size + disk_top.stat().st_size
    done = 0
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".partial-{os.getpid()}-{os.urandom(4).hex()}"
    partial.mkdir()

    def advance(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(min(done, total), total)

    try:
        await _compress(ram, partial / "ram.zst", advance)
        await _compress(state, partial / "state.zst", lambda _: None)
        # Only what differs from the image goes in; the image itself is content-addressed.
        await run_tool(
            "qemu-img", "convert", "-c", "-O", "qcow2", "-B", str(image_rootfs), "-F", "qcow2",
            str(disk_top), str(partial / "disk.qcow2"),
        )
        advance(disk_top.stat().st_size)
        files = {}
        for name in ("ram.zst", "state.zst", "disk.qcow2"):
            path = partial / name
            files[name] = {"sha256": await asyncio.to_thread(sha256_file, path), "size": path.stat().st_size}
        manifest = {
            "format": FORMAT,
            "qemu": qemu_version(),
            "machine_type": MACHINE_TYPE,
            **machine,
            "files": files,
        }
        digest = _digest_of(manifest)
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        for path in partial.iterdir():
            await asyncio.to_thread(fsync_path, path)
        final = root / digest
        if final.exists():  # the same bytes were saved before
            shutil.rmtree(partial)
        else:
            os.rename(partial, final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return SnapshotManifest(digest, manifest)


def read_manifest(root: Path, digest: str) -> SnapshotManifest:
    if not DIGEST.match(digest):
        raise SnapshotUnusable(f"snapshot: {digest!r} is not a snapshot digest", field="snapshot")
    try:
        data = json.loads((root / digest / "manifest.json").read_text())
    except FileNotFoundError:
        raise NotFound(f"snapshot {digest[:12]}: no such snapshot on this host", field="snapshot") from None
    except ValueError:
        raise SnapshotUnusable(f"snapshot {digest[:12]}: its manifest is not valid JSON", field="snapshot") from None
    if _digest_of(data) != digest:
        raise SnapshotUnusable(f"snapshot {digest[:12]}: its manifest does not match its digest", field="snapshot")
    return SnapshotManifest(digest, data)


def check_usable(manifest: SnapshotManifest, accelerator: str) -> None:
    """Refuse a snapshot whose device state this host's QEMU could not load, saying why."""
    data, short = manifest.data, manifest.digest[:12]
    if data.get("format") != FORMAT:
        raise SnapshotUnusable(f"snapshot {short}: format {data.get('format')}, this boxd reads {FORMAT}")
    if data["qemu"] != qemu_version():
        raise SnapshotUnusable(
            f"snapshot {short}: made with {data['qemu']!r}, this host runs {qemu_version()!r}; "
            "QEMU only loads device state of its own version"
        )
    if data["machine_type"] != MACHINE_TYPE:
        raise SnapshotUnusable(
            f"snapshot {short}: machine type {data['machine_type']!r}, machines here are {MACHINE_TYPE!r}"
        )
    if data["accelerator"] != accelerator:
        raise SnapshotUnusable(
            f"snapshot {short}: made under {data['accelerator']}, this host runs machines under {accelerator}; "
            "CPU state does not carry across accelerators"
        )


def verify_files(root: Path, manifest: SnapshotManifest) -> None:
    """Every file's size and SHA-256 against the manifest: a corrupt snapshot is never used."""
    for name, entry in manifest.data["files"].items():
        path = root / manifest.digest / name
        short = manifest.digest[:12]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise SnapshotUnusable(f"snapshot {short}: {name} is missing") from None
        if size != entry["size"] or sha256_file(path) != entry["sha256"]:
            raise SnapshotUnusable(f"snapshot {short}: {name} is corrupt (its SHA-256 does not match the manifest)")


async def unpack_ram_and_state(root: Path, manifest: SnapshotManifest, destination: Path) -> None:
    """The snapshot's RAM (sparse: zero runs stay holes) and device state, into ``destination``."""
    folder = root / manifest.digest
    destination.mkdir(parents=True, exist_ok=True)
    for name in ("ram", "state"):
        await run_tool(zstd_binary(), "-q", "-d", "--sparse", "-f", "-o", str(destination / name), str(folder / f"{name}.zst"))


def remove_snapshot(root: Path, digest: str) -> None:
    if DIGEST.match(digest):
        shutil.rmtree(root / digest, ignore_errors=True)


def remove_partials(root: Path) -> None:
    """Folders of saves that a crash cut short."""
    for partial in root.glob(".partial-*"):
        with contextlib.suppress(OSError):
            shutil.rmtree(partial)


ChunkReader = Callable[[str, int, int], Awaitable[bytes]]
PieceReader = Callable[[int, int], Awaitable[bytes]]
TRANSFER_CHUNK = 8 * 1024 * 1024  # pieces of a file copied between hosts


def read_piece(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read(length)


async def fetch_into(path: Path, size: int, fetch: PieceReader) -> int:
    """Write a file of ``size`` bytes another host holds, piece by piece through
    ``fetch(offset, length)``; returns the bytes written."""
    written = 0
    with open(path, "wb") as handle:
        for offset in range(0, size, TRANSFER_CHUNK):
            data = await fetch(offset, TRANSFER_CHUNK)
            handle.write(data)
            written += len(data)
    return written


def snapshot_digests(root: Path) -> list[str]:
    """The snapshots this host holds whole (a save or a transfer still under way is not one)."""
    return sorted(path.name for path in root.iterdir() if DIGEST.match(path.name) and (path / "manifest.json").exists())


def read_chunk(root: Path, digest: str, name: str, offset: int, length: int) -> bytes:
    """A piece of one of a snapshot's files, for a host that copies it."""
    if not DIGEST.match(digest) or name not in {"manifest.json", *read_manifest(root, digest).data["files"]}:
        raise NotFound(f"snapshot {digest[:12]}: no file {name!r}", field="snapshot")
    return read_piece(root / digest / name, offset, length)


async def receive_snapshot(root: Path, digest: str, fetch: ChunkReader) -> int:
    """Copy a snapshot from another host, piece by piece through ``fetch(name, offset,
    length)``; every file is checked against the manifest before the copy is used, so a
    cut or corrupt transfer leaves nothing behind. Returns the bytes copied."""
    if (root / digest / "manifest.json").exists():
        return 0
    partial = root / f".partial-{secrets.token_hex(6)}"
    folder = partial / digest
    folder.mkdir(parents=True)
    copied = 0
    try:
        (folder / "manifest.json").write_bytes(await fetch("manifest.json", 0, TRANSFER_CHUNK))
        manifest = read_manifest(partial, digest)
        for name, entry in manifest.data["files"].items():
            copied += await fetch_into(folder / name, entry["size"], functools.partial(fetch, name))
        await asyncio.to_thread(verify_files, partial, manifest)
        for path in folder.iterdir():
            fsync_path(path)
        try:
            os.rename(folder, root / digest)
        except OSError:  # another transfer of it won the race: theirs is as good
            pass
        fsync_path(root)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return copied
