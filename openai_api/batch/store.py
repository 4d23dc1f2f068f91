"""The durable state of files and batches: one SQLite database and a directory of file contents, under one data
directory. Every method is synchronous and thread-safe (one connection, one lock); the async front calls them
through ``asyncio.to_thread``.

A batch's lines live in the database: a line is pending until its result (the whole output or error line) is
written in the same transaction that marks it done, so after a crash, even ``kill -9``, a line is either done once
or pending and run again; the output and error files are written from the database when the batch ends."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, request TEXT, result TEXT,
    failed INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, line)
);
CREATE INDEX IF NOT EXISTS pending ON lines (batch_id) WHERE result IS NULL;
"""


def new_id(prefix: str) -> str:
    """OpenAI's id shapes: new_id("file-"), new_id("batch_"), new_id("batch_req_")."""
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(frozen=True)
class FileRecord:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None

    def openai(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "expires_at": self.expires_at,
                "status": "processed", "status_details": None}


def batch_record(input_file_id: str, endpoint: str, lines: list[Line], metadata: dict | None, now: int,
                 window_s: int) -> dict:
    """A new batch, as OpenAI's Batch object."""
    return {
        "id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
        "input_file_id": input_file_id, "completion_window": "24h", "status": "validating",
        "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
        "expires_at": now + window_s, "finalizing_at": None, "completed_at": None, "failed_at": None,
        "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": len(lines), "completed": 0, "failed": sum(line.failed for line in lines)},
        "metadata": metadata,
    }


@dataclass
class Line:
    line: int  # 1-based line number in the input file
    custom_id: str | None
    request: dict | None  # the line's body, when the line is good
    result: dict | None = None  # the output or error line, once done
    failed: bool = False


