"""vLLM's CPU attention layer calls, without most of their Python: the same kernels, called with the
same arguments, so the outputs are vLLM's bits.

Each attention layer of a decode step goes through two of vLLM's custom ops, the KV-cache write and
the attention. On SmolLM2-135M they took 10.5 and 14.4 us a layer from the compiled graph, of which
the kernels themselves 3.4 and 5.0 us: the rest is Python around them, mostly in the backend's
methods, which view the layer's cache as keys and values anew at every call, slice the query and
the output, and pass 18 arguments by keyword through two wrappers (`benchmarks/attention_calls.py`).
Here the backend's two methods keep each layer's key and value views while its cache is the same
tensor, and call the kernels' ops directly with positional arguments; llmopt's prefill attention
(`prefill_attention.use`), where it runs, is still the kernel for prompts and decodes.

Whatever the lean methods do not cover goes to vLLM's own: no attention metadata (a warm-up),
fused output quantization, encoder attention, and attention sinks not yet cast. The views hold the
cache's storage until the layer's cache changes, which vLLM's CPU path (no sleep mode) never asks
to free. With `LLMOPT_VLLM_ATTENTION_CALLS=1` (`platform.VLLM_ATTENTION_CALLS_ENV`) the engine keeps
vLLM's methods, to measure the difference.
"""

from __future__ import annotations

from typing import Any

LINE = "llmopt: vLLM's CPU attention layers called through its lean methods"  # the engine's log says it once


def use() -> None:
    """Give vLLM's CPU attention backend the lean methods in this process (the engine core's, or a
    benchmark's that runs vLLM's offline API); on a vLLM without that backend or its CPU kernels (a
    GPU build, which keeps the module but not the ops), nothing changes."""
    import torch

    try:
        from vllm import _custom_ops as ops
        from vllm.logger import init_logger
        from vllm.v1.attention.backend import AttentionType
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl
    except ImportError:
        return
    if getattr(Impl, "llmopt_vllm_methods", None) or not all(
            hasattr(torch.ops._C, name) for name in ("cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache")):
        return
    forward, update = Impl.forward, Impl.do_kv_cache_update
    write = torch.ops._C.cpu_attn_reshape_and_cache.default
    vllms = torch.ops._C.cpu_attention_with_kv_cache.default
    kept_dtypes = (torch.bfloat16, torch.float32)
    logger = init_logger("vllm.llmopt")
    said = False

    def halves(impl: Any, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache as keys and values, as vLLM's methods view it, kept while it is the same tensor."""
        kept = impl.__dict__.get("_llmopt_halves")
        if kept is None or kept[0] is not kv_cache:
            blocks, kv_heads, block_size, _ = kv_cache.size()
            kept = (kv_cache, *kv_cache.view(blocks, kv_heads, block_size * 2, -1).chunk(2, dim=2))
            impl._llmopt_halves = kept
        return kept[1], kept[2]

    def do_kv_cache_update(self: Any, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if self.attn_type != AttentionType.DECODER:
            return update(self, layer, key, value, kv_cache, slot_mapping)
        key_cache, value_cache = halves(self, kv_cache)
        write(key, value, key_cache, value_cache, slot_mapping, layer.isa, layer._k_scale_float, layer._v_scale_float,
              self.kv_cache_dtype)

    def lean_forward(self: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                     output_scale: torch.Tensor | None = None,
                     output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        nonlocal said
        if (output_scale is not None or output_block_scale is not None or self.attn_type != AttentionType.DECODER
                or (self.sinks is not None and self.sinks.dtype not in kept_dtypes)):
            return forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                           output_block_scale)
        if attn_metadata is None:  # a warm-up
            return output
        if not said:  # by the process that runs the model
            said = True
            logger.info(LINE)
        key_cache, value_cache = halves(self, kv_cache)
        tokens = attn_metadata.num_actual_tokens
        out = output
        if query.size(0) != tokens:
            query, out = query[:tokens], output[:tokens]
        kernel = ops.cpu_attention_with_kv_cache  # llmopt's prefill attention, where it is installed
        if not getattr(kernel, "llmopt_prefill_attention", False):
            kernel = vllms
        kernel(query, key_cache, value_cache, out, attn_metadata.query_start_loc, attn_metadata.seq_lens, self.scale,
               attn_metadata.causal, self.alibi_slopes, self.sliding_window, attn_metadata.block_table,
               self.logits_soft_cap, attn_metadata.scheduler_metadata, self.sinks, attn_metadata.dynamic_causal,
               layer._k_scale_float, layer._v_scale_float, self.kv_cache_dtype)
        return output

    Impl.llmopt_vllm_methods = (forward, update)  # vLLM's, for a side-by-side measure
    Impl.forward, Impl.do_kv_cache_update = lean_forward, do_kv_cache_update
