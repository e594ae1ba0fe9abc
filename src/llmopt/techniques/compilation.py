"""Compilation: build the engine once for the recipe's serving shapes, keep the compiled code in
the compile cache and in the artifact (`compile-cache/`). The measure step's start, which follows,
is the precompiled start the manifest compares with the cold one, so the manifest says what the
technique buys without a third engine start."""

from __future__ import annotations

from pydantic import BaseModel, Field

from llmopt.engine import compile_cache
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError
from llmopt.techniques.base import BuildContext, Section, Step, Technique
from llmopt.techniques.served import Served, served


class Compilation(Section):
    """Ahead-of-time compilation for fixed serving shapes, kept in the compile cache."""

    max_num_seqs: int = Field(16, gt=0, le=4096)
    max_model_len: int = Field(4096, gt=0, le=1 << 24)


class CompilationRecord(BaseModel):
    key: str
    cold_ready_seconds: float | None
    reused_cache: bool  # an earlier job or deployment compiled this key
    cache_bytes: int
    precompiled_ready_seconds: float | None = None
    ratio: float | None = None  # precompiled over cold start


class CompilationTechnique(Technique):
    section = "compilation"
    spec = Compilation
    metrics = CompilationRecord

    def configure(self, spec: Compilation, engine: EngineConfig) -> EngineConfig:
        return engine.model_copy(update={"max_num_seqs": spec.max_num_seqs, "max_model_len": spec.max_model_len})

    def steps(self, spec: Compilation) -> list[Step]:
        return [Step("compile", self._compile)]

    def _compile(self, ctx: BuildContext) -> None:
        with served(ctx, str(ctx.workdir), ctx.engine, "compile") as first:
            start, entry = first.start, first.cache_entry
        compile_cache.export(entry, ctx.workdir / compile_cache.ARTIFACT_DIR)
        ctx.metrics[self.section] = CompilationRecord(key=entry.key, cold_ready_seconds=start.cold_ready_seconds,
                                                      reused_cache=start.outcome == "precompiled",
                                                      cache_bytes=entry.size_bytes())
        ctx.log.info("compiled for max_num_seqs=%s max_model_len=%d (cache %s, %s)",
                     ctx.engine.max_num_seqs, ctx.engine.max_model_len, entry.key[:12], start.outcome)
        ctx.progress(1.0)

    def measure(self, spec: Compilation, ctx: BuildContext, served: Served) -> None:
        """The measure step's start ran on the cache the compile step filled: it must have compiled nothing."""
        compiled = ctx.metrics[self.section]
        assert isinstance(compiled, CompilationRecord)
        start = served.start
        if start.outcome != "precompiled" or start.key != compiled.key:
            raise LlmoptError(
                f"the engine start after compiling compiled again ({start.compiled_files_added} new files in compile "
                f"cache {start.key[:12]}, compiled {compiled.key[:12]})",
                "report this with the job's logs; deploy without --compile meanwhile",
            )
        cold, warm = compiled.cold_ready_seconds, start.ready_seconds
        ctx.metrics[self.section] = compiled.model_copy(
            update={"precompiled_ready_seconds": warm, "ratio": round(warm / cold, 3) if cold else None})
        ctx.log.info("cold start %.1f s, precompiled %.1f s", cold or 0.0, warm)


TECHNIQUE = CompilationTechnique()
