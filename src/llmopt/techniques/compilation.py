"""The compilation step: build the engine once for the recipe's serving shapes, keep the compiled
code in the compile cache and in the artifact (`compile-cache/`). The measure step's start, which
follows, is the precompiled start the manifest compares with the cold one, so the manifest says
what the technique buys without a third engine start."""

from __future__ import annotations

from llmopt.engine import compile_cache
from llmopt.errors import LlmoptError
from llmopt.techniques import BuildContext
from llmopt.techniques.served import served


def apply(ctx: BuildContext) -> None:
    shapes = ctx.recipe.compilation
    assert shapes is not None
    ctx.engine = ctx.engine.model_copy(update={"max_num_seqs": shapes.max_num_seqs, "max_model_len": shapes.max_model_len})
    with served(ctx, str(ctx.workdir), ctx.engine, "compile") as first:
        start, entry = first.compile_cache, first.cache_entry
    compile_cache.export(entry, ctx.workdir / compile_cache.ARTIFACT_DIR)
    ctx.metrics["compilation"] = {
        "key": entry.key,
        "cold_ready_seconds": start["cold_ready_seconds"],
        "reused_cache": start["outcome"] == "precompiled",  # an earlier job or deployment compiled this key
        "cache_bytes": entry.size_bytes(),
    }
    ctx.log.info("compiled for max_num_seqs=%d max_model_len=%d (cache %s, %s)",
                 shapes.max_num_seqs, shapes.max_model_len, entry.key[:12], start["outcome"])
    ctx.progress(1.0)


def record_precompiled_start(ctx: BuildContext, start: dict) -> None:
    """The measure step's start ran on the cache the compile step filled: it must have compiled nothing."""
    compiled = ctx.metrics["compilation"]
    if start["outcome"] != "precompiled" or start["key"] != compiled["key"]:
        raise LlmoptError(
            f"the engine start after compiling compiled again ({start['compiled_files_added']} new files in compile "
            f"cache {start['key'][:12]}, compiled {compiled['key'][:12]})",
            "report this with the job's logs; deploy without --compile meanwhile",
        )
    cold, warm = compiled["cold_ready_seconds"], start["ready_seconds"]
    compiled.update(precompiled_ready_seconds=warm, ratio=round(warm / cold, 3) if cold else None)
    ctx.log.info("cold start %.1f s, precompiled %.1f s", cold, warm)
