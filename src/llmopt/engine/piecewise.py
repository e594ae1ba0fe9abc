"""vLLM's piecewise compilation kept on a CPU, where its CPU platform would trace the whole graph.

vLLM's CPU platform turns its piecewise compilation (`VLLM_COMPILE`: the graph split at the
attention ops, each piece compiled by vLLM's backend, pieces alike compiled once) into one trace of
the whole graph (`DYNAMO_TRACE_ONCE`), which Inductor then lowers and compiles layer by layer: a
cold compile of SmolLM2-135M took 112 s on a Zen 3 EPYC, 52 s piecewise (three compiled pieces for
the 31), whose steps are longer served (`platform.default_compiled_graph`). Used by llmopt's server
module where the settings ask for pieces (`serve.compiled_graph_from_environment`) and by
`benchmarks/piecewise_compile.py` on plain vLLM.
"""

from __future__ import annotations

from typing import Any

# where a piecewise graph is split: the attention and its KV-cache write, vLLM's ops that write into
# tensors they are given (the CPU's attention backend takes the write as an op of its own)
SPLITS = ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update")


def use() -> None:
    """Keep piecewise compilation in this process where vLLM's CPU platform made its change, with
    what vLLM's CPU path lacks for it: `compile_sizes` set (the piecewise backend finds a step's
    shape among them) and vLLM's fix-functionalization pass left out (it names CUDA-only fused ops;
    Inductor's own decomposition does its work, as it does for the whole graph)."""
    import vllm.platforms.cpu as cpu
    from torch._inductor import cpu_vec_isa
    from vllm.compilation.passes.utility import fix_functionalization
    from vllm.config import CompilationMode

    chosen = cpu.CpuPlatform.check_and_update_config.__func__

    def piecewise(cls: type, vllm_config: Any) -> None:
        asked = vllm_config.compilation_config.mode
        chosen(cls, vllm_config)
        config = vllm_config.compilation_config
        if asked == CompilationMode.VLLM_COMPILE and config.mode == CompilationMode.DYNAMO_TRACE_ONCE:
            config.mode, config.compile_sizes = CompilationMode.VLLM_COMPILE, []
            config.splitting_ops = list(SPLITS)

    cpu.CpuPlatform.check_and_update_config = classmethod(piecewise)
    fix_functionalization.FixFunctionalizationPass.__call__ = lambda self, graph: None
    # vLLM loads a saved model's pieces on a pool of threads, and the first C++ each loads asks
    # Inductor which instruction set this processor has. Inductor's AVX-512 check appends
    # -mavx512bf16 to the instruction set's shared flags while it builds its probe and restores
    # what it saved after: two checks at once, and the second restores the first's flag for good.
    # Libraries were then named by another compile command, missed and compiled again: one
    # precompiled start in eight "partly compiled" on a Zen 4 EPYC. Asked here, once, before any
    # pool, the answer is kept for the process and for an engine core forked from it.
    cpu_vec_isa.pick_vec_isa()
