"""vLLM's CPU attention kernel alone, with SmolLM2-135M's shapes (9 query heads, 3 KV heads, head
size 64, the cache in the dtype llmopt serves in here: bf16, float32 on x86 without AVX-512): seven decodes over 800-token contexts, one prompt's prefill, and both in one
call as a mixed step carries them, on one and on two OpenMP threads. Whether a mixed step costs
more than its parts (the kernel's scheduler splits work between threads by KV length, not by
query count), and at what rate a prefill's attention runs against the machine's fp32 and bf16
matmul rates; beside it, llmopt's prefill attention kernel (`engine/prefill_attention.cpp`, on
AVX-512 BF16 processors without AMX; `engine/avx2_prefill_attention.cpp` on AVX2 ones) on the
same prefill and mixed calls, and torch's own `scaled_dot_product_attention` on the same prefill
(causal, grouped heads). Then decode steps as a served step meets them (batch 1, 4 and 8 over
`SERVED_CONTEXT` tokens, one query a sequence, and four as speculative decoding's verification of
three drafted tokens has), vLLM's kernel and llmopt's (which takes them): once with
every call against its own layer's cache of `LAYERS` (as in the engine, where the weights streamed
between two layers push the KV cache out of the processor's caches: the working set is the whole
cache) and once with all of them against one layer's (hot in the caches), in ms a step and GB/s of
the cache read.

    .venv/bin/python benchmarks/cpu_attention.py [RESULTS]   (default results/cpu_attention.json)
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import vllm._custom_ops as ops

from llmopt.engine import kernels, platform

RESULTS = Path(__file__).parent / "results" / "cpu_attention.json"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 128
DECODES, CONTEXT, PROMPTS = 7, 800, (256, 700, 1000)
LAYERS, ROUNDS, CALLS = 30, 3, 40
SERVED_CONTEXT, SERVED_BATCHES = 700, (1, 4, 8)  # about the built-in QA set's prompts
SERVED_QUERIES = (1, 4)  # a decode; one verifying 3 drafted tokens (llmopt's default n-gram k)


def attention_call(requests: list[tuple[int, int]], key_cache: torch.Tensor, value_cache: torch.Tensor,
                   isa: str, kernel: Callable[..., None]) -> Callable[[], None]:
    """One attention call over `requests`, each (query tokens, sequence length), causal."""
    starts = [0]
    for queries, _ in requests:
        starts.append(starts[-1] + queries)
    seq_lens = torch.tensor([length for _, length in requests], dtype=torch.int32)
    query_start = torch.tensor(starts, dtype=torch.int32)
    blocks = [-(-length // BLOCK) for _, length in requests]
    table = torch.zeros(len(requests), max(blocks), dtype=torch.int32)
    first = 0
    for row, count in enumerate(blocks):
        table[row, :count] = torch.arange(first, first + count)
        first += count
    query = torch.randn(starts[-1], HEADS, HEAD_DIM, dtype=key_cache.dtype)
    out = torch.empty_like(query)
    plan = ops.cpu_attn_get_scheduler_metadata(len(requests), HEADS, KV_HEADS, HEAD_DIM, seq_lens, key_cache.dtype,
                                               query_start, True, -1, isa, True)
    return lambda: kernel(query, key_cache, value_cache, out, query_start, seq_lens, HEAD_DIM ** -0.5, True, None, -1,
                          table, 0.0, plan, None, None, 1.0, 1.0, "auto")


def milliseconds(call: Callable[[], None]) -> float:
    for _ in range(5):
        call()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    return (time.perf_counter() - start) / CALLS * 1e3


def sdpa_call(tokens: int, dtype: torch.dtype) -> Callable[[], None]:
    """torch's fused attention over one prompt, its KV heads shared by the query heads as vLLM's are."""
    query = torch.randn(1, HEADS, tokens, HEAD_DIM, dtype=dtype)
    key, value = (torch.randn(1, KV_HEADS, tokens, HEAD_DIM, dtype=dtype) for _ in range(2))
    return lambda: torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)


def prefill_flops(tokens: int) -> float:
    """QK^T and PV over the causal triangle, every query head."""
    return 2 * 2 * (tokens * (tokens + 1) / 2) * HEAD_DIM * HEADS


def served_decodes(dtype: torch.dtype, isa: str, ours: bool) -> list[dict]:
    """A decode step's attention over all `LAYERS`, each layer's cache its own (cold) or all one
    (hot), by vLLM's kernel and, with `ours`, by llmopt's."""
    rows = []
    blocks = -(-SERVED_CONTEXT // BLOCK)
    for batch in SERVED_BATCHES:
        layers = [torch.randn(batch * blocks, KV_HEADS, BLOCK * 2, HEAD_DIM, dtype=dtype).chunk(2, dim=2) for _ in range(LAYERS)]
        kernels_used = {"": torch.ops._C.cpu_attention_with_kv_cache} | ({"llmopt ": torch.ops.llmopt.prefill_attention} if ours else {})
        for queries in SERVED_QUERIES:
            calls = {}
            for name, kernel in kernels_used.items():
                calls[f"{name}cold"] = [attention_call([(queries, SERVED_CONTEXT)] * batch, k, v, isa, kernel) for k, v in layers]
                calls[f"{name}hot"] = calls[f"{name}cold"][:1] * LAYERS
            read = LAYERS * batch * SERVED_CONTEXT * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
            ms = {name: sorted(milliseconds(lambda: [call() for call in step]) for _ in range(ROUNDS))[ROUNDS // 2]
                  for name, step in calls.items()}
            rows.append({"batch": batch, "queries": queries, "context": SERVED_CONTEXT, "cache_read_mb": round(read / 1e6, 1)}
                        | {f"{name.replace(' ', '_')}_ms_a_step": round(t, 2) for name, t in ms.items()}
                        | {f"{name.replace(' ', '_')}_gb_s": round(read / t / 1e6, 1) for name, t in ms.items()})
    return rows


def main() -> None:
    torch.manual_seed(0)
    isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    hw = platform.detect()
    ours = platform.prefill_attention_applies(hw)
    if ours:
        kernels.load(kernels.build(platform.kernel_library(hw)))
    dtype = getattr(torch, platform.default_dtype(hw))
    cache = torch.randn(-(-DECODES * CONTEXT // BLOCK) + 16, KV_HEADS, BLOCK * 2, HEAD_DIM, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    decodes = [(1, CONTEXT)] * DECODES
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for prompt in PROMPTS:
            cases = {"decodes": decodes, "prefill": [(prompt, prompt)], "mixed": decodes + [(prompt, prompt)]}
            calls = {name: attention_call(reqs, key_cache, value_cache, isa, torch.ops._C.cpu_attention_with_kv_cache)
                     for name, reqs in cases.items()}
            if ours:
                calls |= {f"llmopt {name}": attention_call(cases[name], key_cache, value_cache, isa,
                                                           torch.ops.llmopt.prefill_attention) for name in ("prefill", "mixed")}
            calls["sdpa"] = sdpa_call(prompt, dtype)
            runs = {name: sorted(milliseconds(call) for _ in range(ROUNDS)) for name, call in calls.items()}
            ms = {name: times[ROUNDS // 2] for name, times in runs.items()}
            rows.append({"threads": threads, "prompt": prompt, "decodes_ms": round(ms["decodes"], 3),
                         "prefill_ms": round(ms["prefill"], 3), "mixed_ms": round(ms["mixed"], 3),
                         "mixed_over_parts": round(ms["mixed"] / (ms["decodes"] + ms["prefill"]), 3),
                         "prefill_gflops": round(prefill_flops(prompt) / ms["prefill"] / 1e6, 1),
                         "prefill_ms_all_layers": round(ms["prefill"] * LAYERS, 1),
                         "sdpa_prefill_ms": round(ms["sdpa"], 3), "sdpa_gflops": round(prefill_flops(prompt) / ms["sdpa"] / 1e6, 1)}
                        | ({"llmopt_prefill_ms": round(ms["llmopt prefill"], 3),
                            "llmopt_prefill_gflops": round(prefill_flops(prompt) / ms["llmopt prefill"] / 1e6, 1),
                            "llmopt_mixed_ms": round(ms["llmopt mixed"], 3)} if ours else {}))
    print(f"{'threads':>7} {'prompt':>6} {'decodes ms':>10} {'prefill ms':>10} {'mixed ms':>9} {'mixed/parts':>11} "
          f"{'prefill GFLOP/s':>15} {'prefill, 30 layers':>18} {'torch SDPA ms':>13} {'GFLOP/s':>8} {'llmopt prefill':>14} "
          f"{'GFLOP/s':>8} {'llmopt mixed':>12}")
    for row in rows:
        print(f"{row['threads']:>7} {row['prompt']:>6} {row['decodes_ms']:>10} {row['prefill_ms']:>10} "
              f"{row['mixed_ms']:>9} {row['mixed_over_parts']:>11} {row['prefill_gflops']:>15} "
              f"{row['prefill_ms_all_layers']:>15} ms {row['sdpa_prefill_ms']:>13} {row['sdpa_gflops']:>8} "
              f"{row.get('llmopt_prefill_ms', '-'):>14} {row.get('llmopt_prefill_gflops', '-'):>8} {row.get('llmopt_mixed_ms', '-'):>12}")
    torch.set_num_threads(2)  # as the engine runs on these 2-core machines
    served = served_decodes(dtype, isa, ours)
    print(f"\ndecode steps over {SERVED_CONTEXT} tokens, {LAYERS} layers, 2 threads, ms a step (GB/s of the cache):")
    kinds = [key[:-len("_ms_a_step")] for key in served[0] if key.endswith("_ms_a_step")]
    print(f"{'batch':>5} {'queries':>7} {'cache MB':>8}" + "".join(f"{kind:>20}" for kind in kinds))
    for row in served:
        print(f"{row['batch']:>5} {row['queries']:>7} {row['cache_read_mb']:>8}"
              + "".join(f"{row[kind + '_ms_a_step']:>12} ({row[kind + '_gb_s']:>5})" for kind in kinds))
    results = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS
    results.write_text(json.dumps({"processor": hw.cpu_label, "cores": hw.cores, "isa": isa, "dtype": str(dtype),
                                   "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK,
                                              "decodes": DECODES, "context": CONTEXT},
                                   "median_of": ROUNDS, "rows": rows, "served_decodes": served}, indent=1) + "\n")
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
