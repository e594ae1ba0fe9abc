"""Chunked prefill: how many tokens the scheduler batches per step. A long prompt is prefilled in
chunks of this size between the decoding steps of the other requests: smaller chunks keep those
requests streaming while prompts arrive (steadier inter-token latency under load), larger ones
finish each prompt sooner (lower time to first token). vLLM's default on CPU is 2048 per step."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from llmopt.engine import vllm
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError
from llmopt.techniques.base import Running, Section, Technique


class ChunkedPrefill(Section):
    max_num_batched_tokens: int = Field(512, ge=16, le=1 << 20, description="Tokens scheduled per engine step.")


class Budget(BaseModel):
    max_num_batched_tokens: int  # as the running engine reports it


class ChunkedPrefillTechnique(Technique):
    section = "chunked_prefill"
    spec = ChunkedPrefill
    verification = Budget

    def configure(self, spec: ChunkedPrefill, engine: EngineConfig) -> EngineConfig:
        return engine.model_copy(update={"max_num_batched_tokens": spec.max_num_batched_tokens})

    def verify(self, engine: EngineConfig, running: Running) -> Budget | None:
        """The engine schedules with the budget it was given, as its own log says."""
        if engine.max_num_batched_tokens is None:
            return None
        logged = vllm.chunked_prefill_budget(Path(running.log_path).read_text(errors="replace"))
        if logged != engine.max_num_batched_tokens:
            raise LlmoptError(f"the engine schedules {logged} tokens per step, not the {engine.max_num_batched_tokens} "
                              "it was given", f"read its log at {running.log_path}")
        return Budget(max_num_batched_tokens=logged)


TECHNIQUE = ChunkedPrefillTechnique()
