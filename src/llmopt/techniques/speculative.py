"""The speculative step: a draft model (copied into the artifact) or draft-free n-gram lookup."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from llmopt import artifact, catalog, sources
from llmopt.errors import LlmoptError
from llmopt.recipe import DraftModel, NGram
from llmopt.techniques import BuildContext

DRAFT_DIR = "draft"
MAX_BATCH = 65536  # the end of the last range of a speculation schedule; vLLM caps it at max_num_seqs


def catalog_id(model: sources.Model) -> str | None:
    """The catalogue id a store model came from, if any."""
    if model.source.startswith("catalog:"):
        return model.source.split(":", 1)[1]
    return model.id if catalog.is_catalog_id(model.id) else None


def resolve_draft(spec: DraftModel, target: sources.Model) -> sources.Model:
    name = spec.model
    if name == "recommended":
        target_id = catalog_id(target)
        if target_id is None:
            raise LlmoptError(
                f"'{target.id}' is not a catalogue model, so it has no recommended draft",
                "name a draft model (speculative.model) or use method ngram",
            )
        name = catalog.get(target_id).recommended_draft
        if name == "ngram":
            raise LlmoptError(
                f"'{target_id}' has no smaller sibling to draft with; its recommended method is ngram",
                "use `--speculative ngram` (method: ngram)",
            )
    return sources.resolve(name)


def check_draft(spec: DraftModel, target: sources.Model, verdict) -> None:
    """Same tokenizer vocabulary, and not larger than the target."""
    try:
        draft = resolve_draft(spec, target)
    except LlmoptError as exc:
        verdict.refusals.append(f"{exc.problem}; {exc.fix}")
        return
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
    elif draft.content_hash == target.content_hash:
        verdict.warnings.append(
            f"draft '{draft.id}' is the target itself: speculation will be exact but cannot be faster"
        )


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
    if spec.disable_above_batch:
        # vLLM's dynamic speculative decoding: k tokens up to the batch size, none above it.
        config["num_speculative_tokens_per_batch_size"] = [
            [1, spec.disable_above_batch, spec.num_speculative_tokens],
            [spec.disable_above_batch + 1, MAX_BATCH, 0],
        ]
    return config


def apply(ctx: BuildContext) -> None:
    spec = ctx.recipe.speculative
    draft_path = None
    if isinstance(spec, DraftModel):
        draft = resolve_draft(spec, ctx.source)
        dest = ctx.workdir / DRAFT_DIR
        shutil.copytree(draft.path, dest)
        ctx.references["draft"] = {"model": draft.id, "content_hash": draft.content_hash, "path": DRAFT_DIR}
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
