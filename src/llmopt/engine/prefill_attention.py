"""llmopt's prefill attention kernels: causal attention over vLLM's paged KV cache, called where
vLLM's CPU attention backend calls its kernel, on processors without AMX: prompts (sequences of 16
queries or more) in query tiles, decodes (fewer: one query, or one with the tokens speculative
decoding has it verify, or a prompt or chunk that short) in decode tiles, in any mix; anything a
kernel does not do goes to vLLM's kernel. There are two, one per kernel library (`kernels`), registered as the same op with what
they share in `prefill_attention.h` (the op, which calls are theirs, which of a step's sequences
take the decode tiles, and how a step's tiles are shared among threads):

- `prefill_attention.cpp`, bf16 with AVX-512 BF16 dot products. Without AMX vLLM's kernel computes
  attention at the processor's fp32 rate: on the project's Zen 5 EPYC a quarter of bf16's
  884-token prefill of SmolLM2-135M, a third of SmoothQuant's (`benchmarks/step_profile.py`). This
  one runs the same prefill's attention about twice as fast (`benchmarks/cpu_attention.py`). Its
  probabilities are rounded to bf16 before they multiply the values, as vLLM's AMX path rounds
  them, so its outputs are not vLLM's `vec` path's bits: against attention computed in float64
  they are no further off than vLLM's at their largest, 1.3-1.6x on average. Keeping P's rounding
  error out (P in two bf16 parts) cost a third of the gain and moved no perplexity measurably
  (benchmarks/README.md, "prefill_attention.py"). Decodes (in any step, with their speculated
  tokens' queries as more rows) read the cache in place, in fp32 from exact widenings of its bf16: a
  served step meets that cache cold, and vLLM's kernel read it at 12.5-13 GB/s on Zen 4 at batch 4
  and 8 over 700 tokens, this one at 20 (the next block fetched ahead while one is summed),
  1.55-1.58x; 1.09x output tokens/s served at batch 8 on 700-token prompts (`benchmarks/README.md`,
  "cpu_attention.py").
- `avx2_prefill_attention.cpp`, float32 with AVX2 FMA, on x86 without AVX-512 (served in float32):
  there vLLM's `vec` path spent a quarter of the same prefill at about 54 GFLOP/s, against 133 for
  the linear layers beside it (Zen 3, `step_profile.py`). It reads the cache in place and rounds
  nothing below float32. It takes decodes as well: there vLLM's kernel read the cold cache
  at 7-9 GB/s, under half of what the linear layers stream, and at 700 tokens of context took 4.5 ms
  of a batch-1 step and 30 of a batch-8 one (`benchmarks/cpu_attention.py`).

Every build passes `compare` before it is kept. It is `EngineConfig.attention_kernel` 'llmopt', the
default where it applies and llmopt's kernel library is built.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from llmopt.engine import kernels

if TYPE_CHECKING:
    import torch

ENV = "LLMOPT_PREFILL_ATTENTION"  # "1": the engine core's attention layers call it
BLOCK = 128  # vLLM's CPU block size
MIN_QUERIES = kernels.ATTENTION_MIN_QUERIES  # a sequence of this many queries takes the query tiles, fewer the decode tiles
# In the engine's log where it applies, at the first call of each size (by the step's tokens)
PROMPTS_LINE = f"llmopt: its attention kernel for steps of {MIN_QUERIES} tokens or more"
DECODES_LINE = f"llmopt: its attention kernel for steps of fewer than {MIN_QUERIES} tokens"
# Shapes a new build is checked on: SmolLM2-135M's heads, and at head size 128 (three KV heads: on
# two threads a lone decode's context is cut in parts), Qwen2.5-Coder-0.5B's and -1.5B's, and
# groups of 2, 1 and 3 query heads a KV head (every row count of the bf16 decode tile); each
# with (queries, sequence length) per request: a prompt, a prompt after a cached prefix, prompts
# beside decodes (mixed steps: the decodes take the decode tiles, one alone cut in parts), short
# ones; decodes alone, one decode (its context cut in parts where the KV heads do not share out
# evenly among the threads), one over a single block, 16 decodes; decodes with speculated tokens to
# verify (beside plain ones and a prompt; alone, cut in parts, the first rows seeing none of the last
# part's keys); and two 15-token chunks (the decode tiles' most rows).
CHECKED_HEADS = ((9, 3, 64), (9, 3, 128), (14, 2, 64), (12, 2, 128), (4, 2, 64), (4, 4, 64), (6, 2, 128))
CHECKED_REQUESTS = (((300, 300),), ((200, 700),), ((1, 500), (1, 90), (40, 40)), ((1, 1000), (20, 300), (1, 129)),
                    ((20, 300), (1, 900)), ((16, 16), (3, 130), (17, 33)), ((1, 800), (1, 129)), ((1, 1000),),
                    ((1, 100),), ((1, 200),) * 16, ((4, 700), (1, 300), (4, 129), (2, 40)),
                    ((4, 500), (1, 200), (40, 40)), ((4, 129),), ((3, 1000),), ((15, 100), (15, 300)))
# Decodes whose first block's keys are `SPREAD` times the rest's, so that their scores span about
# a hundred (alone, beside a prompt, verifying drafted tokens): a softmax that does not shift by a
# row's largest score overflows there.
WIDE_SCORES = (((1, 700),), ((1, 300), (1, 900)), ((1, 700), (20, 300)), ((4, 700), (1, 300)))
SPREAD = 40.0
# What it does not do, on a prompt: handed to vLLM's kernel with vLLM's bits out.
HANDED_OVER = ({"sliding_window": 64}, {"softcap": 30.0})


def use(path: str | Path) -> None:
    """Have vLLM's CPU attention call `torch.ops.llmopt.prefill_attention` in this process: it
    takes vLLM's arguments and hands vLLM's kernel every call it does not run itself."""
    import torch
    from vllm.logger import init_logger

    if torch.cpu._is_amx_tile_supported():  # vLLM's cache is then laid out for its AMX kernel
        init_logger("vllm.llmopt").warning("llmopt: its prefill attention is for processors without AMX; "
                                           "vLLM's attention stays")
        return
    _install(path)


def _install(path: str | Path) -> None:
    """The call `use` installs, on any processor: `compare` checks a build with it on AMX ones too,
    against vLLM's `vec` path, whose cache layout the kernel reads."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.logger import init_logger

    logger = init_logger("vllm.llmopt")
    kernels.load(path)
    op = torch.ops.llmopt.prefill_attention.default

    def attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, output: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, causal: bool,
                  alibi_slopes: torch.Tensor | None, sliding_window: int, block_table: torch.Tensor, softcap: float,
                  scheduler_metadata: torch.Tensor, s_aux: torch.Tensor | None,
                  dynamic_causal: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                  kv_cache_dtype: str = "auto") -> None:
        logger.info_once(PROMPTS_LINE if query.size(0) >= MIN_QUERIES else DECODES_LINE)  # by the model's process
        op(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal, alibi_slopes, sliding_window,
           block_table, softcap, scheduler_metadata, s_aux, dynamic_causal, k_scale, v_scale, kv_cache_dtype)

    attention.llmopt_prefill_attention = True  # type: ignore[attr-defined]  # so `attention_calls` calls it
    ops.cpu_attention_with_kv_cache = attention  # looked up by name at every call


