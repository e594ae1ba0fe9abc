"""The supported-models matrix, from runs: which architectures go through which techniques here.

Each architecture is tried on a small random-weight model built from its configuration with
transformers (the default model's tokenizer, a few MB of weights): imported, then every technique
as an ordinary job (its measure step serves the artifact and completes prompts), then deployed and
asked for a completion. What the compatibility matrix refuses here is recorded as refused, with its
reason; what fails, as failed, with the error. `benchmarks/coverage.py` runs every architecture and
writes `catalog/coverage.json`; `llmopt models matrix` and the README's table render that file.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from llmopt import catalog, serving, sources, techniques
from llmopt.engine import platform, vllm
from llmopt.errors import LlmoptError
from llmopt.jobs import runner, store
from llmopt.recipe import parse

RESULTS = Path(__file__).parent / "catalog" / "coverage.json"
SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
# model_type -> the configuration of a small random model of that architecture
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": SMALL,
    "mistral": SMALL,
    "qwen2": SMALL,
    "qwen3": {**SMALL, "head_dim": 32},
    "gemma": {**SMALL, "head_dim": 32},
    "gemma2": {**SMALL, "head_dim": 32},
    "gemma3_text": {**SMALL, "head_dim": 32},
    "phi3": SMALL,
    "granite": SMALL,
    "stablelm": {**SMALL, "num_key_value_heads": 4},
    "opt": dict(hidden_size=128, ffn_dim=256, num_attention_heads=4, num_hidden_layers=2, word_embed_proj_dim=128),
    "gpt2": dict(n_embd=128, n_layer=2, n_head=4),
    "gpt_neox": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_hidden_layers=2),
    "bloom": dict(hidden_size=128, n_layer=2, n_head=4),
    "falcon": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False),
}
# the recipe section each technique of the table stands for (speculation at every batch size: no sweep)
TECHNIQUES: dict[str, dict[str, Any]] = {
    "quantization.smoothquant": {"quantization": {"method": "smoothquant", "max_perplexity_increase": 10,
                                                  "calibration": {"samples": 8, "sequence_length": 128}}},
    "quantization.awq": {"quantization": {"method": "awq", "max_perplexity_increase": 10,
                                          "calibration": {"samples": 8, "sequence_length": 128}}},
    "quantization.fp8.block": {"quantization": {"method": "fp8", "scheme": "block", "max_perplexity_increase": 10}},
    "speculative.ngram": {"speculative": {"method": "ngram", "disable_above_batch": "never"}},
}
COLUMNS = ("import", *TECHNIQUES, "deploy")


class Outcome(BaseModel):
    architecture: str  # the Hugging Face class, e.g. LlamaForCausalLM
    technique: str  # a column of COLUMNS
    status: Literal["run", "refused", "failed"]
    detail: str  # what was measured, or why
    processor: str
    engine: str
    date: float


def build(model_type: str, folder: Path) -> Path:
    """A small random-weight model of an architecture, with the default model's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer_folder = Path(sources.resolve(catalog.DEFAULT_MODEL).path)
    config = AutoConfig.for_model(model_type, vocab_size=49152, max_position_embeddings=4096, **ARCHITECTURES[model_type])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_folder / name).is_file():
            shutil.copyfile(tokenizer_folder / name, folder / name)
    return folder


def run(model_type: str, workdir: Path, columns: tuple[str, ...] = COLUMNS) -> list[Outcome]:
    """Every column for one architecture, on this machine."""
    hardware = platform.detect()
    stamp = dict(processor=hardware.cpu_label, engine=" ".join(vllm.engine_name_version()))
    found: list[Outcome] = []
    name = f"coverage-{model_type.replace('_', '-')}"
    try:
        existing = sources.get(name)
        model = existing or sources.import_model(str(build(model_type, workdir / name)), name=name)
    except LlmoptError as exc:
        return [Outcome(architecture=model_type, technique="import", status="failed", detail=exc.one_line(), date=time.time(), **stamp)]
    architecture = model.architecture or model_type
    found.append(Outcome(architecture=architecture, technique="import", status="run", date=time.time(), **stamp,
                         detail=f"{model.size_bytes / 1e6:.0f} MB, chat template: {model.chat_template or 'none'}"))
    for technique, section in TECHNIQUES.items():
        if technique not in columns:
            continue
        recipe = parse(section)
        verdict = techniques.check(recipe, model, hardware)
        if verdict.refusals:
            found.append(Outcome(architecture=architecture, technique=technique, status="refused", detail=verdict.refusals[0],
                                 date=time.time(), **stamp))
            continue
        job = runner.create(model.id, recipe, name=f"{name}-{technique.replace('.', '-')}").wait()
        record = job.record
        ok = record.status == store.COMPLETED
        found.append(Outcome(architecture=architecture, technique=technique, status="run" if ok else "failed", date=time.time(),
                             detail="served, verified and measured by its job" if ok else record.failure_reason or record.status,
                             **stamp))
    if "deploy" in columns:
        found.append(_deploy(model, architecture, stamp))
    return found


