"""GGUF files: check they are whole, and dequantize them once into a bf16 Hugging Face folder.

vLLM serves Hugging Face folders best on CPU, and later steps (quantization with llm-compressor,
hashing, compile caches) want plain safetensors, so a GGUF is converted at import, not at serve.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import threading
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel

from llmopt.errors import LlmoptError


class TokenizerRules(BaseModel):
    """What a GGUF says about the tokens a prompt becomes: which BOS and EOS, whether each is added."""

    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    chat_template: str | None = None


def tokenizer_rules(reader: Any) -> TokenizerRules:
    """The rules in a parsed GGUF (a `gguf.GGUFReader`: parsing a 49k-token vocabulary takes seconds, so once)."""
    import gguf as gguf_lib

    def value(key: str) -> Any:
        field = reader.fields.get(key)
        if field is None or not field.data:
            return None
        part = field.parts[field.data[0]]
        if field.types and field.types[0] == gguf_lib.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0]

    add_bos, add_eos = value("tokenizer.ggml.add_bos_token"), value("tokenizer.ggml.add_eos_token")
    return TokenizerRules(bos_id=value("tokenizer.ggml.bos_token_id"), eos_id=value("tokenizer.ggml.eos_token_id"),
                          add_bos=None if add_bos is None else bool(add_bos), add_eos=None if add_eos is None else bool(add_eos),
                          chat_template=value("tokenizer.chat_template"))


def apply_rules(folder: Path, rules: TokenizerRules) -> None:
    """Make the saved tokenizer do what the GGUF says: transformers' GGUF conversion keeps the
    BOS and EOS ids but drops whether each is added, so a model that needs its BOS would lose it."""
    tokenizer_file, config_file = folder / "tokenizer.json", folder / "tokenizer_config.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    by_id = {t["id"]: t["content"] for t in tokenizer.get("added_tokens", [])}
    vocab = tokenizer.get("model", {}).get("vocab", {})
    by_id |= {i: t for t, i in vocab.items()} if isinstance(vocab, dict) else {}
    config = json.loads(config_file.read_text())
    special: dict[str, Any] = {}
    single: list[dict] = []
    ends: list[dict] = []
    for role, token_id, added, into in (("bos", rules.bos_id, rules.add_bos, single), ("eos", rules.eos_id, rules.add_eos, ends)):
        if token_id is None or token_id not in by_id:
            continue
        config[f"{role}_token"] = by_id[token_id]
        if added is not None:
            config[f"add_{role}_token"] = added
        if added:
            special[by_id[token_id]] = {"id": by_id[token_id], "ids": [token_id], "tokens": [by_id[token_id]]}
            into.append({"SpecialToken": {"id": by_id[token_id], "type_id": 0}})
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [*single, {"Sequence": {"id": "A", "type_id": 0}}, *ends],
        "pair": [*single, {"Sequence": {"id": "A", "type_id": 0}}, *ends, {"Sequence": {"id": "B", "type_id": 1}}, *ends],
        "special_tokens": special,
    }
    tokenizer_file.write_text(json.dumps(tokenizer, ensure_ascii=False))
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        generation = json.loads(generation_file.read_text())
        generation |= {k: v for k, v in (("bos_token_id", rules.bos_id), ("eos_token_id", rules.eos_id)) if v is not None}
        generation_file.write_text(json.dumps(generation, indent=2))
    if rules.chat_template and not (folder / "chat_template.jinja").exists() and "chat_template" not in config:
        (folder / "chat_template.jinja").write_text(rules.chat_template)


@functools.cache
def _reader_class() -> type:
    """gguf's reader over a plain array of the mapped file. Its parse slices the file once per value
    (a 49k-token vocabulary and its merges: about 250k slices for SmolLM2), and each slice of a
    `numpy.memmap` runs `memmap`'s Python `__getitem__` and `__array_finalize__`: 3.0 s a parse on
    a Zen 3 EPYC against 1.0 s over the same mapping viewed as an `ndarray` (same fields, same
    tensor bytes, still paged in on demand)."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # the class itself: `_parsed_once` swaps the package's name for `read`

    class Reader(GGUFReader):
        @property
        def data(self) -> Any:
            return self._mapped

        @data.setter
        def data(self, mapped: Any) -> None:
            self._mapped = mapped.view(np.ndarray)

    return Reader


# each file's parse while `_parsed_once` runs (one conversion at a time: `_PATCHING`)
_parsed: dict[tuple[str, str], Any] | None = None


def read(path: Path | str, mode: str = "r") -> Any:
    """A GGUF file parsed (a `gguf.GGUFReader`), without checks; parsed once inside `_parsed_once`."""
    key = (str(Path(path).resolve()), mode)
    if _parsed is not None and key in _parsed:
        return _parsed[key]
    reader = _reader_class()(str(path), mode)
    if _parsed is not None:
        _parsed[key] = reader
    return reader


def check(path: Path) -> Any:
    """Parse the header and tensor table, and make sure every tensor's data lies inside the file;
    the parsed file (a `gguf.GGUFReader`)."""
    try:
        reader = read(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors, ...
        raise LlmoptError(
            f"'{path}' is not a valid GGUF file ({type(exc).__name__}: {exc})",
            "re-download or re-assemble the file; a truncated or corrupt GGUF cannot be imported",
        ) from exc
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise LlmoptError(
                f"'{path}' is truncated: tensor '{tensor.name}' ends at byte {end} but the file has {size}",
                "re-download or re-assemble the file",
            )
    if not reader.tensors:
        raise LlmoptError(f"'{path}' holds no tensors", "import the GGUF file that holds the model's weights")
    return reader


def concatenate(parts: list[Path], dest: Path) -> Path:
    """Join a GGUF shipped in parts, in order, and check the result parses."""
    with dest.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, 16 << 20)
    check(dest)
    return dest


def to_hf_folder(gguf_path: Path, dest: Path) -> TokenizerRules:
    """Dequantize a GGUF into `dest` as bf16 safetensors with tokenizer and chat template; returns
    the GGUF's tokenizer rules, which the saved tokenizer now follows.

    transformers keeps GGUF weights packed by default and then refuses to save them; asking for
    `GgufConfig(dequantize=True)` loads a plain dense model that `save_pretrained` accepts.
    """
    with _parsed_once():
        rules = tokenizer_rules(check(gguf_path))  # before torch's import: a corrupt file is refused seconds sooner

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        folder, name = str(gguf_path.parent), gguf_path.name
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
            )
        except Exception as exc:
            raise LlmoptError(
                f"transformers could not load '{gguf_path}' ({type(exc).__name__}: {exc})",
                "check that the GGUF holds a model architecture transformers supports",
            ) from exc
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    apply_rules(dest, rules)
    return rules


_PATCHING = threading.Lock()


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """Each GGUF parsed once, and each tensor-name map built once, while this block runs.

    transformers parses the file's header (a 49k-token vocabulary, one numpy view per string) for
    the config, again for the tokenizer and again for the weights, and builds gguf's tensor-name
    map once per module (397 for SmolLM2): most of a 54 s import on a Zen 3 EPYC. Both are looked
    up on the `gguf` package when called, and a reader is only read from, so one serves every call.
    """
    import gguf as lib

    global _parsed
    with _PATCHING:  # one conversion at a time (the studio imports in worker threads): each restores what it found
        reader_class, name_map = lib.GGUFReader, lib.get_tensor_name_map
        lib.GGUFReader, lib.get_tensor_name_map, _parsed = read, functools.cache(name_map), {}
        try:
            yield
        finally:
            lib.GGUFReader, lib.get_tensor_name_map, _parsed = reader_class, name_map, None
