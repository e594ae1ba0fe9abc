"""Artifact locations: publishing to an fsspec URI and fetching back, the hash checked after each
transfer; a copy cut short or altered is never served. On `file://` URIs, as the cluster tests use.
The job that publishes through its worker, and a deploy from the URI, run in test_ray_executor.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import fsspec
import pytest

import llmopt
from llmopt import artifact, locations
from llmopt.errors import LlmoptError

from test_exports import _write_artifact


@pytest.fixture()
def built(tmp_path: Path) -> Path:
    return _write_artifact(tmp_path, "cpu")


def test_publish_then_fetch_gives_the_same_artifact_and_a_second_fetch_downloads_nothing(built: Path, tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/shared/smol"
    locations.check_new(uri)
    locations.publish(built, uri)
    assert locations.exists(uri) and not list((tmp_path / "shared").glob("*llmopt-write-test*"))
    copy = locations.fetch(uri)
    assert copy.parent == locations.copies_dir() and artifact.verify(copy).content_hash == artifact.load(built).content_hash
    (tmp_path / "shared" / "smol" / "model.safetensors").unlink()  # the remote weights gone: only a download would notice
    assert locations.fetch(uri) == copy
    with pytest.raises(LlmoptError, match="already exists"):
        locations.check_new(uri)


def test_an_altered_remote_copy_is_refused_and_leaves_no_local_copy(built: Path, tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/altered"
    locations.publish(built, uri)
    weights = tmp_path / "altered" / "draft" / "model.safetensors"
    weights.write_bytes(b"other weights")
    shutil.rmtree(locations.copies_dir() / artifact.load(built).content_hash, ignore_errors=True)  # copies are kept by hash
    before = set(locations.copies_dir().iterdir())
    with pytest.raises(LlmoptError, match="modified after it was built"):
        locations.fetch(uri)
    assert set(locations.copies_dir().iterdir()) == before


def test_an_upload_cut_short_leaves_nothing_at_the_uri(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"file://{tmp_path}/cut"
    fs = fsspec.filesystem("file")
    calls = []

    def put_file(self, lpath: str, rpath: str, **kwargs: object) -> None:
        calls.append(rpath)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        shutil.copyfile(lpath, rpath)

    monkeypatch.setattr(type(fs), "put_file", put_file)
    with pytest.raises(OSError, match="No space left"):
        locations.publish(built, uri)
    assert not (tmp_path / "cut").exists() and not locations.exists(uri)


def test_a_copy_that_lands_different_is_removed(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"file://{tmp_path}/flipped"
    fs = fsspec.filesystem("file")

    def put_file(self, lpath: str, rpath: str, **kwargs: object) -> None:
        Path(rpath).write_bytes(Path(lpath).read_bytes()[:-1])  # one byte short, silently

    monkeypatch.setattr(type(fs), "put_file", put_file)
    with pytest.raises(LlmoptError, match="hashes to"):
        locations.publish(built, uri)
    assert not (tmp_path / "flipped").exists()


@pytest.mark.parametrize("write, message", [
    (None, "is not an llmopt artifact"),
    (b"{not json", "is corrupt"),
    (b'{"schema_version": 1}', "is not a valid manifest|has schema version"),
    (b" " * (artifact.MAX_MANIFEST_BYTES + 1), "larger than a manifest can be"),
    ("bad hash", "no valid content hash"),
])
def test_what_is_not_an_artifact_is_refused_in_one_line(built: Path, tmp_path: Path, write: bytes | str | None,
                                                        message: str) -> None:
    folder = tmp_path / "remote"
    folder.mkdir()
    if write == "bad hash":  # a valid manifest whose hash would name a folder outside the copies
        write = artifact.load(built).model_copy(update={"content_hash": "../../etc"}).model_dump_json().encode()
    if write is not None:
        (folder / artifact.MANIFEST).write_bytes(write)  # type: ignore[arg-type]
    with pytest.raises(LlmoptError, match=message) as refused:
        locations.fetch(f"file://{folder}")
    assert "\n" not in refused.value.one_line()


def test_a_scheme_without_its_package_says_what_to_install() -> None:
    with pytest.raises(LlmoptError, match="install the fsspec package"):
        locations.check_new("s3://bucket/artifact")


def test_a_job_refuses_an_output_uri_that_holds_something_before_it_records_anything(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(LlmoptError, match="already exists"):
        llmopt.optimize("smollm2-135m-instruct", "baseline", name="to-a-taken-uri", output=f"file://{tmp_path}/taken")
    assert "to-a-taken-uri" not in {j.name for j in llmopt.list_jobs()}
