"""The embedded SQLite store behind every record llmopt keeps: models, jobs, endpoints, evaluations.

A record type is a pydantic model; its table's columns are its fields, created (and extended with
any column a newer llmopt added, which older rows read as the field's default) the first time a
process touches the table. Fields that are not plain scalars are stored as JSON text. Every
connection runs in autocommit mode with WAL, so a background worker, the CLI and a server can read
and write at once.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import types
import typing
from contextlib import contextmanager
from typing import Any, Generic, Iterator, TypeVar

from pydantic import BaseModel, TypeAdapter

from llmopt import paths
from llmopt.errors import LlmoptError

R = TypeVar("R", bound=BaseModel)
_SQL_TYPES = {str: "TEXT", int: "INTEGER", float: "REAL", bool: "INTEGER"}
_LOCK_RETRIES = 50  # first-time creation by several processes at once: "database is locked" for a moment


def _scalar(annotation: Any) -> type | None:
    """The Python scalar type a field stores as, or None when it is stored as JSON."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Literal:
        annotation = type(typing.get_args(annotation)[0])
    return annotation if annotation in _SQL_TYPES else None


class Table(Generic[R]):
    """One record type's table: insert, update, read and delete by key."""

    def __init__(self, name: str, record: type[R], key: str, order: str) -> None:
        self.name, self.record, self.key, self.order = name, record, key, order
        self._json = {f for f, info in record.model_fields.items() if _scalar(info.annotation) is None}
        self._ready: set[str] = set()  # database paths whose table this process has checked

    def _columns(self) -> dict[str, str]:
        return {f: _SQL_TYPES.get(_scalar(info.annotation) or str, "TEXT") for f, info in self.record.model_fields.items()}

    def _default(self, field: str) -> str:
        """The SQL default of a column added to an existing table: the field's own scalar default, so
        rows written by an older llmopt load (NULL would fail a field that is not optional)."""
        default = self.record.model_fields[field].default
        if default is None or field in self._json or not isinstance(default, (str, int, float)):
            return ""
        if isinstance(default, str):
            return " DEFAULT '" + default.replace("'", "''") + "'"
        return f" DEFAULT {int(default) if isinstance(default, bool) else default!r}"

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        path = paths.db_path()
        if not path.exists():
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # the owner's alone: it holds API keys
        conn = sqlite3.connect(path, timeout=30, isolation_level=None)
        conn.row_factory = sqlite3.Row
        try:
            if str(path) not in self._ready:
                self._create(conn)
                self._ready.add(str(path))
            yield conn
        finally:
            conn.close()

    def _create(self, conn: sqlite3.Connection) -> None:
        for attempt in range(_LOCK_RETRIES):
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                columns = ", ".join(f"{c} {t}{' PRIMARY KEY' if c == self.key else ''}" for c, t in self._columns().items())
                conn.execute(f"CREATE TABLE IF NOT EXISTS {self.name} ({columns})")
                have = {row["name"] for row in conn.execute(f"PRAGMA table_info({self.name})")}
                for column, sql_type in self._columns().items():
                    if column not in have:  # a field added by a newer llmopt
                        conn.execute(f"ALTER TABLE {self.name} ADD COLUMN {column} {sql_type}{self._default(column)}")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or attempt == _LOCK_RETRIES - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))

    def _row(self, record: R) -> dict[str, Any]:
        data = record.model_dump(mode="json")
        return {k: json.dumps(v) if k in self._json and v is not None else v for k, v in data.items()}

    def _dump(self, field: str, value: Any) -> Any:
        if field not in self._json or value is None:
            return value
        return json.dumps(TypeAdapter(self.record.model_fields[field].annotation).dump_python(value, mode="json"))

    def _load(self, row: sqlite3.Row) -> R:
        data = {k: json.loads(row[k]) if k in self._json and row[k] is not None else row[k] for k in row.keys()}
        return self.record.model_validate({k: v for k, v in data.items() if k in self.record.model_fields})

    def insert(self, record: R, conn: sqlite3.Connection | None = None) -> None:
        """Add a record; a taken key is refused with the record type and key named."""
        data = self._row(record)
        sql = f"INSERT INTO {self.name} ({', '.join(data)}) VALUES ({', '.join(':' + k for k in data)})"
        try:
            if conn is not None:
                conn.execute(sql, data)
            else:
                with self.connect() as own:
                    own.execute(sql, data)
        except sqlite3.IntegrityError:
            raise LlmoptError(f"a {self.name[:-1]} named '{data[self.key]}' already exists", "pass another --name") from None

    def update(self, key: str, **fields: Any) -> None:
        with self.connect() as conn:
            self.write(conn, key, **fields)

    def write(self, conn: sqlite3.Connection, key: str, **fields: Any) -> None:
        """Update fields of a record on an open connection (inside a transaction, say)."""
        if not fields:
            return
        values = {k: self._dump(k, v) for k, v in fields.items()}
        conn.execute(f"UPDATE {self.name} SET {', '.join(f'{k} = :{k}' for k in values)} WHERE {self.key} = :_key",
                     {**values, "_key": key})

    def get(self, key: str) -> R | None:
        with self.connect() as conn:
            row = conn.execute(f"SELECT * FROM {self.name} WHERE {self.key} = ?", (key,)).fetchone()
        return self._load(row) if row else None

    def select(self, where: str = "", params: tuple = (), limit: int | None = None) -> list[R]:
        sql = f"SELECT * FROM {self.name}{' WHERE ' + where if where else ''} ORDER BY {self.order}"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self.connect() as conn:
            return [self._load(row) for row in conn.execute(sql, params).fetchall()]

    def delete(self, key: str, conn: sqlite3.Connection | None = None) -> None:
        if conn is not None:
            conn.execute(f"DELETE FROM {self.name} WHERE {self.key} = ?", (key,))
            return
        with self.connect() as own:
            own.execute(f"DELETE FROM {self.name} WHERE {self.key} = ?", (key,))

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: what is read inside it cannot change before it commits."""
        with self.connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def read(self, conn: sqlite3.Connection, key: str) -> R | None:
        row = conn.execute(f"SELECT * FROM {self.name} WHERE {self.key} = ?", (key,)).fetchone()
        return self._load(row) if row else None
