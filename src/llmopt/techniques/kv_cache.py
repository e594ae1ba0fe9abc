"""KV cache dtype: FP8 halves the cache's bytes per token, so twice the tokens fit (more sequences
or longer contexts at once), at a quality cost measured against the source."""

from __future__ import annotations

from typing import Literal

from llmopt.engine.config import EngineConfig
from llmopt.techniques.base import Section, Technique


class KVCache(Section):
    dtype: Literal["auto", "fp8", "fp8_e5m2"] = "fp8"


class KVCacheTechnique(Technique):
    section = "kv_cache"
    spec = KVCache

    def names(self, spec: KVCache) -> list[str]:
        return [] if spec.dtype == "auto" else [f"kv_cache.{spec.dtype}"]

    def configure(self, spec: KVCache, engine: EngineConfig) -> EngineConfig:
        return engine if spec.dtype == "auto" else engine.model_copy(update={"kv_cache_dtype": spec.dtype})

    def changes_numerics(self, spec: KVCache) -> bool:
        return spec.dtype != "auto"


TECHNIQUE = KVCacheTechnique()
