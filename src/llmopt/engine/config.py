"""Every engine knob llmopt sets, typed and validated in one place, like vLLM's own `vllm/config/`.

Manifests and endpoint records store these settings, never flags: `engine/vllm.py` alone turns
them into vLLM's command line and environment, on the machine that serves them. So a manifest can
only ask for what these models allow, and machine-specific values (where a library lives, how many
threads to run) are worked out where the model is served.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_BATCH = 65536  # the end of the last range of a speculation schedule; vLLM caps it at max_num_seqs


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchTokens(_Settings):
    """Speculative tokens proposed while the batch holds `first` to `last` sequences."""

    first: int = Field(gt=0)
    last: int = Field(gt=0)
    tokens: int = Field(ge=0)


class SpeculativeConfig(_Settings):
    """Speculative decoding (vLLM's `speculative_config`): n-gram prompt lookup or a draft model."""

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int = Field(gt=0, le=16)
    model: str | None = Field(None, description="The draft's folder; inside an artifact, relative to it ('./draft').")
    prompt_lookup_min: int | None = Field(None, gt=0)
    prompt_lookup_max: int | None = Field(None, gt=0)
    schedule: tuple[BatchTokens, ...] | None = Field(
        None, description="Tokens proposed per batch size (vLLM's dynamic speculation); unset: always k."
    )

    @model_validator(mode="after")
    def _complete(self) -> "SpeculativeConfig":
        if self.method == "draft_model" and not self.model:
            raise ValueError("a draft_model speculative config needs the draft's folder (model)")
        if self.method == "ngram" and (self.prompt_lookup_min is None or self.prompt_lookup_max is None):
            raise ValueError("an ngram speculative config needs prompt_lookup_min and prompt_lookup_max")
        return self

    def disabled_above(self, batch: int) -> "SpeculativeConfig":
        """k tokens up to `batch` sequences, none above: no drafts where speculation stops paying."""
        k = self.num_speculative_tokens
        return self.model_copy(update={"schedule": (BatchTokens(first=1, last=batch, tokens=k),
                                                    BatchTokens(first=batch + 1, last=MAX_BATCH, tokens=0))})

    @property
    def disabled_above_batch(self) -> int | None:
        """The batch size above which no drafts are proposed, when the schedule says so."""
        if self.schedule and len(self.schedule) == 2 and self.schedule[1].tokens == 0 and self.schedule[0].tokens:
            return self.schedule[0].last
        return None


class CompilationConfig(_Settings):
    """How the engine runs the model's graph: compiled with torch.compile (kept in llmopt's compile
    cache), or eagerly (no compile at start, slower steps)."""

    mode: Literal["compiled", "eager"] = "compiled"
    wrapper: Literal["python", "cpp"] | None = Field(
        None,
        description="How the compiled graph calls its kernels and ops each step: 'python', vLLM's default (a Python "
        "function of about 300 calls a step), or 'cpp', Inductor's C++ wrapper (the graph's calls from C++; vLLM's "
        "custom ops then name their layers by plain strings, VLLM_USE_LAYERNAME=0, and a cold compile takes "
        "25-50 s longer); unset: chosen from the machine (cpp on CPUs with AVX-512, python on AVX2 ones, where served it "
        "read faster for bf16 and slower for SmoothQuant, and on GPUs, where vLLM replays CUDA graphs).",
    )
    graph: Literal["whole", "piecewise"] | None = Field(
        None,
        description="What Inductor compiles on a CPU: 'whole', the model traced and compiled as one graph (vLLM's CPU "
        "default), or 'piecewise', the graph split at the attention ops and each piece compiled, a layer's pieces "
        "alike and so compiled once (vLLM's GPU way). A cold compile of SmolLM2-135M took 45-52 s piecewise against "
        "85-112 s whole on a Zen 3 EPYC and 40-49 s against 94 s on a Zen 4, and served its steps were longer "
        "(SmoothQuant 0.91x at batch 1 on Zen 3, bf16 0.73-0.77x on Zen 4): for compile-bound work, where a start "
        "matters more than the steps; unset: whole on CPUs; on GPUs vLLM always compiles piecewise.",
    )


class EngineConfig(_Settings):
    """Engine settings for one served model."""

    max_model_len: int = Field(4096, gt=0, le=1 << 24, description="Longest prompt plus output, in tokens.")
    max_num_seqs: int | None = Field(None, gt=0, le=4096, description="Most sequences batched at once (vLLM's default if unset).")
    max_num_batched_tokens: int | None = Field(
        None, gt=0, le=1 << 20, description="Tokens scheduled per step: the chunked-prefill budget (vLLM's default if unset)."
    )
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="Activation and unquantized-weight dtype; unset: chosen from the machine (bfloat16, or float32 "
        "on x86 processors without AVX-512, where vLLM has no bf16 matmul and torch's runs 2-9x slower than fp32)."
    )
    stream_interval: int = Field(
        1, ge=1, le=4096, description="Output tokens the server gathers into each streamed chunk after the first: "
        "fewer chunks to serialize and send, at the cost of a burstier stream (1: every token as it comes)."
    )
    kv_cache_gib: int = Field(2, gt=0, le=4096, description="KV cache size on CPU, GiB.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Share of each GPU's memory vLLM may take (weights, activations, KV cache); "
        "GPU only; unset: vLLM's default."
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = Field(None, description="KV cache dtype.")
    reserved_cpus: int | None = Field(
        None, ge=0, le=1024, description="Cores vLLM reserves for its front end on CPU; unset: chosen from the machine."
    )
    preload: bool = Field(True, description="Preload tcmalloc and Intel OpenMP on CPU, found where the model is served.")
    executor: Literal["uni", "mp"] | None = Field(
        None,
        description="On CPU, where the model runs: 'uni' in vLLM's engine-core process, 'mp' in a worker process "
        "of its own (vLLM's CPU default); unset: chosen from the machine (uni up to 4 cores).",
    )
    linear_kernels: Literal["vllm", "packed", "llmopt", "weight_only"] | None = Field(
        None,
        description="On CPU, the kernels of the bf16 and int8 linear layers: 'vllm' as vLLM chooses (oneDNN, or its "
        "packed-weight kernels for small layers on AMX), 'packed' vLLM's packed-weight kernels for every layer whose "
        "shape they take (needs AVX-512 BF16 and VNNI), 'llmopt' the same with llmopt's small-batch kernels for bf16 "
        "layers at up to 64 rows and int8 ones at 5 to 32 (with AMX, for bf16 layers at up to 4 rows alone, "
        "vLLM's choice above, the layers it gives oneDNN holding their weights twice; "
        "built with the machine's C++ compiler; on x86 without "
        "AVX-512 nor VNNI: llmopt's AVX2 kernels at every row count, for float32 layers with their weights held in bf16 "
        "where bf16 holds them exactly, and W8A8 for int8 ones), "
        "'weight_only' vLLM's for float layers and "
        "torch's weight-only int8 kernel for int8 ones, their activations in bf16 rather than quantized; unset: chosen "
        "from the machine (on AVX-512 BF16 and VNNI, llmopt where its kernel is built, else packed, or with AMX vllm; "
        "on x86 without AVX-512 nor VNNI, llmopt where its kernel is built, else weight_only).",
    )
    attention_kernel: Literal["vllm", "llmopt"] | None = Field(
        None,
        description="On CPU, the attention kernel: 'vllm' vLLM's alone, 'llmopt' llmopt's kernel for causal "
        "attention (prompts, decodes, and the tokens speculative decoding verifies; built with the machine's C++ "
        "compiler: bf16 on AVX-512 BF16 without AMX, float32 on x86 with AVX2 and neither AVX-512 nor VNNI), vLLM's "
        "for the rest (sliding windows, ALiBi, soft caps, sinks, an FP8 cache); unset: chosen from the machine "
        "(llmopt where its kernel applies and is built).",
    )
    tensor_parallel_size: int = Field(1, gt=0, le=1024, description="Devices to shard the model over.")
    speculative: SpeculativeConfig | None = Field(None, description="Speculative decoding.")
    compilation: CompilationConfig = Field(default_factory=CompilationConfig, description="Graph compilation.")
    seed: int = Field(0, ge=0, description="Engine sampling seed.")

    @model_validator(mode="after")
    def _consistent(self) -> "EngineConfig":
        if self.executor == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("executor 'uni' runs one model shard; with tensor_parallel_size > 1 use 'mp' or leave it unset")
        if self.max_num_batched_tokens is not None and self.max_num_seqs is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_num_seqs "
                             f"({self.max_num_seqs}); every batched sequence needs a token per step")
        if self.speculative and self.speculative.num_speculative_tokens >= self.max_model_len:
            raise ValueError("speculative num_speculative_tokens must be smaller than max_model_len")
        return self
