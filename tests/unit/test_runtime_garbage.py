"""Garbage collection of disk layers and captures never takes what a machine being made,
a capture under way or a received capture still needs (no QEMU: the files are stand-ins)."""

from __future__ import annotations

import asyncio

import pytest

from boxd.runtime.interface import VMSpec
from boxd.runtime.local import LocalRuntime


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("BOXD_SHM", str(tmp_path / "shm"))
    return LocalRuntime(tmp_path / "home")


def layer(runtime: LocalRuntime, name: str):
    path = runtime.layers_dir / name
    path.write_bytes(b"qcow2 stand-in")
    return path


def test_a_layer_nothing_names_is_collected(runtime):
    orphan = layer(runtime, "orphan-1234.qcow2")
    asyncio.run(runtime.collect_garbage())
    assert not orphan.exists()


def test_a_machine_being_made_keeps_its_layer_before_its_record_is_written(runtime):
    async def scenario():
        machine = runtime._new_machine("new-one", VMSpec(image="x"), "x")
        top = layer(runtime, machine.disk_top)  # create_overlay done, machine.json not yet
        assert not (runtime._vm_dir("new-one") / "machine.json").exists()
        await runtime.collect_garbage()  # what a delete of another machine runs
        return top

    assert asyncio.run(scenario()).exists()


def test_a_delete_running_while_a_create_makes_its_overlay_takes_nothing_of_it(runtime, monkeypatch):
    """The race as it happened: the overlay is written, then the delete's collection runs,
    then the record is saved."""
    import boxd.runtime.local as local

    made = asyncio.Event()
    go_on = asyncio.Event()

    async def slow_overlay(path, backing, disk_gib=None):
        path.write_bytes(b"qcow2 stand-in")
        made.set()
        await go_on.wait()

    monkeypatch.setattr(local, "create_overlay", slow_overlay)

    async def scenario():
        machine = runtime._new_machine("racer", VMSpec(image="x"), "x")
        making = asyncio.create_task(local.create_overlay(runtime.layers_dir / machine.disk_top, "base"))
        await made.wait()
        await runtime.collect_garbage()
        go_on.set()
        await making
        return runtime.layers_dir / machine.disk_top

    assert asyncio.run(scenario()).exists()


def test_a_held_layer_is_kept_until_let_go(runtime):
    async def scenario():
        new_top = layer(runtime, "source-abcd.qcow2")
        with runtime._holding_layers(new_top.name):  # QEMU made it; the record does not name it yet
            await runtime.collect_garbage()
            assert new_top.exists()
        await runtime.collect_garbage()
        return new_top

    assert not asyncio.run(scenario()).exists()


def test_a_capture_in_use_keeps_its_chain_after_its_source_is_gone(runtime):
    async def scenario():
        frozen = layer(runtime, "gone-source-0001.qcow2")
        (runtime.captures_dir / "gone-source-cap").mkdir()
        runtime._captures_in_use["gone-source-cap"] += 1
        runtime._capture_layers["gone-source-cap"] = [frozen.name]
        await runtime.collect_garbage()
        assert frozen.exists() and (runtime.captures_dir / "gone-source-cap").exists()
        runtime._release("gone-source-cap")  # its forks started (or failed)
        await runtime.collect_garbage()
        return frozen

    assert not asyncio.run(scenario()).exists()
    assert not (runtime.captures_dir / "gone-source-cap").exists()


def test_an_imported_layer_waits_for_the_forks_of_its_capture(runtime):
    async def fetch(offset: int, length: int) -> bytes:
        raise AssertionError("the layer is here already: nothing is copied")

    async def scenario():
        name = "layer-" + "a" * 32 + ".qcow2"
        imported = layer(runtime, name)
        runtime._captures_in_use["remote-1"] += 1  # receive_capture
        assert await runtime.import_layer("remote-1", name, 10, fetch, "x") == 0
        await runtime.collect_garbage()
        assert imported.exists()
        await runtime.drop_capture("remote-1")  # its sender failed
        await runtime.collect_garbage()
        return imported

    assert not asyncio.run(scenario()).exists()


def test_a_layer_cannot_be_imported_for_a_capture_not_being_received(runtime):
    from boxd.errors import NotFound

    async def fetch(offset: int, length: int) -> bytes:
        return b""

    with pytest.raises(NotFound) as refused:
        asyncio.run(runtime.import_layer("remote-none", "layer-" + "b" * 32 + ".qcow2", 0, fetch, "x"))
    assert refused.value.field == "capture"
