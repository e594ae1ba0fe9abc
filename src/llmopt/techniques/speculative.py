"""The speculative step: a draft model (copied, or quantized, into the artifact) or draft-free n-gram lookup."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from pydantic import TypeAdapter

from llmopt import artifact, catalog, sources
from llmopt.errors import LlmoptError
from llmopt.evaluation import benchmark
from llmopt.recipe import DraftModel, NGram, Quantization
from llmopt.techniques import BuildContext, quantize
from llmopt.techniques.served import SERVED_NAME, served

DRAFT_DIR = "draft"
MAX_BATCH = 65536  # the end of the last range of a speculation schedule; vLLM caps it at max_num_seqs


def catalog_id(model: sources.Model) -> str | None:
    """The catalogue id a store model came from, if any."""
    if model.source.startswith("catalog:"):
        return model.source.split(":", 1)[1]
    return model.id if catalog.is_catalog_id(model.id) else None


@dataclass(frozen=True)
class Draft:
    """The model a recipe drafts with, and how it is quantized before it drafts."""

    model: sources.Model
    quantization: Quantization | None


def resolve_draft(spec: DraftModel, target: sources.Model) -> Draft:
    name, quantization = spec.model, spec.quantization
    if name == "recommended":
        target_id = catalog_id(target)
        if target_id is None:
            raise LlmoptError(
                f"'{target.id}' is not a catalogue model, so it has no recommended draft",
                "name a draft model (speculative.model) or use method ngram",
            )
        entry = catalog.get(target_id)
        name = entry.recommended_draft
        if name == "ngram":
            raise LlmoptError(
                f"'{target_id}' has no smaller sibling to draft with; its recommended method is ngram",
                "use `--speculative ngram` (method: ngram)",
            )
        if quantization is None and entry.recommended_draft_quantization:
            quantization = TypeAdapter(Quantization).validate_python(entry.recommended_draft_quantization)
    return Draft(sources.resolve(name), quantization)


def check_draft(spec: DraftModel, target: sources.Model, verdict) -> Draft | None:
    """Same tokenizer vocabulary, and not larger than the target. The draft, if it resolves."""
    try:
        resolved = resolve_draft(spec, target)
    except LlmoptError as exc:
        verdict.refusals.append(f"{exc.problem}; {exc.fix}")
        return None
    draft = resolved.model
    target_vocab, draft_vocab = _vocabulary(Path(target.path)), _vocabulary(Path(draft.path))
    if target_vocab != draft_vocab:
        differing = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
        verdict.refusals.append(
            f"draft '{draft.id}' has a different tokenizer vocabulary from '{target.id}' "
            f"({len(draft_vocab)} against {len(target_vocab)} tokens, {differing} entries differ); "
            "use a draft from the same model family"
        )
    elif draft.size_bytes > target.size_bytes:
        verdict.refusals.append(
            f"draft '{draft.id}' ({draft.size_bytes / 1e6:.0f} MB) is larger than the target '{target.id}' "
            f"({target.size_bytes / 1e6:.0f} MB); use a smaller draft"
        )
    elif draft.content_hash == target.content_hash and resolved.quantization is None:
        verdict.warnings.append(
            f"draft '{draft.id}' is the target itself: speculation will be exact but cannot be faster"
        )
    return resolved


def engine_config(spec: DraftModel | NGram, draft_path: str | None = None) -> dict[str, object]:
    """vLLM's --speculative-config for a recipe's speculative section."""
    if isinstance(spec, NGram):
        config: dict[str, object] = {
            "method": "ngram",
            "num_speculative_tokens": spec.num_speculative_tokens,
            "prompt_lookup_min": spec.prompt_lookup_min,
            "prompt_lookup_max": spec.prompt_lookup_max,
        }
    else:
        config = {"method": "draft_model", "model": draft_path, "num_speculative_tokens": spec.num_speculative_tokens}
    if isinstance(spec.disable_above_batch, int):
        config["num_speculative_tokens_per_batch_size"] = schedule(spec.num_speculative_tokens, spec.disable_above_batch)
    return config


def schedule(k: int, disable_above_batch: int) -> list[list[int]]:
    """vLLM's dynamic speculative decoding: k tokens up to the batch size, none above it."""
    return [[1, disable_above_batch, k], [disable_above_batch + 1, MAX_BATCH, 0]]


