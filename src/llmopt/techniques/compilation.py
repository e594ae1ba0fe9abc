"""The compilation step: build the engine once for the recipe's serving shapes, keep the compiled
code in the compile cache and in the artifact (`compile-cache/`), and measure a cold start against
a precompiled one, so the manifest says what the technique buys."""

from __future__ import annotations

from llmopt.engine import compile_cache
from llmopt.errors import LlmoptError
from llmopt.techniques import BuildContext
from llmopt.techniques.measure import served


def apply(ctx: BuildContext) -> None:
    shapes = ctx.recipe.compilation
    assert shapes is not None
    ctx.engine = ctx.engine.model_copy(update={"max_num_seqs": shapes.max_num_seqs, "max_model_len": shapes.max_model_len})
    label = ctx.workdir.name.removeprefix(".build")
    with served(ctx, str(ctx.workdir), ctx.engine, f"compile{label}-first") as first:
        start, entry = first.compile_cache, first.cache_entry
    ctx.progress(0.6)
    reused = start["outcome"] == "precompiled"  # an earlier job or deployment compiled this key
    if not reused:
        with served(ctx, str(ctx.workdir), ctx.engine, f"compile{label}-precompiled") as second:
            start = second.compile_cache
        if start["outcome"] != "precompiled":
            raise LlmoptError(
                f"a second engine start compiled again ({start['compiled_files_added']} new files in compile cache {start['key'][:12]})",
                "report this with the job's logs; deploy without --compile meanwhile",
            )
    compile_cache.export(entry, ctx.workdir / compile_cache.ARTIFACT_DIR)
    cold, warm = start["cold_ready_seconds"], start["ready_seconds"]
    ctx.metrics["compilation"] = {
        "key": entry.key,
        "cold_ready_seconds": cold,
        "precompiled_ready_seconds": warm,
        "ratio": round(warm / cold, 3) if cold else None,
        "reused_cache": reused,
        "cache_bytes": entry.size_bytes(),
    }
    ctx.log.info("compiled for max_num_seqs=%d max_model_len=%d: cold start %.1f s, precompiled %.1f s (cache %s)",
                 shapes.max_num_seqs, shapes.max_model_len, cold, warm, entry.key[:12])
    ctx.progress(1.0)
