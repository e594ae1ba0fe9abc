"""Tensor parallelism: the model's layers split over several devices. Running it is vLLM's job;
llmopt checks the split is possible here and passes the degree on."""

from __future__ import annotations

from pydantic import Field

from llmopt.engine.config import EngineConfig
from llmopt.techniques.base import CheckContext, Section, Technique


class Sharding(Section):
    tensor_parallel_size: int = Field(1, gt=0, le=1024)


class ShardingTechnique(Technique):
    section = "sharding"
    spec = Sharding

    def names(self, spec: Sharding) -> list[str]:
        return ["sharding.tensor_parallel"] if spec.tensor_parallel_size > 1 else []

    def configure(self, spec: Sharding, engine: EngineConfig) -> EngineConfig:
        return engine.model_copy(update={"tensor_parallel_size": spec.tensor_parallel_size})

    def check(self, spec: Sharding, ctx: CheckContext) -> None:
        """As many devices as the degree, and attention heads that divide between them."""
        degree = spec.tensor_parallel_size
        devices = ctx.hardware.gpu_count if ctx.hardware.device == "cuda" else 1
        heads = ctx.config.get("num_attention_heads")
        if degree > devices:
            ctx.verdict.refusals.append(
                f"tensor_parallel_size {degree} needs {degree} {ctx.hardware.device} devices but this machine has "
                f"{devices}; use tensor_parallel_size {devices}"
            )
        elif heads and heads % degree:
            ctx.verdict.refusals.append(f"{heads} attention heads do not split over {degree} devices; "
                                        f"use a degree that divides {heads}")


TECHNIQUE = ShardingTechnique()
