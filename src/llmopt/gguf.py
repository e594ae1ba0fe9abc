"""GGUF files: check they are whole, and dequantize them once into a bf16 Hugging Face folder.

vLLM serves Hugging Face folders best on CPU, and later steps (quantization with llm-compressor,
hashing, compile caches) want plain safetensors, so a GGUF is converted at import, not at serve.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from llmopt.errors import LlmoptError


def check(path: Path) -> None:
    """Parse the header and tensor table, and make sure every tensor's data lies inside the file."""
    import gguf as gguf_lib

    try:
        reader = gguf_lib.GGUFReader(str(path))
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


def concatenate(parts: list[Path], dest: Path) -> Path:
    """Join a GGUF shipped in parts, in order, and check the result parses."""
    with dest.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, 16 << 20)
    check(dest)
    return dest


def to_hf_folder(gguf_path: Path, dest: Path) -> None:
    """Dequantize a GGUF into `dest` as bf16 safetensors with tokenizer and chat template.

    transformers keeps GGUF weights packed by default and then refuses to save them; asking for
    `GgufConfig(dequantize=True)` loads a plain dense model that `save_pretrained` accepts.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    check(gguf_path)
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
