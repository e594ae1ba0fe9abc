"""Every engine knob llmopt sets, typed and validated in one place, and how each maps onto vLLM.

A manifest stores the resulting flags and environment verbatim, so an artifact is served the same
way by `llmopt deploy` and by the exported plain `python -m vllm...` command.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt.engine import platform


class EngineConfig(BaseModel):
    """Engine settings for one served model."""

    model_config = ConfigDict(extra="forbid")

    max_model_len: int = Field(4096, gt=0, description="Longest prompt plus output, in tokens.")
    max_num_seqs: int | None = Field(None, gt=0, description="Most sequences batched at once (vLLM's default if unset).")
    dtype: str = Field("bfloat16", description="Activation and unquantized-weight dtype.")
    kv_cache_gib: int = Field(2, gt=0, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE).")
    kv_cache_dtype: str | None = Field(None, description="KV cache dtype, e.g. fp8 (e4m3) or fp8_e5m2.")
    reserved_cpus: int | None = Field(
        None, ge=0, description="Cores vLLM reserves for its front end on CPU; unset: chosen from the machine."
    )
    preload: bool = Field(True, description="Preload tcmalloc and Intel OpenMP on CPU (LD_PRELOAD).")
    executor: Literal["uni", "mp"] | None = Field(
        None,
        description="On CPU, where the model runs: 'uni' in vLLM's engine-core process, 'mp' in a worker process "
        "of its own (vLLM's CPU default); unset: chosen from the machine (uni up to 4 cores).",
    )
    tensor_parallel_size: int = Field(1, gt=0, description="Devices to shard the model over.")
    speculative_config: dict[str, Any] | None = Field(None, description="vLLM's --speculative-config.")
    compilation_config: dict[str, Any] | None = Field(None, description="vLLM's --compilation-config.")
    seed: int = Field(0, description="Engine sampling seed.")

    @model_validator(mode="after")
    def _one_process_for_one_device(self) -> "EngineConfig":
        if self.executor == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("executor 'uni' runs one model shard; with tensor_parallel_size > 1 use 'mp' or leave it unset")
        return self

    def to_args(self, served_name: str) -> dict[str, object]:
        """vLLM server flags (without dashes), in a stable order."""
        args: dict[str, object] = {
            "served-model-name": served_name,
            "dtype": self.dtype,
            "max-model-len": self.max_model_len,
            "seed": self.seed,
        }
        if self.max_num_seqs is not None:
            args["max-num-seqs"] = self.max_num_seqs
        if self.kv_cache_dtype:
            args["kv-cache-dtype"] = self.kv_cache_dtype
        if self.tensor_parallel_size != 1:
            args["tensor-parallel-size"] = self.tensor_parallel_size
        if self.speculative_config:
            args["speculative-config"] = self.speculative_config
        if self.compilation_config:
            args["compilation-config"] = self.compilation_config
        return args

    def to_env(self, hw: platform.Hardware) -> dict[str, str]:
        executor = self.executor if self.tensor_parallel_size == 1 else "mp"
        return platform.engine_env(hw, self.kv_cache_gib, self.reserved_cpus, self.preload, executor)
