"""Content hashes of files and folders: the identity of models, artifacts and cache entries.

Hashing gigabytes of weights at every deploy would cost seconds to minutes, so a file's hash is
remembered against its path, size, inode and change time (ctime, which no user call can set back,
unlike mtime): any write to the file, or a file swapped in its place, hashes it afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel

from llmopt import records

_CHUNK = 1 << 20


class FileHash(BaseModel):
    path: str
    size: int
    inode: int
    ctime_ns: int
    mtime_ns: int
    sha256: str


HASHES = records.Table("file_hashes", FileHash, key="path", order="path")


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return stream_sha256(f)


def stream_sha256(f: BinaryIO) -> str:
    """The hash of what is left to read of an open binary file (a local one, or fsspec's)."""
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def remembered_sha256(path: Path) -> str:
    """A file's hash, computed again only when the file may have changed since it was last hashed."""
    return _remembered([path.resolve()])[0]


def folder_sha256(root: Path, exclude: frozenset[str] = frozenset(), remember: bool = False) -> str:
    """Hash of every file's relative path and content, independent of where the folder lives."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).as_posix() not in exclude]
    hashes = _remembered([p.resolve() for p in files]) if remember else [file_sha256(p) for p in files]
    return listing_sha256([(p.relative_to(root).as_posix(), sha) for p, sha in zip(files, hashes)])


def listing_sha256(files: list[tuple[str, str]]) -> str:
    """`folder_sha256` from its (relative path, file hash) pairs in path order: the one definition
    that a folder anywhere, local or behind fsspec, is hashed by."""
    digest = hashlib.sha256()
    for relative, sha in files:
        digest.update(relative.encode() + b"\0" + sha.encode() + b"\n")
    return digest.hexdigest()


def _remembered(paths: list[Path]) -> list[str]:
    """Hashes of resolved paths: read from the remembered ones where the file is unchanged, one
    query in and one transaction out."""
    if not paths:
        return []
    prefix = os.path.commonpath([str(p) for p in paths])
    known = {h.path: h for h in HASHES.select("path = ? OR path LIKE ?", (prefix, prefix.rstrip("/") + "/%"))}
    found, fresh = [], []
    for path in paths:
        stat = os.stat(path)
        seen = FileHash(path=str(path), size=stat.st_size, inode=stat.st_ino, ctime_ns=stat.st_ctime_ns,
                        mtime_ns=stat.st_mtime_ns, sha256="")
        old = known.get(str(path))
        if old is not None and old.model_copy(update={"sha256": ""}) == seen:
            found.append(old.sha256)
            continue
        seen.sha256 = file_sha256(path)
        fresh.append(seen)
        found.append(seen.sha256)
    if fresh:
        with HASHES.transaction() as conn:
            for record in fresh:
                HASHES.delete(record.path, conn)
                HASHES.insert(record, conn)
    return found


def json_sha256(value: Any) -> str:
    """Hash of a JSON-able value in canonical form (sorted keys, no whitespace)."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