def _disagrees(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor, spread: float, exact_p: bool,
               wide: bool) -> str | None:
    """What is off, if the kernel's outputs are further from the `exact` ones than vLLM's beyond what
    neither controls. At the largest: 1.5x vLLM's where P is exact (float32: the largest errors of
    either are single roundings that fall where they fall), 2x where it is rounded to bf16 (1.6x the
    most seen over four draws of every case); and on top, two float32 roundings of the outputs'
    scale and one of the largest score (of size `spread`: it moves every exponential by about
    spread x eps, and each kernel sums its scores in its own order; with scores spanning about a
    hundred that is 1e-5). On average: 2x vLLM's (bf16: 1.3-1.6x); with such scores 4x, plus the
    same roundings (whose order moves every output: the AVX2 kernel's mean read 5x vLLM's on one
    decode at head size 128, 2.6e-7 of the outputs' scale)."""
    import torch

    ours_error, theirs_error = (ours - exact).abs(), (theirs - exact).abs()
    rounding = (2 + spread) * torch.finfo(torch.float32).eps * exact.abs().max().item()
    largest = (1.5 if exact_p else 2.0) * theirs_error.max().item() + rounding
    if not ours_error.max().item() <= largest:  # NaN fails too
        return f"largest error {ours_error.max().item():.3g}, allowed {largest:.3g}"
    mean = 4.0 * theirs_error.mean().item() + rounding if wide else 2.0 * theirs_error.mean().item()
    if not ours_error.mean().item() <= mean:
        return f"mean error {ours_error.mean().item():.3g}, allowed {mean:.3g}"
    return None


