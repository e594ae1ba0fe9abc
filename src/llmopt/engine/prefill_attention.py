"""llmopt's prefill attention kernel (`prefill_attention.cpp`): causal attention over vLLM's paged
bf16 KV cache with AVX-512 BF16 dot products, called where vLLM's CPU attention backend calls its
kernel, on processors without AMX, for steps that carry a prompt (a sequence with 16 queries or
more); decode-only steps, and anything it does not do, go to vLLM's kernel. A step of fewer than
16 tokens (every decode step up to batch 15) is handed over before it leaves Python.

Without AMX vLLM's kernel computes attention at the processor's fp32 rate: on the project's Zen 5
EPYC a quarter of bf16's 884-token prefill of SmolLM2-135M, a third of SmoothQuant's
(`benchmarks/step_profile.py`). This one runs the same prefill's attention about twice as fast
(`benchmarks/cpu_attention.py`). Its probabilities are rounded to bf16 before they multiply the
values, as vLLM's AMX path rounds them, so its outputs are not vLLM's `vec` path's bits: they
agree within bf16's rounding (`compare`), and are no further from attention computed in float64
at their largest, 1.27x on average (tests/test_kernels.py). Keeping P's rounding error out (P in
two bf16 parts) cost a third of the gain and moved no perplexity measurably (benchmarks/README.md,
"prefill_attention.py"). It is `EngineConfig.attention_kernel` 'llmopt', the default where it
applies and llmopt's kernel library is built (`kernels`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmopt.engine import kernels

ENV = "LLMOPT_PREFILL_ATTENTION"  # "1": the engine core's attention layers call it
BLOCK = 128  # vLLM's CPU block size
MIN_QUERIES = 16  # a step is the kernel's when one of its sequences has this many queries (kMinQuery)
# Shapes a new build is checked on: SmolLM2-135M's heads, Qwen2.5-Coder-0.5B's and -1.5B's; each
# with (queries, sequence length) per request: a prompt, a prompt after a cached prefix, a prompt
# beside decodes (a mixed step), short ones, and decodes alone (handed to vLLM's kernel).
CHECKED_HEADS = ((9, 3, 64), (14, 2, 64), (12, 2, 128))
CHECKED_REQUESTS = (((300, 300),), ((200, 700),), ((1, 500), (1, 90), (40, 40)), ((16, 16), (3, 130), (17, 33)),
                    ((1, 800), (1, 129)))
TOLERANCE = 2 ** -6  # of the largest output: a few bf16 roundings (2^-8 each) of one output value


def use(path: str | Path) -> None:
    """Have vLLM's CPU attention call `torch.ops.llmopt.prefill_attention` in this process: it
    takes vLLM's arguments and hands vLLM's kernel every call it does not run itself."""
    import torch
    from vllm import _custom_ops as ops

    kernels.load(path)
    op, vllms = torch.ops.llmopt.prefill_attention, torch.ops._C.cpu_attention_with_kv_cache

    def attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, output: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, causal: bool,
                  alibi_slopes: torch.Tensor | None, sliding_window: int, block_table: torch.Tensor, softcap: float,
                  scheduler_metadata: torch.Tensor, s_aux: torch.Tensor | None,
                  dynamic_causal: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                  kv_cache_dtype: str = "auto") -> None:
        kernel = vllms if query.size(0) < MIN_QUERIES else op  # fewer tokens: no sequence has that many queries
        kernel(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal, alibi_slopes,
           sliding_window, block_table, softcap, scheduler_metadata, s_aux, dynamic_causal, k_scale, v_scale,
           kv_cache_dtype)

    ops.cpu_attention_with_kv_cache = attention  # looked up by name at every call


def compare(path: str | Path, vllms: Callable[..., None]) -> int:
    """The calls checked against vLLM's kernel `vllms` with the library at `path` loaded: every
    `CHECKED_HEADS` with every `CHECKED_REQUESTS`, the query a strided slice of a fused QKV, blocks
    in shuffled order. Outputs within `TOLERANCE` of the largest, and on average within a tenth of
    it; decode-only calls vLLM's own bits. Raises AssertionError on the first that differs."""
    import torch
    from vllm import _custom_ops as ops

    use(path)
    generator = torch.Generator().manual_seed(0)
    isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    checked = 0
    for heads, kv_heads, head_size in CHECKED_HEADS:
        for requests in CHECKED_REQUESTS:
            starts = [0]
            for queries, _ in requests:
                starts.append(starts[-1] + queries)
            counts = [-(-length // BLOCK) for _, length in requests]
            cache = torch.randn(sum(counts) + 2, kv_heads, 2 * BLOCK, head_size, dtype=torch.bfloat16, generator=generator)
            key_cache, value_cache = cache.chunk(2, dim=2)
            order = torch.randperm(cache.size(0), generator=generator).int()
            table = torch.zeros(len(requests), max(counts) + 1, dtype=torch.int32)
            for row, count in enumerate(counts):
                table[row, :count] = order[sum(counts[:row]):sum(counts[:row]) + count]
            seq_lens = torch.tensor([length for _, length in requests], dtype=torch.int32)
            query_start = torch.tensor(starts, dtype=torch.int32)
            fused = torch.randn(starts[-1], (heads + 2 * kv_heads) * head_size, dtype=torch.bfloat16, generator=generator)
            query = fused[:, :heads * head_size].view(-1, heads, head_size)
            plan = ops.cpu_attn_get_scheduler_metadata(len(requests), heads, kv_heads, head_size, seq_lens,
                                                       torch.bfloat16, query_start, True, -1, isa, True)
            outputs = []
            for call in (vllms, ops.cpu_attention_with_kv_cache):
                out = torch.zeros(starts[-1], heads, head_size, dtype=torch.bfloat16)
                call(query, key_cache, value_cache, out, query_start, seq_lens, head_size ** -0.5, True, None, -1,
                     table, 0.0, plan, None)
                outputs.append(out.float())
            theirs, ours = outputs
            shape = (heads, kv_heads, head_size, requests)
            if max(queries for queries, _ in requests) < MIN_QUERIES:
                assert torch.equal(theirs, ours), shape
            else:
                difference = (theirs - ours).abs()
                assert difference.max() <= TOLERANCE * theirs.abs().max(), (shape, difference.max().item())
                assert difference.mean() <= TOLERANCE / 10 * theirs.abs().max(), (shape, difference.mean().item())
            checked += 1
    return checked
