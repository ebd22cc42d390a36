"""Faulting a process's file mapping in from outside it, as a capture does for QEMU's guest RAM."""

from __future__ import annotations

import mmap
import os

from boxd.runtime.qemu import fault_in_mapping


def resident_kib(path) -> int:
    """Rss of this process's mapping of ``path``, from /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        if "-" in line.split()[0] and ":" not in line.split()[0]:
            inside = line.rstrip().endswith(" " + str(path))
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError(f"{path} is not mapped")


def test_every_page_of_the_mapping_becomes_resident(tmp_path):
    path = tmp_path / "ram"
    size = 8 * 1024 * 1024
    with open(path, "wb") as handle:
        handle.truncate(size)  # all holes: nothing resident until touched
    with open(path, "r+b") as handle, mmap.mmap(handle.fileno(), size) as mapping:
        assert resident_kib(path) < 1024
        fault_in_mapping(os.getpid(), path, chunk=3 * 4096 * 100)  # a chunk that does not divide it
        assert resident_kib(path) == size // 1024
        assert mapping[:16] == bytes(16)  # read only: the contents are as they were