def _exact(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
           starts: list[int], lengths: list[int], scale: float) -> tuple[torch.Tensor, float]:
    """Causal attention in float64 over the cache as vLLM's `vec` path lays it out (keys transposed
    per block and KV head), and the largest score's size."""
    import torch

    heads, size = query.shape[1], query.shape[2]
    kv_heads, block = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    spread = 0.0
    for s, length in enumerate(lengths):
        blocks = table[s, :-(-length // block)].tolist()
        keys = torch.cat([key_cache[b].reshape(kv_heads, size, block).transpose(1, 2) for b in blocks], 1)[:, :length]
        values = torch.cat([value_cache[b] for b in blocks], 1)[:, :length]
        group = heads // kv_heads
        keys, values = (t.double().repeat_interleave(group, 0) for t in (keys, values))
        q = query[starts[s]:starts[s + 1]].double().transpose(0, 1)
        scores = q @ keys.transpose(1, 2) * scale
        spread = max(spread, scores.abs().max().item())
        positions = torch.arange(length - q.shape[1], length)[:, None]
        scores = scores.masked_fill(torch.arange(length)[None, :] > positions, float("-inf"))
        out[starts[s]:starts[s + 1]] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out, spread


def compare(path: str | Path, vllms: Callable[..., None]) -> int:
    """The calls checked against vLLM's kernel `vllms` and against attention in float64, with the
    library at `path` loaded: every `CHECKED_HEADS` with every `CHECKED_REQUESTS` and `WIDE_SCORES`,
    the query a strided slice of a fused QKV, blocks in shuffled order, in the library's dtype
    (bf16; float32 for the AVX2 library's), each case on data of its own. Its outputs no further
    from the exact ones than vLLM's beyond what neither controls (`_disagrees`; NaN where a softmax
    overflows); `HANDED_OVER`, vLLM's own bits. Raises AssertionError on the first that fails."""
    import torch
    from vllm import _custom_ops as ops

    _install(path)
    dtype = torch.float32 if kernels.library_of(path) is kernels.AVX2 else torch.bfloat16
    exact_p = dtype == torch.float32  # the bf16 kernel rounds P to bf16
    isa = "vec"  # the layout the kernel reads; vLLM's AMX path (bf16 only) lays its cache out otherwise
    checked = 0
    for heads, kv_heads, head_size in CHECKED_HEADS:
        for requests in CHECKED_REQUESTS + WIDE_SCORES:
            # each case's own data: a case added does not change the others'
            generator = torch.Generator().manual_seed(zlib.crc32(repr((heads, kv_heads, head_size, requests)).encode()))
            starts = [0]
            for queries, _ in requests:
                starts.append(starts[-1] + queries)
            lengths = [length for _, length in requests]
            counts = [-(-length // BLOCK) for length in lengths]
            cache = torch.randn(sum(counts) + 2, kv_heads, 2 * BLOCK, head_size, dtype=dtype, generator=generator)
            key_cache, value_cache = cache.chunk(2, dim=2)
            order = torch.randperm(cache.size(0), generator=generator).int()
            table = torch.zeros(len(requests), max(counts) + 1, dtype=torch.int32)
            for row, count in enumerate(counts):
                table[row, :count] = order[sum(counts[:row]):sum(counts[:row]) + count]
            if requests in WIDE_SCORES:
                key_cache[table[0, 0]] *= SPREAD
            seq_lens = torch.tensor(lengths, dtype=torch.int32)
            query_start = torch.tensor(starts, dtype=torch.int32)
            fused = torch.randn(starts[-1], (heads + 2 * kv_heads) * head_size, dtype=dtype, generator=generator)
            query = fused[:, :heads * head_size].view(-1, heads, head_size)
            arguments = {"scale": head_size ** -0.5, "causal": True, "alibi_slopes": None, "sliding_window": -1,
                         "softcap": 0.0, "s_aux": None}
            variants = [{}, *HANDED_OVER] if requests == CHECKED_REQUESTS[0] else [{}]
            for variant in variants:
                given = arguments | variant
                plan = ops.cpu_attn_get_scheduler_metadata(len(requests), heads, kv_heads, head_size, seq_lens, dtype,
                                                           query_start, given["causal"], given["sliding_window"], isa, True)
                outputs = []
                for call in (vllms, ops.cpu_attention_with_kv_cache):
                    out = torch.zeros(starts[-1], heads, head_size, dtype=dtype)
                    call(query=query, key_cache=key_cache, value_cache=value_cache, output=out,
                         query_start_loc=query_start, seq_lens=seq_lens, block_table=table, scheduler_metadata=plan,
                         **given)
                    outputs.append(out.double())
                theirs, ours = outputs
                shape = (heads, kv_heads, head_size, requests, variant)
                if variant:
                    assert torch.equal(theirs, ours), shape
                else:
                    exact, spread = _exact(query, key_cache, value_cache, table, starts, lengths, arguments["scale"])
                    failed = _disagrees(ours, theirs, exact, spread, exact_p, requests in WIDE_SCORES)
                    assert not failed, (shape, failed)
                checked += 1
    return checked
