"""Where artifacts live: a local folder, or an fsspec URI (file://, s3://, gs://, ...) that every
node of a cluster can read. A job builds in a local folder and publishes to the URI; a deploy
fetches the URI into a local copy. Either way the files are hashed again after the transfer and
must match the manifest's content hash, and the manifest travels last, so a copy cut short is
never taken for an artifact.
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from typing import Any

import fsspec

from llmopt import artifact, hashing, paths
from llmopt.errors import LlmoptError

def is_uri(location: str | Path) -> bool:
    return "://" in str(location)


def exists(location: str) -> bool:
    """Whether a finished artifact (its manifest) is at `location`."""
    if not is_uri(location):
        return artifact.is_artifact(Path(location))
    fs, root = _filesystem(location)
    return bool(fs.isfile(f"{root}/{artifact.MANIFEST}"))


def check_new(uri: str) -> None:
    """An output URI must not hold anything yet, and must take a write (probed and removed), so a
    job that cannot publish is refused before it runs."""
    fs, root = _filesystem(uri)
    if fs.exists(root):
        raise LlmoptError(f"output location '{uri}' already exists", "pass a new --output, or remove what is there")
    probe = f"{root}-llmopt-write-test-{secrets.token_hex(4)}"
    try:
        fs.makedirs(root.rsplit("/", 1)[0], exist_ok=True)  # a no-op on object stores
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except OSError as exc:
        raise LlmoptError(f"cannot write to '{uri}' ({exc})", "pass an --output where you can write") from None


def publish(local: Path, uri: str) -> artifact.Manifest:
    """Copy a finished artifact folder to `uri`: every file, then a check of what landed against
    the manifest's hash, then the manifest (returned). On any failure the partial copy is removed."""
    manifest = artifact.load(local)
    fs, root = _filesystem(uri)
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != artifact.MANIFEST)
    try:
        for path in files:
            target = f"{root}/{path.relative_to(local).as_posix()}"
            fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(path), target)
        landed = _remote_sha256(fs, root)
        if landed != manifest.content_hash:
            raise LlmoptError(f"the copy at '{uri}' hashes to {landed[:12]}, the artifact to {manifest.content_hash[:12]}",
                              "check the storage and run the job again")
        fs.put_file(str(local / artifact.MANIFEST), f"{root}/{artifact.MANIFEST}")
    except BaseException:
        if fs.exists(root):
            fs.rm(root, recursive=True)
        raise
    return manifest


def manifest(location: str) -> artifact.Manifest:
    """The manifest of the artifact at a folder or URI, read alone (nothing else is copied)."""
    if not is_uri(location):
        return artifact.load(Path(location))
    fs, root = _filesystem(location)
    path, where = f"{root}/{artifact.MANIFEST}", f"{location.rstrip('/')}/{artifact.MANIFEST}"
    try:
        if fs.size(path) > artifact.MAX_MANIFEST_BYTES:
            raise LlmoptError(f"'{where}' is larger than a manifest can be", "publish the artifact again")
        text = fs.cat_file(path)
    except FileNotFoundError:
        raise LlmoptError(f"'{location}' is not an llmopt artifact (no {artifact.MANIFEST})", "pass an artifact's location") from None
    return artifact.parse(text, where)


def fetch(uri: str) -> Path:
    """A verified local copy of the artifact at `uri`, kept by content hash: a second deploy of
    the same artifact downloads nothing."""
    fs, root = _filesystem(uri)
    content_hash = manifest(uri).content_hash
    if len(content_hash) != 64 or not all(c in "0123456789abcdef" for c in content_hash):
        raise LlmoptError(f"the manifest at '{uri}' has no valid content hash", "publish the artifact again")
    final = copies_dir() / content_hash
    if artifact.is_artifact(final):
        artifact.verify(final)
        return final
    staging = copies_dir() / f".fetch-{secrets.token_hex(6)}"
    try:
        fs.get(root + "/", str(staging), recursive=True)
        if artifact.verify(staging).content_hash != content_hash:
            raise LlmoptError(f"the manifest at '{uri}' changed while it was copied", "deploy it again")
        artifact.freeze(staging)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def keep_copy(local: Path, content_hash: str) -> Path:
    """Move a published artifact's local build into the copy store, where a deploy of its URI on
    this machine finds it without downloading."""
    final = copies_dir() / content_hash
    if final.exists():
        shutil.rmtree(local)
        return final
    local.rename(final)
    return final


def copies_dir() -> Path:
    path = paths.home() / "artifact-copies"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _remote_sha256(fs: Any, root: str) -> str:
    """`hashing.folder_sha256` of a folder on an fsspec file system, read back from it."""
    prefix = root + "/"
    hashes = []
    for path in sorted(p for p in fs.find(root) if p[len(prefix):] != artifact.MANIFEST):
        with fs.open(path, "rb") as f:
            hashes.append((path[len(prefix):], hashing.stream_sha256(f)))
    return hashing.listing_sha256(hashes)


def _filesystem(uri: str) -> tuple[Any, str]:
    try:
        fs, root = fsspec.core.url_to_fs(uri)
    except ImportError as exc:
        raise LlmoptError(f"no file system for '{uri}' ({exc})", "install the fsspec package for its scheme, e.g. s3fs") from None
    except ValueError as exc:
        raise LlmoptError(f"'{uri}' is not a location fsspec knows ({exc})", "pass a path or a URI such as file:///shared/a") from None
    return fs, root.rstrip("/")
