"""Content hashes of files and folders: the identity of models, artifacts and cache entries."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def folder_sha256(root: Path, exclude: frozenset[str] = frozenset()) -> str:
    """Hash of every file's relative path and content, independent of where the folder lives."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel in exclude:
            continue
        digest.update(rel.encode() + b"\0" + file_sha256(path).encode() + b"\n")
    return digest.hexdigest()


def json_sha256(value: Any) -> str:
    """Hash of a JSON-able value in canonical form (sorted keys, no whitespace)."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
