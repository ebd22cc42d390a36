"""The SQLite store: schema versions, durability across reopen, atomic quota."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from boxd.daemon.store import MIGRATIONS, Store
from boxd.errors import Conflict, NotFound, QuotaExceeded
from boxd.models import MachineCreate, MachineState, SnapshotState


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path / "boxd.db")
    store.set_account("alice", 2)
    yield store
    store.close()


def test_a_new_store_is_at_the_latest_schema_in_wal_mode(store):
    assert store.schema_version == len(MIGRATIONS)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_everything_survives_reopen(tmp_path):
    path = tmp_path / "boxd.db"
    first = Store(path)
    first.set_account("alice", 7)
    first.add_key("0123456789ab", "alice", "ci", "f" * 64)
    machine = first.add_machine("alice", "m-000000000001", MachineCreate(name="kept"))
    first.update_machine(machine.id, state=MachineState.RUNNING)
    first.close()

    again = Store(path)
    try:
        assert again.schema_version == len(MIGRATIONS)
        assert again.get_account("alice").max_machines == 7
        assert again.key_secret("0123456789ab") == ("alice", "f" * 64)
        assert again.find_machine("alice", "kept").state is MachineState.RUNNING
    finally:
        again.close()


def test_a_write_is_on_disk_before_the_call_returns(store, tmp_path):
    store.add_machine("alice", "m-000000000001", MachineCreate(name="durable"))
    # Another connection (another process, after a crash) sees it at once.
    other = sqlite3.connect(tmp_path / "boxd.db")
    assert other.execute("SELECT name FROM machines").fetchall() == [("durable",)]
    other.close()


def test_quota_counts_only_alive_machines(store):
    first = store.add_machine("alice", "m-000000000001", MachineCreate(name="a"))
    store.add_machine("alice", "m-000000000002", MachineCreate(name="b"))
    with pytest.raises(QuotaExceeded) as raised:
        store.add_machine("alice", "m-000000000003", MachineCreate(name="c"))
    assert raised.value.details == {"limit": 2, "running": 2}
    store.update_machine(first.id, state=MachineState.FAILED, reason="test")
    store.add_machine("alice", "m-000000000003", MachineCreate(name="c"))


def test_quota_holds_across_connections_racing(tmp_path):
    path = tmp_path / "boxd.db"
    Store(path).set_account("alice", 3)
    stores = [Store(path) for _ in range(6)]
    outcomes: list[str] = []
    barrier = threading.Barrier(len(stores))

    def create(index: int) -> None:
        barrier.wait()
        try:
            stores[index].add_machine("alice", f"m-00000000000{index}", MachineCreate(name=f"n{index}"))
            outcomes.append("created")
        except QuotaExceeded:
            outcomes.append("refused")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["created"] * 3 + ["refused"] * 3
    assert len(stores[0].machines_on_host()) == 3


def test_names_are_unique_among_live_machines_only(store):
    first = store.add_machine("alice", "m-000000000001", MachineCreate(name="same"))
    with pytest.raises(Conflict):
        store.add_machine("alice", "m-000000000002", MachineCreate(name="same"))
    store.mark_deleted(first.id)
    store.add_machine("alice", "m-000000000002", MachineCreate(name="same"))
    # The deleted one stays in the history.
    rows = store._db.execute("SELECT id, state FROM machines ORDER BY id").fetchall()
    assert [tuple(row) for row in rows] == [("m-000000000001", "deleted"), ("m-000000000002", "starting")]


def test_update_only_from_a_state(store):
    machine = store.add_machine("alice", "m-000000000001", MachineCreate(name="a"))
    store.update_machine(machine.id, state=MachineState.FAILED, reason="boom")
    assert store.update_machine(machine.id, state=MachineState.RUNNING, only_from=MachineState.STARTING) is None
    assert store.find_machine("alice", "a").reason == "boom"


def test_revoking_an_unknown_key_is_not_found(store):
    with pytest.raises(NotFound):
        store.revoke_key("nope")


def test_checkpoint_names_are_unique_per_machine_and_go_with_it(store):
    machine = store.add_machine("alice", "m-000000000001", MachineCreate(name="a"))
    other = store.add_machine("alice", "m-000000000002", MachineCreate(name="b"))
    store.add_checkpoint(machine.id, "warm", "capture-1", 2.5)
    with pytest.raises(Conflict) as raised:
        store.add_checkpoint(machine.id, "warm", "capture-2", 1.0)
    assert raised.value.field == "name"
    store.add_checkpoint(other.id, "warm", "capture-3", 1.0)  # another machine's namespace
    assert store.checkpoint_capture(machine.id, "warm") == "capture-1"
    store.mark_deleted(machine.id)
    assert store.list_checkpoints(machine.id) == []
    with pytest.raises(NotFound):
        store.checkpoint_capture(machine.id, "warm")
    assert [c.name for c in store.list_checkpoints(other.id)] == ["warm"]


def test_snapshot_versions_resolve_and_survive_reopen(tmp_path):
    path = tmp_path / "boxd.db"
    first = Store(path)
    first.set_account("alice", 2)
    machine = first.add_machine("alice", "m-000000000001", MachineCreate(name="a", memory_mib=256))
    one = first.add_snapshot("alice", "base", machine, "capture-1", 3.0)
    two = first.add_snapshot("alice", "base", machine, "capture-2", 4.0)
    cut = first.add_snapshot("alice", "cut", machine, "capture-3", 5.0)
    assert (one.ref, two.ref, cut.ref) == ("base@1", "base@2", "cut@1")
    assert one.state is SnapshotState.SAVING and one.memory_mib == 256
    first.finish_snapshot("alice", "base", 1, digest="a" * 64, size_bytes=10)
    first.finish_snapshot("alice", "base", 2, digest="b" * 64, size_bytes=20)
    first.close()

    again = Store(path)
    try:
        assert again.find_snapshot("alice", "base").ref == "base@2"
        assert again.find_snapshot("alice", "base@1").digest == "a" * 64
        assert again.find_snapshot("alice", "a" * 12).ref == "base@1"
        assert [(a, s.ref, c) for a, s, c in again.saving_snapshots()] == [("alice", "cut@1", "capture-3")]
        with pytest.raises(NotFound):
            again.find_snapshot("alice", "cut")  # no version of it is ready
        again.set_account("bob", 1)
        with pytest.raises(NotFound):
            again.find_snapshot("bob", "a" * 64)
        # A deleted version's number is not given again.
        assert again.delete_snapshot("alice", "base", 2) is True
        assert again.add_snapshot("alice", "base", machine, "capture-4", 1.0).version == 3
        assert again.find_snapshot("alice", "base").ref == "base@1"
    finally:
        again.close()


def test_a_digest_is_free_only_when_no_live_version_holds_it(store):
    machine = store.add_machine("alice", "m-000000000001", MachineCreate(name="a"))
    for name in ("one", "two"):
        store.add_snapshot("alice", name, machine, f"capture-{name}", 1.0)
        store.finish_snapshot("alice", name, 1, digest="c" * 64, size_bytes=1)
    store.add_snapshot("alice", "failed", machine, "capture-f", 1.0)
    store.finish_snapshot("alice", "failed", 1, reason="boom")
    assert store.delete_snapshot("alice", "one", 1) is False
    assert store.delete_snapshot("alice", "two", 1) is True
    assert store.delete_snapshot("alice", "failed", 1) is False  # it has no files to free
    assert store.list_snapshots("alice") == []


def test_migrating_a_version_3_database_keeps_its_machines(tmp_path):
    path = tmp_path / "boxd.db"
    old = sqlite3.connect(path, isolation_level=None)
    for version, script in enumerate(MIGRATIONS[:3], start=1):
        old.executescript(f"BEGIN;\n{script}\nPRAGMA user_version = {version};\nCOMMIT;")
    old.execute("INSERT INTO accounts VALUES ('alice', 5, 0)")
    old.execute(
        "INSERT INTO machines (id, account, name, state, vcpus, memory_mib, disk_gib, isolated, created_at,"
        " updated_at) VALUES ('m-000000000001', 'alice', 'old', 'running', 2, 1024, 8, 1, 0, 0)"
    )
    old.close()

    store = Store(path)
    try:
        assert store.schema_version == len(MIGRATIONS)
        machine = store.find_machine("alice", "old")
        assert (machine.id, machine.state, machine.vcpus, machine.memory_mib, machine.isolated) == (
            "m-000000000001", MachineState.RUNNING, 2, 1024, True
        )
        # What it never asked for: the daemon's idle limits, port 8080, private.
        assert (machine.suspend_after_s, machine.hibernate_after_s) == (None, None)
        assert (machine.http_port, machine.public) == (8080, False)
    finally:
        store.close()


def test_idle_settings_and_url_are_stored(store):
    asked = MachineCreate(name="web", suspend_after_s=0, hibernate_after_s=30.5, http_port=3000, public=True)
    store.add_machine("alice", "m-000000000001", asked)
    store.add_machine("alice", "m-000000000002", MachineCreate(name="private"))
    store.url_format = "http://{name}.localhost:7345/"
    machine = store.find_machine("alice", "web")
    assert (machine.suspend_after_s, machine.hibernate_after_s, machine.http_port) == (0, 30.5, 3000)
    assert machine.public and machine.url == "http://web.localhost:7345/"
    assert store.find_public_machine("web").id == machine.id
    assert store.find_public_machine(machine.id).id == machine.id
    with pytest.raises(NotFound):
        store.find_public_machine("private")
    assert store.account_of(machine.id) == "alice"


def test_waking_a_hibernated_machine_checks_the_quota(store):
    sleeper = store.add_machine("alice", "m-000000000001", MachineCreate(name="sleeper"))
    store.update_machine(sleeper.id, state=MachineState.STOPPED)
    store.add_machine("alice", "m-000000000002", MachineCreate(name="b"))
    store.add_machine("alice", "m-000000000003", MachineCreate(name="c"))  # a stopped one holds no quota
    with pytest.raises(QuotaExceeded):
        store.wake_machine(sleeper.id)
    assert store.find_machine("alice", "sleeper").state is MachineState.STOPPED
    # Still on the host: a restarted daemon re-adopts it.
    assert {m.id for m in store.machines_on_host()} == {sleeper.id, "m-000000000002", "m-000000000003"}
    store.update_machine("m-000000000003", state=MachineState.FAILED, reason="test")
    assert store.wake_machine(sleeper.id).state is MachineState.STARTING
