"""Optimized artifacts: one folder that is enough to serve a model, described by `llmopt.json`.

An artifact is built in a hidden temporary folder and renamed into place only when it is whole,
with its manifest written last, so a folder with a manifest is always complete. Once complete,
its files are made read-only and llmopt never writes into it again.

The manifest is data, typed (its JSON schema is published in `schemas/`): the engine settings it
holds are `EngineConfig`'s, so it can ask for nothing llmopt would not set itself, and what is
specific to a machine (library paths, thread counts) is worked out where it is served.
Versioning rule: `schema_version` is an integer that changes whenever a field is removed or
changes meaning. A manifest of another version is refused with both versions named; within a
version, an unknown key is refused with the key named.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from llmopt import hashing, techniques
from llmopt.engine import vllm
from llmopt.engine.config import EngineConfig
from llmopt.engine.platform import Hardware
from llmopt.errors import LlmoptError, first_invalid
from llmopt.recipe import Recipe
from llmopt.techniques.base import Reference
from llmopt.techniques.measure import Measurements

MANIFEST = "llmopt.json"
SCHEMA_VERSION = 2
MAX_MANIFEST_BYTES = 16 << 20


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceRecord(_Data):
    model: str
    origin: str
    content_hash: str


class EngineRecord(_Data):
    name: str
    version: str
    served_name: str
    settings: EngineConfig


class HardwareRecord(Hardware):
    torch: str


class StepTiming(_Data):
    name: str
    seconds: float


Verified = create_model(  # what each technique proved on the measuring engine
    "Verified",
    __config__=ConfigDict(extra="forbid"),
    **{t.section: (t.verification | None, None) for t in techniques.REGISTRY if t.verification is not None},
)


class _Metrics(Measurements):
    model_config = ConfigDict(extra="forbid")

    verified: Verified = Field(default_factory=Verified)  # type: ignore[valid-type]
    size_bytes: int
    source_size_bytes: int
    peak_rss_bytes: int
    # weights one decode step reads per generated token at batch 1 (the KV cache not counted):
    # over this machine's read bandwidth, the bound on decode tokens/s (benchmarks/roofline.py)
    weights_read_per_token_bytes: int | None = None


ArtifactMetrics = create_model(  # the measure step's findings, and each technique's own record
    "ArtifactMetrics",
    __base__=_Metrics,
    **{t.section: (t.metrics | None, None) for t in techniques.REGISTRY if t.metrics is not None},
)


class Manifest(_Data):
    schema_version: int = SCHEMA_VERSION
    name: str
    key: str
    source: SourceRecord
    recipe: Recipe
    engine: EngineRecord
    hardware: HardwareRecord
    content_hash: str = ""
    created_at: float = 0.0
    steps: list[StepTiming] = Field(default_factory=list)
    metrics: ArtifactMetrics
    references: dict[str, Reference] = Field(default_factory=dict)

    def located_engine(self, root: Path) -> EngineConfig:
        """The settings with the artifact's own paths resolved against where it lies."""
        return vllm.located(self.engine.settings, root)


def is_artifact(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def load(path: Path) -> Manifest:
    """The manifest of an artifact folder, checked against this llmopt's schema."""
    manifest_file = path / MANIFEST
    try:
        if manifest_file.stat().st_size > MAX_MANIFEST_BYTES:
            raise LlmoptError(f"'{manifest_file}' is larger than a manifest can be", "rebuild the artifact")
        text = manifest_file.read_bytes()
    except FileNotFoundError as exc:
        raise LlmoptError(f"'{path}' is not an llmopt artifact (no {MANIFEST})", "pass an artifact folder") from exc
    return parse(text, str(manifest_file))


def parse(text: bytes, manifest_file: str) -> Manifest:
    """A manifest's bytes, read from `manifest_file` (a path or a URI), checked against this llmopt's schema."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise LlmoptError(f"'{manifest_file}' is larger than a manifest can be", "rebuild the artifact")
    try:
        data = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise LlmoptError(f"'{manifest_file}' is corrupt ({type(exc).__name__})", "rebuild the artifact with `llmopt optimize --force`") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        newer = isinstance(version, int) and version > SCHEMA_VERSION
        raise LlmoptError(
            f"'{manifest_file}' has schema version {version}, this llmopt reads {SCHEMA_VERSION}",
            "upgrade llmopt to read it" if newer else "rebuild the artifact with this version of llmopt",
        )
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        where, problem = first_invalid(exc.errors())
        raise LlmoptError(f"'{manifest_file}' is not a valid manifest: {f'{where}: ' if where else ''}{problem}",
                          "use the manifest llmopt wrote; rebuild the artifact with `llmopt optimize --force`") from None


def finalize(workdir: Path, final: Path, manifest: Manifest) -> Path:
    """Write the manifest last, rename the folder into place, and freeze it."""
    manifest.content_hash = hashing.folder_sha256(workdir, exclude=frozenset({MANIFEST}))
    manifest.created_at = time.time()
    tmp_manifest = workdir / (MANIFEST + ".tmp")
    tmp_manifest.write_text(manifest.model_dump_json(indent=2))
    tmp_manifest.rename(workdir / MANIFEST)
    if final.exists():
        raise LlmoptError(f"artifact folder '{final}' already exists", "pass another --output or --name")
    workdir.rename(final)
    freeze(final)
    return final


def verify(path: Path) -> Manifest:
    """The manifest, once the files are checked to hash to what it recorded (a file unchanged
    since it was last hashed is not read again)."""
    manifest = load(path)
    actual = hashing.folder_sha256(path, exclude=frozenset({MANIFEST}), remember=True)
    if actual != manifest.content_hash:
        raise LlmoptError(
            f"artifact '{path}' was modified after it was built (hash {actual[:12]} != {manifest.content_hash[:12]})",
            "rebuild it with `llmopt optimize --force`",
        )
    return manifest


def schema() -> dict[str, Any]:
    return Manifest.model_json_schema()


def freeze(root: Path) -> None:
    """Files readable by their owner alone and by nobody writable; folders the owner's alone."""
    for dirpath, _dirs, files in os.walk(root):
        Path(dirpath).chmod(stat.S_IRWXU)
        for name in files:
            (Path(dirpath) / name).chmod(stat.S_IRUSR)
