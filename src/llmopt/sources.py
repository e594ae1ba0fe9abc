"""The model store: import models from HF folders, GGUF files or the catalogue, and resolve names.

Every import is atomic: it is built in a temporary folder beside the store, checked, hashed and
then renamed into place, and only then recorded. A failed import leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel

from llmopt import catalog, chat_templates, gguf, hashing, model_check, names, paths, procs, records
from llmopt.errors import LlmoptError

WEIGHT_SUFFIXES = (".safetensors", ".bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class Model(BaseModel):
    """An imported model: a Hugging Face folder in the store, identified by its content hash."""

    id: str
    path: str
    source: str
    content_hash: str
    architecture: str | None
    size_bytes: int
    imported_at: float
    chat_template: str | None = None  # where its chat template came from: model, user, family:NAME; None: it has none
    perplexity: float | None = None  # a GGUF conversion's, on a short held-out text through transformers

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


MODELS = records.Table("models", Model, key="id", order="id")


def list_models() -> list[Model]:
    return MODELS.select()


def get(model_id: str) -> Model | None:
    return MODELS.get(model_id)


def remove(model_id: str) -> None:
    model = get(model_id)
    if model is None:
        raise LlmoptError(f"no imported model named '{model_id}'", "see `llmopt models list`")
    MODELS.delete(model_id)
    shutil.rmtree(model.path, ignore_errors=True)


def resolve(spec: str) -> Model:
    """A model for a user's spec: an imported id, a catalogue id (imported on first use), or a path
    (a folder inside the store means the model stored there)."""
    return find(spec) or import_model(spec)


def find(spec: str) -> Model | None:
    """The imported model a spec names (its id, or its folder inside the store), importing nothing."""
    return get(spec) or _stored_at(spec)


def _stored_at(spec: str) -> Model | None:
    path = Path(spec).expanduser()
    if not path.is_dir():
        return None
    path = path.resolve()
    return next((m for m in list_models() if Path(m.path).resolve() == path), None)


def import_model(spec: str, name: str | None = None, chat_template: str | Path | None = None) -> Model:
    """Import a catalogue id, a Hugging Face folder or a GGUF file into the store, checked: a GGUF's
    tokenizer rules hold, the model prefers its tokenizer's BOS rule, and it has a chat template
    (its own, `chat_template`, or its architecture family's) or says it has none."""
    if name is not None:
        names.check(name, "model")
    template = Path(chat_template).expanduser() if chat_template else None
    if template is not None:
        chat_templates.read(template)
    if catalog.is_catalog_id(spec):
        model_id = name or spec
        build = lambda tmp: _build_from_catalog(catalog.get(spec), tmp)  # noqa: E731
        source = f"catalog:{spec}"
    else:
        path = Path(spec).expanduser().resolve()
        if not path.exists():
            if "/" not in spec and not spec.endswith(".gguf"):
                catalog.get(spec)
            raise LlmoptError(f"model path '{spec}' does not exist", "check the path")
        model_id = name or names.slug(path.stem if path.is_file() else path.name)
        if path.is_file():
            if path.suffix != ".gguf":
                raise LlmoptError(
                    f"'{spec}' is a file but not a .gguf", "pass a .gguf file or a Hugging Face model folder"
                )
            build = lambda tmp: gguf.to_hf_folder(path, tmp)  # noqa: E731
            source = f"gguf:{path}"
        else:
            check_hf_folder(path)
            build = lambda tmp: _copy(path, tmp)  # noqa: E731
            source = f"hf:{path}"
    if get(model_id) is not None:
        raise LlmoptError(
            f"a model named '{model_id}' is already imported", "pass --name NEW_NAME or `llmopt models remove` it"
        )
    return _atomic_import(model_id, source, build, template)


def check_hf_folder(path: Path) -> dict:
    """Refuse a folder that vLLM could not serve: no config, no weights, truncated weights."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise LlmoptError(
            f"'{path}' is not a model folder: it has no config.json",
            "pass a Hugging Face model folder (config.json, weights, tokenizer) or a .gguf file",
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise LlmoptError(f"'{config_file}' is not valid JSON ({exc})", "repair or re-export the model") from exc
    weights = [p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    if not weights:
        raise LlmoptError(
            f"'{path}' is not a model folder: it has no .safetensors or .bin weights",
            "pass a folder written by save_pretrained",
        )
    for weight in weights:
        if weight.suffix == ".safetensors":
            check_safetensors(weight)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise LlmoptError(f"'{path}' has no tokenizer files", "save the tokenizer into the folder with save_pretrained")
    return config


def check_safetensors(path: Path) -> None:
    """The header parses and the file is as long as the header says."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size:
                raise ValueError("header length beyond end of file")
            header = json.loads(f.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise LlmoptError(f"'{path}' is not a valid safetensors file ({exc})", "re-export the weights") from exc
    if 8 + header_len + end != size:
        raise LlmoptError(
            f"'{path}' is truncated or corrupt: expected {8 + header_len + end} bytes, found {size}",
            "re-export or re-copy the weights",
        )


def _copy(folder: Path, dest: Path) -> None:
    shutil.copytree(folder, dest, dirs_exist_ok=True)


def _build_from_catalog(entry: catalog.CatalogModel, dest: Path) -> gguf.TokenizerRules:
    files = entry.weight_files()
    if len(files) == 1:
        return gguf.to_hf_folder(files[0], dest)
    with tempfile.TemporaryDirectory(dir=paths.models_dir(), prefix=f".gguf-{os.getpid()}-") as scratch:
        joined = gguf.concatenate(files, Path(scratch) / f"{entry.id}.gguf")
        return gguf.to_hf_folder(joined, dest)


def _clear_stale(store: Path) -> None:
    """Temporary folders of imports whose process is gone (killed, say): `.import-<id>-<pid>-*`, `.gguf-<pid>-*`."""
    for folder in store.glob(".*-*"):
        pid = _owner(folder.name)
        if pid is not None and not procs.is_alive(pid, None):
            shutil.rmtree(folder, ignore_errors=True)


def _owner(name: str) -> int | None:
    match = re.fullmatch(r"\.(?:import-.+|gguf)-(\d+)-[^-]+", name)
    return int(match.group(1)) if match else None


def _atomic_import(model_id: str, source: str, build, template: Path | None) -> Model:
    store = paths.models_dir()
    _clear_stale(store)
    final = store / model_id
    if final.exists():
        raise LlmoptError(
            f"the store already has a folder for '{model_id}' ({final}) with no record",
            f"remove {final} or import under another --name",
        )
    tmp = Path(tempfile.mkdtemp(dir=store, prefix=f".import-{model_id}-{os.getpid()}-"))
    try:
        rules = build(tmp)
        config = check_hf_folder(tmp)
        if rules is not None:
            model_check.tokenizer_follows(tmp, rules)
        architecture = (config.get("architectures") or [None])[0]
        template_source = chat_templates.fill(tmp, architecture, template)
        # our conversion, our risk: a GGUF's converted folder is checked for a BOS rule the model dislikes
        perplexity = model_check.perplexity_prefers_the_rule(tmp) if rules is not None else None
        content_hash = hashing.folder_sha256(tmp)
        size = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        tmp.chmod(0o700)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    model = Model(id=model_id, path=str(final), source=source, content_hash=content_hash, architecture=architecture,
                  size_bytes=size, imported_at=time.time(), chat_template=template_source,
                  perplexity=None if perplexity is None else round(perplexity, 3))
    MODELS.insert(model)
    return model
