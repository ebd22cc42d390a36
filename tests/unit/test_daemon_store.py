"""The SQLite store: schema versions, durability across reopen, atomic quota."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from boxd.daemon.store import MIGRATIONS, Store
from boxd.errors import Conflict, NotFound, QuotaExceeded
from boxd.models import MachineCreate, MachineState


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
    assert len(stores[0].alive_machines()) == 3


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
