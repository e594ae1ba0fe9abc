"""Recipe sections that are engine settings only: the KV cache dtype and tensor parallelism."""

from __future__ import annotations

from llmopt.techniques import BuildContext


def apply(ctx: BuildContext) -> None:
    updates: dict[str, object] = {}
    if ctx.recipe.kv_cache and ctx.recipe.kv_cache.dtype != "auto":
        updates["kv_cache_dtype"] = ctx.recipe.kv_cache.dtype
    if ctx.recipe.sharding:
        updates["tensor_parallel_size"] = ctx.recipe.sharding.tensor_parallel_size
    ctx.engine = ctx.engine.model_copy(update=updates)
    ctx.log.info("engine settings: %s", updates)
    ctx.progress(1.0)
