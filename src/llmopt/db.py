"""The embedded SQLite database that holds model, endpoint and job records.

Every connection runs in autocommit mode with WAL so that a background worker, the CLI and the
studio can read and write the same file at once.
"""

from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from typing import Iterator

from llmopt import paths

SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    id TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    source TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    architecture TEXT,
    size_bytes INTEGER,
    imported_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS endpoints (
    name TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    model_path TEXT NOT NULL,
    host TEXT NOT NULL,
    port INTEGER NOT NULL,
    pid INTEGER,
    pid_create_time REAL,
    status TEXT NOT NULL,
    failure_reason TEXT,
    log_path TEXT NOT NULL,
    engine_args TEXT NOT NULL,
    engine_env TEXT NOT NULL,
    started_at REAL NOT NULL,
    ready_at REAL,
    stopped_at REAL,
    verification TEXT
);
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    source_hash TEXT,
    recipe TEXT NOT NULL,
    artifact_key TEXT,
    status TEXT NOT NULL,
    failure_reason TEXT,
    log_path TEXT NOT NULL,
    output_dir TEXT,
    artifact TEXT,
    pid INTEGER,
    pid_create_time REAL,
    progress TEXT NOT NULL DEFAULT '{}',
    force INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL
);
"""


@contextmanager
def connect() -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(paths.db_path(), timeout=30, isolation_level=None)
    conn.row_factory = sqlite3.Row
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(SCHEMA)
        yield conn
    finally:
        conn.close()
