"""The control plane's own state in SQLite: runs, their processes and events (survives a restart)."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    config TEXT NOT NULL,
    run_dir TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    reason TEXT,
    attempt INTEGER NOT NULL DEFAULT 0,
    failed_process TEXT,
    exit_code INTEGER,
    log_tail TEXT,
    runtime TEXT
);
CREATE TABLE IF NOT EXISTS processes (
    run_id TEXT NOT NULL,
    name TEXT NOT NULL,
    role TEXT NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER,
    start_ticks INTEGER,
    gpu TEXT,
    state TEXT NOT NULL,
    restarts INTEGER NOT NULL DEFAULT 0,
    started REAL,
    last_heartbeat REAL,
    exit_code INTEGER,
    log_file TEXT,
    PRIMARY KEY (run_id, name)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_run ON events (run_id, id);
"""

RUN_FIELDS = (
    "name",
    "state",
    "config",
    "run_dir",
    "reason",
    "attempt",
    "failed_process",
    "exit_code",
    "log_tail",
    "runtime",
)
PROCESS_FIELDS = (
    "role",
    "host",
    "pid",
    "start_ticks",
    "gpu",
    "state",
    "restarts",
    "started",
    "last_heartbeat",
    "exit_code",
    "log_file",
)
_JSON_FIELDS = ("config", "runtime")


class Store:
    """Runs, processes and events in one SQLite file (WAL; one connection behind a lock).

    Args:
        path: the database file (its folder is created); ``:memory:`` for tests.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ runs

    def create_run(self, run_id: str, name: str, config: dict[str, Any], run_dir: str) -> None:
        """Insert a new run in state PENDING.

        Raises:
            ValueError: the id exists already.
        """
        now = time.time()
        try:
            with self._lock:
                self._db.execute(
                    "INSERT INTO runs (id, name, state, config, run_dir, created, updated) "
                    "VALUES (?, ?, 'PENDING', ?, ?, ?, ?)",
                    (run_id, name, json.dumps(config), run_dir, now, now),
                )
        except sqlite3.IntegrityError:
            raise ValueError(f"run {run_id!r} exists already") from None

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Set columns of a run (``RUN_FIELDS``; ``config`` and ``runtime`` as JSON).

        Raises:
            ValueError: an unknown column.
        """
        bad = set(fields) - set(RUN_FIELDS)
        if bad:
            raise ValueError(f"unknown run fields {sorted(bad)}")
        values = [json.dumps(v) if k in _JSON_FIELDS else v for k, v in fields.items()]
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._lock:
            self._db.execute(
                f"UPDATE runs SET {sets}, updated = ? WHERE id = ?",
                (*values, time.time(), run_id),
            )

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        """One run as a dict, or None."""
        with self._lock:
            row = self._db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return _run_dict(row) if row else None

    def list_runs(self) -> list[dict[str, Any]]:
        """Every run, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM runs ORDER BY created, id").fetchall()
        return [_run_dict(r) for r in rows]

    # ------------------------------------------------------------------ processes

    def put_process(self, run_id: str, name: str, **fields: Any) -> None:
        """Insert or update a process of a run (``PROCESS_FIELDS``).

        Raises:
            ValueError: an unknown column.
        """
        bad = set(fields) - set(PROCESS_FIELDS)
        if bad:
            raise ValueError(f"unknown process fields {sorted(bad)}")
        with self._lock:
            if fields:
                sets = ", ".join(f"{k} = ?" for k in fields)
                cur = self._db.execute(
                    f"UPDATE processes SET {sets} WHERE run_id = ? AND name = ?",
                    (*fields.values(), run_id, name),
                )
                if cur.rowcount:
                    return
            cols = ["run_id", "name", *fields]
            self._db.execute(
                f"INSERT INTO processes ({', '.join(cols)}) "
                f"VALUES ({', '.join('?' for _ in cols)})",
                (run_id, name, *fields.values()),
            )

    def processes(self, run_id: str) -> list[dict[str, Any]]:
        """The processes of a run, by name."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM processes WHERE run_id = ? ORDER BY name", (run_id,)
            ).fetchall()
        return [dict(r) for r in rows]

    # ------------------------------------------------------------------ events

    def add_event(self, run_id: str, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """Append an event; returns it with its id and time."""
        now = time.time()
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO events (run_id, time, kind, data) VALUES (?, ?, ?, ?)",
                (run_id, now, kind, json.dumps(data)),
            )
        return {"id": cur.lastrowid, "run_id": run_id, "time": now, "kind": kind, "data": data}

    def events(self, run_id: str, after: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        """Events of a run with an id above ``after``, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM events WHERE run_id = ? AND id > ? ORDER BY id LIMIT ?",
                (run_id, after, limit),
            ).fetchall()
        return [
            {
                "id": r["id"],
                "run_id": r["run_id"],
                "time": r["time"],
                "kind": r["kind"],
                "data": json.loads(r["data"]),
            }
            for r in rows
        ]


def _run_dict(row: sqlite3.Row) -> dict[str, Any]:
    out = dict(row)
    for key in _JSON_FIELDS:
        if out.get(key) is not None:
            out[key] = json.loads(out[key])
    return out