class Store:
    def __init__(self, data_dir: str | os.PathLike):
        self.data_dir = Path(data_dir)
        self.files_dir = self.data_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.data_dir / "batches.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self, statements: list[tuple[str, tuple]]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self._db.execute(sql, args)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # --- files ---

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, owner: str, filename: str, purpose: str, content_path: Path, size: int,
                 expires_at: int | None = None, file_id: str | None = None) -> FileRecord:
        """Moves an already written file (same filesystem) under the store, then records it."""
        record = FileRecord(file_id or new_id("file-"), owner, filename, purpose, size, int(time.time()), expires_at)
        os.replace(content_path, self.file_path(record.id))
        self._tx([("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (record.id, owner, filename, purpose, size, record.created_at, expires_at))])
        return record

    def get_file(self, owner: str, file_id: str) -> FileRecord | None:
        rows = self._query("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner))
        return FileRecord(*rows[0]) if rows else None

    def list_files(self, owner: str, purpose: str | None = None, limit: int = 10000) -> list[FileRecord]:
        rows = self._query("SELECT * FROM files WHERE owner = ? AND (? IS NULL OR purpose = ?) "
                           "ORDER BY created_at DESC, id LIMIT ?", (owner, purpose, purpose, limit))
        return [FileRecord(*row) for row in rows]

    def delete_file(self, owner: str, file_id: str) -> bool:
        if self.get_file(owner, file_id) is None:
            return False
        self._tx([("DELETE FROM files WHERE id = ?", (file_id,))])
        self.file_path(file_id).unlink(missing_ok=True)
        return True

    # --- batches ---

    def add_batch(self, owner: str, record: dict, lines: list[Line]) -> None:
        statements = [("INSERT INTO batches VALUES (?, ?, ?, ?, ?)",
                       (record["id"], owner, record["status"], record["created_at"], json.dumps(record)))]
        statements += [("INSERT INTO lines VALUES (?, ?, ?, ?, ?, ?)",
                        (record["id"], line.line, line.custom_id,
                         None if line.request is None else json.dumps(line.request),
                         None if line.result is None else json.dumps(line.result), int(line.failed)))
                       for line in lines]
        self._tx(statements)

    def get_batch(self, owner: str | None, batch_id: str) -> dict | None:
        """The batch's OpenAI object; owner None: whoever owns it (the runner's view)."""
        rows = self._query("SELECT record FROM batches WHERE id = ? AND (? IS NULL OR owner = ?)",
                           (batch_id, owner, owner))
        return json.loads(rows[0][0]) if rows else None

    def batch_owner(self, batch_id: str) -> str | None:
        rows = self._query("SELECT owner FROM batches WHERE id = ?", (batch_id,))
        return rows[0][0] if rows else None

    def list_batches(self, owner: str, limit: int = 20, after: str | None = None) -> list[dict]:
        rows = self._query("SELECT record FROM batches WHERE owner = ? ORDER BY created_at DESC, id DESC", (owner,))
        records = [json.loads(row[0]) for row in rows]
        if after is not None:
            ids = [r["id"] for r in records]
            records = records[ids.index(after) + 1:] if after in ids else []
        return records[:limit]

    def batches_in(self, statuses: tuple[str, ...]) -> list[dict]:
        marks = ",".join("?" * len(statuses))
        rows = self._query(f"SELECT record FROM batches WHERE status IN ({marks}) ORDER BY created_at, id", statuses)
        return [json.loads(row[0]) for row in rows]

    def status_counts(self) -> dict[str, int]:
        return dict(self._query("SELECT status, COUNT(*) FROM batches GROUP BY status"))

    def change_batch(self, batch_id: str, change: Callable[[dict], dict | None]) -> dict | None:
        """Read, change and write a batch's record as one step (the runner and the cancel route race): ``change``
        gets the current record and returns the new one, or None to leave it. Returns the record as it now is."""
        with self._lock:
            row = self._db.execute("SELECT record FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            record = change(json.loads(row[0]))
            if record is None:
                return json.loads(row[0])
            self._db.execute("UPDATE batches SET status = ?, record = ? WHERE id = ?",
                             (record["status"], json.dumps(record), batch_id))
            return record

    def delete_batch(self, batch_id: str) -> None:
        self._tx([("DELETE FROM lines WHERE batch_id = ?", (batch_id,)),
                  ("DELETE FROM batches WHERE id = ?", (batch_id,))])

    # --- lines ---

    def pending_lines(self, batch_id: str) -> list[Line]:
        rows = self._query("SELECT line, custom_id, request FROM lines WHERE batch_id = ? AND result IS NULL "
                           "ORDER BY line", (batch_id,))
        return [Line(line, custom_id, json.loads(request)) for line, custom_id, request in rows]

    def finish_line(self, batch_id: str, line: int, result: dict, failed: bool) -> bool:
        """Records a line's result once: False when it already had one (nothing is written twice)."""
        with self._lock:
            cursor = self._db.execute("UPDATE lines SET result = ?, failed = ? WHERE batch_id = ? AND line = ? AND "
                                      "result IS NULL", (json.dumps(result), int(failed), batch_id, line))
            return cursor.rowcount == 1

    def counts(self, batch_id: str) -> tuple[int, int, int]:
        """(total, completed, failed) lines."""
        rows = self._query("SELECT COUNT(*), SUM(result IS NOT NULL AND failed = 0), SUM(failed) FROM lines "
                           "WHERE batch_id = ?", (batch_id,))
        total, completed, failed = rows[0]
        return total, completed or 0, failed or 0

    def results(self, batch_id: str, failed: bool) -> list[dict]:
        rows = self._query("SELECT result FROM lines WHERE batch_id = ? AND result IS NOT NULL AND failed = ? "
                           "ORDER BY line", (batch_id, int(failed)))
        return [json.loads(row[0]) for row in rows]

    def expired_files(self, now: int) -> list[FileRecord]:
        rows = self._query("SELECT * FROM files WHERE expires_at IS NOT NULL AND expires_at < ?", (now,))
        return [FileRecord(*row) for row in rows]