def _deploy(model: sources.Model, architecture: str, stamp: dict[str, str]) -> Outcome:
    import httpx

    try:
        with serving.deploy(serving.for_target(model.id), temporary=True) as endpoint:
            body = {"model": endpoint.served_name, "prompt": "The lighthouse", "max_tokens": 8, "temperature": 0}
            completion = httpx.post(f"{endpoint.url}/v1/completions", json=body, timeout=120).json()
            tokens = completion["usage"]["completion_tokens"]
    except (LlmoptError, KeyError, httpx.HTTPError) as exc:
        detail = exc.one_line() if isinstance(exc, LlmoptError) else f"{type(exc).__name__}: {exc}"
        return Outcome(architecture=architecture, technique="deploy", status="failed", detail=detail, date=time.time(), **stamp)
    return Outcome(architecture=architecture, technique="deploy", status="run", detail=f"completed {tokens} tokens",
                   date=time.time(), **stamp)


def load() -> list[Outcome]:
    return [Outcome.model_validate(o) for o in json.loads(RESULTS.read_text())] if RESULTS.is_file() else []


def save(outcomes: list[Outcome]) -> None:
    kept = {(o.architecture, o.technique): o for o in load()}
    kept |= {(o.architecture, o.technique): o for o in outcomes}
    RESULTS.write_text(json.dumps([o.model_dump() for o in sorted(kept.values(), key=lambda o: (o.architecture, o.technique))],
                                  indent=2))


def matrix(outcomes: list[Outcome]) -> tuple[list[str], list[list[str]]]:
    """A row per architecture, a column per technique: run (with the date), refused (why), failed, or untested."""
    by_cell = {(o.architecture, o.technique): o for o in outcomes}
    rows = []
    for architecture in sorted({o.architecture for o in outcomes}):
        cells = []
        for technique in COLUMNS:
            found = by_cell.get((architecture, technique))
            if found is None:
                cells.append("untested")
            elif found.status == "run":
                cells.append(f"run {time.strftime('%Y-%m-%d', time.gmtime(found.date))}")
            else:
                cells.append(f"{found.status}: {found.detail[:90]}")
        rows.append([architecture, *cells])
    return ["architecture", *COLUMNS], rows


def markdown(outcomes: list[Outcome]) -> str:
    """The README's table: a word per cell, each distinct reason once, numbered below it."""
    by_cell = {(o.architecture, o.technique): o for o in outcomes}
    reasons: dict[str, int] = {}
    lines = ["| architecture | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for architecture in sorted({o.architecture for o in outcomes}):
        cells = []
        for technique in COLUMNS:
            found = by_cell.get((architecture, technique))
            if found is None or found.status == "run":
                cells.append("untested" if found is None else "run")
            else:
                number = reasons.setdefault(found.detail.replace("|", "/"), len(reasons) + 1)
                cells.append(f"{found.status} [{number}]")
        lines.append(f"| {architecture} | " + " | ".join(cells) + " |")
    stamps = sorted({(o.processor, o.engine) for o in outcomes})
    days = sorted({time.strftime("%Y-%m-%d", time.gmtime(o.date)) for o in outcomes})
    notes = [f"[{n}] {reason}" for reason, n in reasons.items()]
    where = "; ".join(f"{processor}, {engine}" for processor, engine in stamps)
    return "\n".join(lines) + "\n\n" + "".join(f"{note}\n\n" for note in notes) + (
        f"Run on {where}, {days[0]}{' to ' + days[-1] if len(days) > 1 else ''}.\n" if outcomes else "")
