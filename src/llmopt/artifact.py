"""Optimized artifacts: one folder that is enough to serve a model, described by `llmopt.json`.

An artifact is built in a hidden temporary folder and renamed into place only when it is whole,
with its manifest written last, so a folder with a manifest is always complete. Once complete,
its files are made read-only and llmopt never writes into it again.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt import hashing
from llmopt.errors import LlmoptError

MANIFEST = "llmopt.json"
SCHEMA_VERSION = 1
RELATIVE_PREFIX = "./"  # engine-argument paths inside the artifact are stored relative to its root


@dataclass
class Manifest:
    name: str
    key: str
    source: dict[str, Any]
    recipe: dict[str, Any]
    engine: dict[str, Any]  # name, version, args (vLLM flags), env
    hardware: dict[str, Any]
    content_hash: str
    created_at: float
    steps: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    references: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    root: Path | None = None  # where it was loaded from; not serialized

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "root"}
        return data

    def engine_args(self) -> dict[str, object]:
        """The manifest's flags with paths inside the artifact made absolute for this location."""
        assert self.root is not None
        return {k: absolute(v, self.root) for k, v in self.engine["args"].items()}

    def serving_spec(self):
        from llmopt.serving import ServingSpec

        assert self.root is not None
        return ServingSpec(
            model_path=str(self.root),
            model_label=self.name,
            engine_args=self.engine_args(),
            env=dict(self.engine["env"]),
        )


def is_artifact(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def load(path: Path) -> Manifest:
    manifest_file = path / MANIFEST
    try:
        data = json.loads(manifest_file.read_text())
    except FileNotFoundError as exc:
        raise LlmoptError(f"'{path}' is not an llmopt artifact (no {MANIFEST})", "pass an artifact folder") from exc
    except json.JSONDecodeError as exc:
        raise LlmoptError(f"'{manifest_file}' is corrupt ({exc})", "rebuild the artifact with `llmopt optimize --force`") from exc
    if data.get("schema_version") != SCHEMA_VERSION:
        raise LlmoptError(
            f"'{manifest_file}' has schema version {data.get('schema_version')}, this llmopt reads {SCHEMA_VERSION}",
            "rebuild the artifact with this version of llmopt",
        )
    return Manifest(**data, root=path.resolve())


def finalize(workdir: Path, final: Path, manifest: Manifest) -> Path:
    """Write the manifest last, rename the folder into place, and freeze it."""
    manifest.content_hash = hashing.folder_sha256(workdir, exclude=frozenset({MANIFEST}))
    manifest.created_at = time.time()
    tmp_manifest = workdir / (MANIFEST + ".tmp")
    tmp_manifest.write_text(json.dumps(manifest.to_dict(), indent=2, sort_keys=True))
    tmp_manifest.rename(workdir / MANIFEST)
    if final.exists():
        raise LlmoptError(f"artifact folder '{final}' already exists", "pass another --output or --name")
    workdir.rename(final)
    _freeze(final)
    manifest.root = final
    return final


def verify(path: Path) -> Manifest:
    """Check the files still hash to what the manifest recorded."""
    manifest = load(path)
    actual = hashing.folder_sha256(path, exclude=frozenset({MANIFEST}))
    if actual != manifest.content_hash:
        raise LlmoptError(
            f"artifact '{path}' was modified after it was built (hash {actual[:12]} != {manifest.content_hash[:12]})",
            "rebuild it with `llmopt optimize --force`",
        )
    return manifest


def relative(path: Path, root: Path) -> str:
    """How an engine argument names a file inside the artifact."""
    return RELATIVE_PREFIX + path.relative_to(root).as_posix()


def absolute(value: object, root: Path) -> object:
    """An engine argument with artifact-relative paths resolved against `root`."""
    if isinstance(value, str) and value.startswith(RELATIVE_PREFIX):
        return str(root / value[len(RELATIVE_PREFIX):])
    if isinstance(value, dict):
        return {k: absolute(v, root) for k, v in value.items()}
    return value


def _freeze(root: Path) -> None:
    read_only = ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            p.chmod(p.stat().st_mode & read_only)
