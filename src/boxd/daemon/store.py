"""The daemon's state: accounts, API keys and machines, in one SQLite file.

WAL with ``synchronous=FULL``: a write the daemon acknowledged is on disk, so a crash
loses nothing. Every write is one transaction; ``BEGIN IMMEDIATE`` takes the write lock
up front, which is what makes the quota check and the insert of a machine atomic.
The schema moves forward by numbered migrations recorded in ``PRAGMA user_version``.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from boxd.errors import Conflict, NotFound, QuotaExceeded
from boxd.models import (
    ALIVE_STATES,
    Account,
    ApiKey,
    Checkpoint,
    Machine,
    MachineCreate,
    MachineState,
    Snapshot,
    SnapshotState,
)

DEFAULT_MAX_MACHINES = 50

MIGRATIONS: list[str] = [
    # 1: accounts, keys, machines. A deleted machine keeps its row (history) but frees
    # its name, hence the partial unique index.
    """
    CREATE TABLE accounts (
        name TEXT PRIMARY KEY,
        max_machines INTEGER NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        account TEXT NOT NULL REFERENCES accounts(name),
        name TEXT,
        secret_sha256 TEXT NOT NULL,
        created_at REAL NOT NULL,
        revoked_at REAL
    );
    CREATE TABLE machines (
        id TEXT PRIMARY KEY,
        account TEXT NOT NULL REFERENCES accounts(name),
        name TEXT NOT NULL,
        state TEXT NOT NULL,
        vcpus INTEGER NOT NULL,
        memory_mib INTEGER NOT NULL,
        disk_gib INTEGER NOT NULL,
        isolated INTEGER NOT NULL,
        image TEXT,
        reason TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        deleted_at REAL
    );
    CREATE UNIQUE INDEX machines_live_name ON machines(account, name) WHERE deleted_at IS NULL;
    CREATE INDEX machines_by_state ON machines(account, state);
    """,
    """
    ALTER TABLE machines ADD COLUMN parent TEXT;
    """,
    # 3: checkpoints belong to a machine; snapshots to an account, one row a version.
    # A deleted version keeps its row, so that its number is never given out again.
    """
    CREATE TABLE checkpoints (
        machine TEXT NOT NULL REFERENCES machines(id),
        name TEXT NOT NULL,
        capture TEXT NOT NULL,
        pause_ms REAL NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (machine, name)
    );
    CREATE TABLE snapshots (
        account TEXT NOT NULL REFERENCES accounts(name),
        name TEXT NOT NULL,
        version INTEGER NOT NULL,
        state TEXT NOT NULL,
        digest TEXT,
        machine TEXT NOT NULL,
        capture TEXT,
        vcpus INTEGER NOT NULL,
        memory_mib INTEGER NOT NULL,
        disk_gib INTEGER NOT NULL,
        isolated INTEGER NOT NULL,
        size_bytes INTEGER,
        pause_ms REAL,
        reason TEXT,
        created_at REAL NOT NULL,
        deleted_at REAL,
        PRIMARY KEY (account, name, version)
    );
    CREATE INDEX snapshots_by_digest ON snapshots(digest);
    """,
    # 4: idle policy, URL port and visibility per machine (NULL: the daemon's default).
    """
    ALTER TABLE machines ADD COLUMN suspend_after_s REAL;
    ALTER TABLE machines ADD COLUMN hibernate_after_s REAL;
    ALTER TABLE machines ADD COLUMN http_port INTEGER NOT NULL DEFAULT 8080;
    ALTER TABLE machines ADD COLUMN public INTEGER NOT NULL DEFAULT 0;
    """,
    # 5: keys handed to one machine (for the SDK inside it), revoked when it goes.
    """
    ALTER TABLE api_keys ADD COLUMN machine TEXT;
    """,
    # 6: what the E2B API keeps of a machine it made: the template asked for, metadata,
    # environment for its commands, the token of its envd calls, when it expires.
    """
    CREATE TABLE e2b_sandboxes (
        machine TEXT PRIMARY KEY REFERENCES machines(id),
        template TEXT NOT NULL,
        metadata TEXT NOT NULL,
        env TEXT NOT NULL,
        access_token TEXT NOT NULL,
        expires_at REAL,
        auto_pause INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX e2b_sandboxes_by_expiry ON e2b_sandboxes(expires_at);
    CREATE UNIQUE INDEX e2b_sandboxes_by_token ON e2b_sandboxes(access_token);
    """,
    # 7: the host that runs a machine, when machines run on a cluster.
    """
    ALTER TABLE machines ADD COLUMN host TEXT;
    """,
    # 8: whether an E2B sandbox that pauses when its time runs out keeps its memory.
    """
    ALTER TABLE e2b_sandboxes ADD COLUMN auto_pause_memory INTEGER NOT NULL DEFAULT 1;
    """,
]

_ALIVE = tuple(state.value for state in ALIVE_STATES)
_ALIVE_SQL = ",".join("?" * len(_ALIVE))


@dataclass(frozen=True)
class SandboxRecord:
    """What the E2B API keeps of one of its sandboxes (a machine)."""

    machine: str
    template: str
    metadata: dict[str, str]
    env: dict[str, str]
    access_token: str
    expires_at: float | None
    auto_pause: bool = False
    auto_pause_memory: bool = True  # False: that pause keeps only the disk


def _sandbox(row: sqlite3.Row) -> SandboxRecord:
    return SandboxRecord(
        machine=row["machine"], template=row["template"], metadata=json.loads(row["metadata"]),
        env=json.loads(row["env"]), access_token=row["access_token"], expires_at=row["expires_at"],
        auto_pause=bool(row["auto_pause"]), auto_pause_memory=bool(row["auto_pause_memory"]),
    )


def _when(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, tz=UTC)


def _machine(row: sqlite3.Row, url_format: str | None = None) -> Machine:
    return Machine(
        suspend_after_s=row["suspend_after_s"],
        hibernate_after_s=row["hibernate_after_s"],
        http_port=row["http_port"],
        public=bool(row["public"]),
        url=url_format.format(name=row["name"]) if url_format and row["deleted_at"] is None else None,
        id=row["id"],
        name=row["name"],
        state=MachineState(row["state"]),
        vcpus=row["vcpus"],
        memory_mib=row["memory_mib"],
        disk_gib=row["disk_gib"],
        isolated=bool(row["isolated"]),
        image=row["image"],
        parent=row["parent"],
        host=row["host"],
        reason=row["reason"],
        created_at=_when(row["created_at"]),
        updated_at=_when(row["updated_at"]),
    )


def _checkpoint(row: sqlite3.Row) -> Checkpoint:
    return Checkpoint(name=row["name"], machine=row["machine"], pause_ms=row["pause_ms"], created_at=_when(row["created_at"]))


def _snapshot(row: sqlite3.Row) -> Snapshot:
    return Snapshot(
        name=row["name"],
        version=row["version"],
        ref=f"{row['name']}@{row['version']}",
        state=SnapshotState(row["state"]),
        digest=row["digest"],
        machine=row["machine"],
        vcpus=row["vcpus"],
        memory_mib=row["memory_mib"],
        disk_gib=row["disk_gib"],
        isolated=bool(row["isolated"]),
        size_bytes=row["size_bytes"],
        pause_ms=row["pause_ms"],
        reason=row["reason"],
        created_at=_when(row["created_at"]),
    )


def _account(row: sqlite3.Row) -> Account:
    return Account(name=row["name"], max_machines=row["max_machines"], created_at=_when(row["created_at"]))


def _key(row: sqlite3.Row) -> ApiKey:
    return ApiKey(
        id=row["id"],
        account=row["account"],
        name=row["name"],
        created_at=_when(row["created_at"]),
        revoked_at=_when(row["revoked_at"]),
    )


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        # The daemon uses the store from its event loop; tests may touch it from another
        # thread too, so access is serialized by a lock rather than pinned to one thread.
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._migrate()
        # Set by the daemon once it listens: "http://{name}.localhost:PORT/".
        self.url_format: str | None = None

    def _machine(self, row: sqlite3.Row) -> Machine:
        return _machine(row, self.url_format)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @property
    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        for version, script in enumerate(MIGRATIONS, start=1):
            if self.schema_version < version:
                # One script per transaction, the version bump included.
                self._db.executescript(f"BEGIN IMMEDIATE;\n{script}\nPRAGMA user_version = {version};\nCOMMIT;")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, *args: object) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- accounts ---------------------------------------------------------------------

    def set_account(self, name: str, max_machines: int | None) -> Account:
        """Create the account, or change its limit; ``None`` keeps it (50 for a new one)."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO accounts (name, max_machines, created_at) VALUES (?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET max_machines = coalesce(?, max_machines)",
                (name, DEFAULT_MAX_MACHINES if max_machines is None else max_machines, time.time(), max_machines),
            )
            return _account(db.execute("SELECT * FROM accounts WHERE name = ?", (name,)).fetchone())

    def get_account(self, name: str) -> Account:
        rows = self._read("SELECT * FROM accounts WHERE name = ?", name)
        if not rows:
            raise NotFound(f"no account named {name}", field="account")
        return _account(rows[0])

    def list_accounts(self) -> list[Account]:
        return [_account(row) for row in self._read("SELECT * FROM accounts ORDER BY name")]

    # -- keys -------------------------------------------------------------------------

    def add_key(
        self, key_id: str, account: str, name: str | None, secret_sha256: str, *, machine: str | None = None
    ) -> ApiKey:
        """A new key; one for a ``machine`` replaces (revokes) the keys that machine had."""
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM accounts WHERE name = ?", (account,)).fetchone() is None:
                raise NotFound(
                    f"no account named {account}; create it with: boxd accounts set {account}", field="account"
                )
            if machine is not None:
                self._revoke_machine_keys(db, machine)
            db.execute(
                "INSERT INTO api_keys (id, account, name, secret_sha256, created_at, machine) VALUES (?, ?, ?, ?, ?, ?)",
                (key_id, account, name, secret_sha256, time.time(), machine),
            )
            return _key(db.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone())

    def key_secret(self, key_id: str) -> tuple[str, str] | None:
        """The account and secret digest of a key that is not revoked, if there is one."""
        rows = self._read(
            "SELECT account, secret_sha256 FROM api_keys WHERE id = ? AND revoked_at IS NULL", key_id
        )
        return (rows[0]["account"], rows[0]["secret_sha256"]) if rows else None

    def list_keys(self) -> list[ApiKey]:
        return [_key(row) for row in self._read("SELECT * FROM api_keys ORDER BY created_at, id")]

    @staticmethod
    def _revoke_machine_keys(db: sqlite3.Connection, machine_id: str) -> None:
        db.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE machine = ? AND revoked_at IS NULL", (time.time(), machine_id)
        )

    def revoke_key(self, key_id: str) -> ApiKey:
        with self._transaction() as db:
            db.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (time.time(), key_id)
            )
            row = db.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
            if row is None:
                raise NotFound(f"no API key with id {key_id}", field="id")
            return _key(row)

    # -- machines ---------------------------------------------------------------------

    def add_machine(
        self, account: str, machine_id: str, request: MachineCreate, *, parent: str | None = None, image: str | None = None
    ) -> Machine:
        """Record a new ``starting`` machine, if its name is free and the quota allows it."""
        with self._transaction() as db:
            clash = db.execute(
                "SELECT id, state FROM machines WHERE account = ? AND name = ? AND deleted_at IS NULL",
                (account, request.name),
            ).fetchone()
            if clash is not None:
                raise Conflict(
                    f"a machine named {request.name} exists already ({clash['id']}, {clash['state']})",
                    field="name",
                )
            self._check_quota(db, account)
            now = time.time()
            db.execute(
                "INSERT INTO machines (id, account, name, state, vcpus, memory_mib, disk_gib, isolated,"
                " parent, image, suspend_after_s, hibernate_after_s, http_port, public, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    machine_id, account, request.name, MachineState.STARTING.value, request.vcpus,
                    request.memory_mib, request.disk_gib, int(request.isolated), parent, image,
                    request.suspend_after_s, request.hibernate_after_s, request.http_port, int(request.public),
                    now, now,
                ),
            )
            return self._machine(db.execute("SELECT * FROM machines WHERE id = ?", (machine_id,)).fetchone())

    @staticmethod
    def _check_quota(db: sqlite3.Connection, account: str) -> None:
        """Inside a write transaction, so that the check and what it allows are one step."""
        limit = db.execute("SELECT max_machines FROM accounts WHERE name = ?", (account,)).fetchone()[0]
        running = db.execute(
            f"SELECT count(*) FROM machines WHERE account = ? AND state IN ({_ALIVE_SQL})", (account, *_ALIVE)
        ).fetchone()[0]
        if running >= limit:
            raise QuotaExceeded(
                f"quota exceeded: account {account} may run at most {limit} machines and {running} are running",
                limit=limit,
                running=running,
            )

    def find_machine(self, account: str, ref: str) -> Machine:
        """A live machine of this account by id or by name; another account's is not found."""
        rows = self._read(
            "SELECT * FROM machines WHERE account = ? AND deleted_at IS NULL AND (id = ? OR name = ?)",
            account, ref, ref,
        )
        if not rows:
            raise NotFound(f"no machine named or with id {ref}", field="machine")
        return self._machine(rows[0])

    def list_machines(self, account: str) -> list[Machine]:
        rows = self._read(
            "SELECT * FROM machines WHERE account = ? AND deleted_at IS NULL ORDER BY created_at, id", account
        )
        return [self._machine(row) for row in rows]

    def machines_on_host(self) -> list[Machine]:
        """Every account's machines that have a process or a hibernated state: what a restart re-adopts."""
        states = (*_ALIVE, MachineState.STOPPED.value)
        rows = self._read(
            f"SELECT * FROM machines WHERE state IN ({','.join('?' * len(states))}) ORDER BY created_at", *states
        )
        return [self._machine(row) for row in rows]

    def account_of(self, machine_id: str) -> str:
        return self._read("SELECT account FROM machines WHERE id = ?", machine_id)[0]["account"]

    def find_public_machine(self, ref: str) -> Machine:
        """A live public machine of any account, by id, or by name where only one has it."""
        rows = self._read(
            "SELECT * FROM machines WHERE public = 1 AND deleted_at IS NULL AND state != ? AND (id = ? OR name = ?)",
            MachineState.FAILED.value, ref, ref,
        )
        if len(rows) != 1:
            raise NotFound(f"no public machine named or with id {ref}", field="machine")
        return self._machine(rows[0])

    def wake_machine(self, machine_id: str) -> Machine:
        """A hibernated machine becomes ``starting`` if its account's quota allows one more."""
        with self._transaction() as db:
            account = db.execute("SELECT account FROM machines WHERE id = ?", (machine_id,)).fetchone()[0]
            self._check_quota(db, account)
            db.execute(
                "UPDATE machines SET state = ?, reason = NULL, updated_at = ? WHERE id = ?",
                (MachineState.STARTING.value, time.time(), machine_id),
            )
            return self._machine(db.execute("SELECT * FROM machines WHERE id = ?", (machine_id,)).fetchone())

    def update_machine(
        self,
        machine_id: str,
        *,
        state: MachineState | None = None,
        reason: str | None = None,
        image: str | None = None,
        host: str | None = None,
        only_from: MachineState | None = None,
    ) -> Machine | None:
        """Change a live machine; with ``only_from``, only if it is in that state still.

        Returns the machine as it is afterwards, or None if it was not changed.
        """
        assignments, values = ["updated_at = ?"], [time.time()]
        if state is not None:
            assignments.append("state = ?")
            values.append(state.value)
            assignments.append("reason = ?")
            values.append(reason)
        if image is not None:
            assignments.append("image = ?")
            values.append(image)
        if host is not None:
            assignments.append("host = ?")
            values.append(host)
        condition = "id = ? AND deleted_at IS NULL"
        values.append(machine_id)
        if only_from is not None:
            condition += " AND state = ?"
            values.append(only_from.value)
        with self._transaction() as db:
            changed = db.execute(f"UPDATE machines SET {', '.join(assignments)} WHERE {condition}", values).rowcount
            if not changed:
                return None
            return self._machine(db.execute("SELECT * FROM machines WHERE id = ?", (machine_id,)).fetchone())

    def mark_deleted(self, machine_id: str) -> Machine:
        now = time.time()
        with self._transaction() as db:
            db.execute(
                "UPDATE machines SET state = ?, deleted_at = ?, updated_at = ? WHERE id = ? AND deleted_at IS NULL",
                (MachineState.DELETED.value, now, now, machine_id),
            )
            # A checkpoint belongs to its machine and goes with it, and so does its key.
            db.execute("DELETE FROM checkpoints WHERE machine = ?", (machine_id,))
            self._revoke_machine_keys(db, machine_id)
            return self._machine(db.execute("SELECT * FROM machines WHERE id = ?", (machine_id,)).fetchone())

    # -- E2B sandboxes ----------------------------------------------------------------

    def add_sandbox(self, sandbox: SandboxRecord) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO e2b_sandboxes (machine, template, metadata, env, access_token, expires_at, auto_pause,"
                " auto_pause_memory) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (sandbox.machine, sandbox.template, json.dumps(sandbox.metadata), json.dumps(sandbox.env),
                 sandbox.access_token, sandbox.expires_at, int(sandbox.auto_pause), int(sandbox.auto_pause_memory)),
            )

    def find_sandbox(self, machine_id: str) -> SandboxRecord | None:
        rows = self._read("SELECT * FROM e2b_sandboxes WHERE machine = ?", machine_id)
        return _sandbox(rows[0]) if rows else None

    def find_sandbox_by_token(self, access_token: str) -> SandboxRecord | None:
        rows = self._read("SELECT * FROM e2b_sandboxes WHERE access_token = ?", access_token)
        return _sandbox(rows[0]) if rows else None

    def set_sandbox_expiry(self, machine_id: str, expires_at: float | None) -> None:
        with self._transaction() as db:
            db.execute("UPDATE e2b_sandboxes SET expires_at = ? WHERE machine = ?", (expires_at, machine_id))

    def set_sandbox_auto_pause(self, machine_id: str, auto_pause: bool) -> None:
        with self._transaction() as db:
            db.execute("UPDATE e2b_sandboxes SET auto_pause = ? WHERE machine = ?", (int(auto_pause), machine_id))

    def live_sandboxes(self) -> list[tuple[SandboxRecord, Machine]]:
        """Every account's sandboxes whose machine is not deleted."""
        rows = self._read(
            "SELECT s.*, m.* FROM e2b_sandboxes s JOIN machines m ON m.id = s.machine WHERE m.deleted_at IS NULL"
        )
        return [(_sandbox(row), self._machine(row)) for row in rows]

    def expired_sandboxes(self, now: float) -> list[tuple[SandboxRecord, Machine]]:
        """Sandboxes past their time whose machine is not deleted (one paused through the
        E2B API has no expiry until it is resumed; one boxd put to sleep when idle has)."""
        rows = self._read(
            "SELECT s.*, m.* FROM e2b_sandboxes s JOIN machines m ON m.id = s.machine"
            " WHERE s.expires_at IS NOT NULL AND s.expires_at <= ? AND m.deleted_at IS NULL",
            now,
        )
        return [(_sandbox(row), self._machine(row)) for row in rows]

    # -- checkpoints ------------------------------------------------------------------

    def add_checkpoint(self, machine_id: str, name: str, capture: str, pause_ms: float) -> Checkpoint:
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM checkpoints WHERE machine = ? AND name = ?", (machine_id, name)).fetchone():
                raise Conflict(f"the machine has a checkpoint named {name} already", field="name")
            db.execute(
                "INSERT INTO checkpoints (machine, name, capture, pause_ms, created_at) VALUES (?, ?, ?, ?, ?)",
                (machine_id, name, capture, pause_ms, time.time()),
            )
            return _checkpoint(
                db.execute("SELECT * FROM checkpoints WHERE machine = ? AND name = ?", (machine_id, name)).fetchone()
            )

    def checkpoint_capture(self, machine_id: str, name: str) -> str:
        """The runtime's id of a machine's checkpoint."""
        rows = self._read("SELECT capture FROM checkpoints WHERE machine = ? AND name = ?", machine_id, name)
        if not rows:
            raise NotFound(f"the machine has no checkpoint named {name}", field="checkpoint")
        return rows[0]["capture"]

    def list_checkpoints(self, machine_id: str) -> list[Checkpoint]:
        rows = self._read("SELECT * FROM checkpoints WHERE machine = ? ORDER BY created_at, name", machine_id)
        return [_checkpoint(row) for row in rows]

    def delete_checkpoint(self, machine_id: str, name: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM checkpoints WHERE machine = ? AND name = ?", (machine_id, name))

    # -- snapshots --------------------------------------------------------------------

    def add_snapshot(self, account: str, name: str, machine: Machine, capture: str, pause_ms: float) -> Snapshot:
        """A new ``saving`` version of ``name``: one more than any version it ever had."""
        with self._transaction() as db:
            version = db.execute(
                "SELECT coalesce(max(version), 0) + 1 FROM snapshots WHERE account = ? AND name = ?", (account, name)
            ).fetchone()[0]
            db.execute(
                "INSERT INTO snapshots (account, name, version, state, machine, capture, vcpus, memory_mib,"
                " disk_gib, isolated, pause_ms, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    account, name, version, SnapshotState.SAVING.value, machine.id, capture, machine.vcpus,
                    machine.memory_mib, machine.disk_gib, int(machine.isolated), pause_ms, time.time(),
                ),
            )
            return _snapshot(self._snapshot_row(db, account, name, version))

    @staticmethod
    def _snapshot_row(db: sqlite3.Connection, account: str, name: str, version: int) -> sqlite3.Row:
        return db.execute(
            "SELECT * FROM snapshots WHERE account = ? AND name = ? AND version = ?", (account, name, version)
        ).fetchone()

    def finish_snapshot(
        self, account: str, name: str, version: int, *, digest: str | None = None, size_bytes: int | None = None,
        reason: str | None = None,
    ) -> None:
        """Mark a saving version ready (with its digest) or failed (with the reason)."""
        state = SnapshotState.FAILED if reason is not None else SnapshotState.READY
        with self._transaction() as db:
            db.execute(
                "UPDATE snapshots SET state = ?, digest = ?, size_bytes = ?, reason = ?, capture = NULL"
                " WHERE account = ? AND name = ? AND version = ?",
                (state.value, digest, size_bytes, reason, account, name, version),
            )

    def find_snapshot(self, account: str, ref: str) -> Snapshot:
        """NAME (its newest ready version), NAME@VERSION, or a digest (12 hex digits or more)."""
        name, at, version = ref.partition("@")
        if at:
            if not version.isdigit():
                raise NotFound(f"snapshot {ref}: the version after @ must be a number", field="snapshot")
            rows = self._read(
                "SELECT * FROM snapshots WHERE account = ? AND name = ? AND version = ? AND deleted_at IS NULL",
                account, name, int(version),
            )
        else:
            rows = self._read(
                "SELECT * FROM snapshots WHERE account = ? AND name = ? AND state = ? AND deleted_at IS NULL"
                " ORDER BY version DESC LIMIT 1",
                account, name, SnapshotState.READY.value,
            )
            if not rows and len(ref) >= 12 and all(c in "0123456789abcdef" for c in ref):
                rows = self._read(
                    "SELECT * FROM snapshots WHERE account = ? AND digest LIKE ? AND deleted_at IS NULL"
                    " ORDER BY created_at DESC LIMIT 1",
                    account, f"{ref}%",
                )
        if not rows:
            raise NotFound(f"no snapshot {ref}", field="snapshot")
        return _snapshot(rows[0])

    def snapshot_versions(self, account: str, name: str) -> list[Snapshot]:
        rows = self._read(
            "SELECT * FROM snapshots WHERE account = ? AND name = ? AND deleted_at IS NULL ORDER BY version",
            account, name,
        )
        return [_snapshot(row) for row in rows]

    def list_snapshots(self, account: str) -> list[Snapshot]:
        rows = self._read(
            "SELECT * FROM snapshots WHERE account = ? AND deleted_at IS NULL ORDER BY name, version", account
        )
        return [_snapshot(row) for row in rows]

    def delete_snapshot(self, account: str, name: str, version: int) -> bool:
        """Mark one version deleted; True if no live version anywhere still has its digest."""
        with self._transaction() as db:
            row = self._snapshot_row(db, account, name, version)
            db.execute(
                "UPDATE snapshots SET deleted_at = ? WHERE account = ? AND name = ? AND version = ?",
                (time.time(), account, name, version),
            )
            if row["digest"] is None:
                return False
            left = db.execute(
                "SELECT count(*) FROM snapshots WHERE digest = ? AND deleted_at IS NULL", (row["digest"],)
            ).fetchone()[0]
            return left == 0

    def saving_snapshots(self) -> list[tuple[str, Snapshot, str | None]]:
        """Every account's versions still marked saving, with their account and checkpoint."""
        rows = self._read("SELECT * FROM snapshots WHERE state = ? AND deleted_at IS NULL", SnapshotState.SAVING.value)
        return [(row["account"], _snapshot(row), row["capture"]) for row in rows]
