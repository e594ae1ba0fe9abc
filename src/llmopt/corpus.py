"""Text shipped with llmopt (written for it, so free to ship): held-out text for perplexity,
calibration text for quantization, passages with questions for the built-in QA workload, and
coding prompts for the built-in coding workload."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PASSAGES = Path(__file__).parent / "data" / "passages.jsonl"
CODING = Path(__file__).parent / "data" / "coding.jsonl"  # coding prompts, the workload of coder models


@dataclass(frozen=True)
class Passage:
    id: str
    split: str  # "heldout" (quality measurement) or "calibration" (quantization)
    title: str
    text: str
    questions: tuple[tuple[str, str], ...]


@cache
def passages(split: str | None = None) -> tuple[Passage, ...]:
    found = []
    for line in PASSAGES.read_text().splitlines():
        data = json.loads(line)
        questions = tuple((q["q"], q["a"]) for q in data["questions"])
        found.append(Passage(data["id"], data["split"], data["title"], data["text"], questions))
    return tuple(p for p in found if split is None or p.split == split)


def heldout_texts() -> list[str]:
    return [p.text for p in passages("heldout")]