def apply(ctx: BuildContext) -> None:
    spec = ctx.recipe.speculative
    draft_path = None
    if isinstance(spec, DraftModel):
        draft = resolve_draft(spec, ctx.source)
        dest = ctx.workdir / DRAFT_DIR
        reference = {"model": draft.model.id, "content_hash": draft.model.content_hash, "path": DRAFT_DIR}
        if draft.quantization is None:
            shutil.copytree(draft.model.path, dest)
        else:
            ctx.log.info("quantizing the draft %s (%s) before it drafts", draft.model.id, draft.quantization.method)
            dest.mkdir()
            ctx.metrics["draft_quantization"] = quantize.quantize_model(
                draft.quantization, draft.model, dest, ctx.recipe.tensor_parallel_size, ctx.log, lambda f: ctx.progress(0.95 * f))
            reference["quantization"] = draft.quantization.method
        ctx.references["draft"] = reference
        draft_path = artifact.relative(dest, ctx.workdir)
    config = engine_config(spec, draft_path)
    ctx.engine = ctx.engine.model_copy(update={"speculative_config": config})
    ctx.log.info("speculative config: %s", config)
    ctx.progress(1.0)


def _vocabulary(folder: Path) -> dict[str, int]:
    tokenizer_json = folder / "tokenizer.json"
    if tokenizer_json.is_file():
        data = json.loads(tokenizer_json.read_text())
        raw = data["model"]["vocab"]
        vocab = {t[0]: i for i, t in enumerate(raw)} if isinstance(raw, list) else dict(raw)
        vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
        return vocab
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(folder).get_vocab())


def sweep(ctx: BuildContext) -> None:
    """Serve the artifact without and then with speculation, load both at each concurrency level
    on the sweep's workload, and switch speculation off above the last level where it pays."""
    spec = ctx.recipe.speculative
    plan = benchmark.EvaluationSpec(dataset=spec.sweep.dataset, concurrency=spec.sweep.concurrency,
                                    requests=spec.sweep.requests, quality=False)
    measured = {}
    for i, (label, engine) in enumerate([("without", ctx.engine.model_copy(update={"speculative_config": None})),
                                         ("with", ctx.engine)]):
        with served(ctx, str(ctx.workdir), engine, f"sweep-{label}") as run:
            ctx.progress(0.1 + 0.45 * i)
            measured[label] = benchmark.levels(run.server.url, SERVED_NAME, str(ctx.workdir), plan)
    rows = [_row(base, spec_level) for base, spec_level in zip(measured["without"], measured["with"])]
    ctx.metrics["speculation_sweep"] = result = {"dataset": spec.sweep.dataset, "requests_per_level": spec.sweep.requests,
                                                 "levels": rows}
    ctx.log.info("speculation against none, output tokens/s: %s", _table(rows))
    limit = switch_off_above(rows, spec.sweep.dataset)
    result["first_level_below_1x"] = next((r["concurrency"] for r in rows if r["speedup"] < 1.0), None)
    if limit is not None:
        config = {**ctx.engine.speculative_config,
                  "num_speculative_tokens_per_batch_size": schedule(spec.num_speculative_tokens, limit)}
        ctx.engine = ctx.engine.model_copy(update={"speculative_config": config})
        result["disable_above_batch"] = limit
        ctx.log.info("speculation switched off above batch %d", limit)
    ctx.progress(1.0)


def switch_off_above(rows: list[dict], dataset: str) -> int | None:
    """The last level before the first where speculation loses; None if it pays at every level.
    A recipe whose speculation loses even at the lowest level fails: it would only cost."""
    losing = next((i for i, row in enumerate(rows) if row["speedup"] < 1.0), None)
    if losing == 0:
        raise LlmoptError(
            f"speculation does not pay here: {_table(rows)} output tokens/s against none on {dataset} "
            f"(acceptance {rows[0]['acceptance_rate']:.2f})",
            "sweep on a workload like yours (speculative.sweep.dataset), lower num_speculative_tokens, or drop speculation",
        )
    return None if losing is None else rows[losing - 1]["concurrency"]


def _table(rows: list[dict]) -> str:
    return ", ".join(f"c{r['concurrency']} {r['speedup']:.2f}x" for r in rows)


def _row(base: dict, spec: dict) -> dict:
    accepted = spec["speculative"] or {}
    return {"concurrency": base["concurrency"],
            "output_tokens_per_s": round(spec["output_tokens_per_s"], 2),
            "output_tokens_per_s_without": round(base["output_tokens_per_s"], 2),
            "speedup": round(spec["output_tokens_per_s"] / base["output_tokens_per_s"], 3),
            "acceptance_rate": round(accepted.get("acceptance_rate", 0.0), 3),
            "mean_accepted_length": round(accepted.get("mean_accepted_length", 0.0), 2)}
