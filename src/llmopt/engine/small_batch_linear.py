"""llmopt's small-batch bf16 linear kernel (`small_batch_linear.cpp`): built once per environment
with the machine's C++ compiler against the installed torch, loaded into the engine core, and
called where vLLM calls its packed-weight kernel, on AVX-512 BF16 processors: up to 64 rows
without AMX; with AMX up to 4 (`kernels.AMX`), since vLLM's kernel multiplies 5 rows or more on
AMX tiles, and stays for them, except in the layers vLLM gives oneDNN, which keep oneDNN above 4
rows (`use_onednn_above`).

Without AMX, vLLM's packed kernel multiplies 5 rows or more through torch's brgemm at about the
fp32 rate (125 GFLOP/s on the project's AMD EPYC against 400 for a large bf16 product), so a
batch-8 decode step spent 17 of its 27 ms in its linear layers (`benchmarks/step_profile.py`).
This kernel shares each weight load among up to 8 rows, with AVX-512 BF16 dot products, and
gives the same bits as vLLM's (`compare`; speed: `benchmarks/linear_kernels.py`). It is
`EngineConfig.linear_kernels` 'llmopt': the default where it applies and llmopt's kernel library
is built (`kernels`); elsewhere, or without a compiler, vLLM's packed kernel alone (with AMX, vLLM's
own choice).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from llmopt.engine import kernels

ENV = "LLMOPT_SMALL_BATCH_LINEAR"  # "1": the engine core's packed bf16 layers call it
ONEDNN_ABOVE_LINE = "llmopt: bf16 layers vLLM gives oneDNN keep it above the small-batch kernel's rows"
MAX_ROWS = kernels.LINEAR_MAX_ROWS
# Products a new build must give vLLM's bits for before it is kept: SmolLM2's and Qwen's layer
# shapes, a vocabulary-sized one, last blocks of 16 channels; every tile height and the hand-over.
CHECKED_SHAPES = ((576, 576), (960, 576), (576, 1536), (49152, 64), (592, 576), (80, 64))
CHECKED_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 40, MAX_ROWS, MAX_ROWS + 1)


def max_rows(path: str | Path) -> int:
    """The most rows the build at `path` multiplies itself."""
    return kernels.AMX_LINEAR_MAX_ROWS if kernels.library_of(path) is kernels.AMX else MAX_ROWS


def use(path: str | Path) -> None:
    """Have vLLM's packed bf16 layers call `torch.ops.llmopt.small_batch_linear` in this process.
    The op returns its output, where vLLM's writes into one it is given: a cold compile of a bf16
    model takes apart no writing op per linear layer (0.83x the start, `benchmarks/README.md`)."""
    import torch
    from vllm import _custom_ops as ops

    kernels.load(path)

    def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        output = torch.ops.llmopt.small_batch_linear(x.reshape(-1, x.size(-1)), packed_weight, bias, n)
        return output.reshape(*x.shape[0:-1], n)

    ops.weight_packed_linear_cpu = packed_linear  # looked up by name at every call, traced once


def use_onednn_above(vllms_choice: Callable[[int, int, Any], bool]) -> None:
    """With AMX, where `use` is on: a bf16 layer that vLLM's own choice (`vllms_choice`, its
    `check_cpu_sgl_kernel`) gives oneDNN keeps its weights twice, packed for this kernel up to its
    rows and in oneDNN's layout above (`llmopt::small_batch_linear_or_onednn`). With every layer on
    the packed kernels above 4 rows, SmolLM2-135M served the QA set at concurrency 8 at 0.83x vLLM's
    choice (2026-12-03, one deployment each): vLLM's packed kernel took 1.5x oneDNN's time for a
    step's layers at 40 rows, where prefill chunks join decode rows. Kept both ways, it served that
    set at 1.06x vLLM's choice at concurrency 8 and decoded 1.36x faster at batch 1 (medians of two
    rounds, benchmarks/README.md, "engine_cpu_settings.py"). The cost is memory: those layers'
    weights a second time."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.logger import init_logger
    from vllm.model_executor.layers import utils

    logger = init_logger("vllm.llmopt")
    dispatch = utils.dispatch_cpu_unquantized_gemm

    def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, onednn: Any,
               onednn_bias: torch.Tensor | None) -> torch.Tensor:
        output = torch.ops.llmopt.small_batch_linear_or_onednn(x.reshape(-1, x.size(-1)), packed, bias, n,
                                                                onednn.handler_tensor, onednn_bias)
        return output.reshape(*x.shape[0:-1], n)

    def packed_and_onednn(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if (weight.is_meta or weight.ndim != 2 or weight.dtype != torch.bfloat16 or not ops._supports_onednn
                or not utils.check_cpu_sgl_kernel(*weight.shape, weight.dtype)
                or vllms_choice(*weight.shape, weight.dtype)):
            return dispatch(layer, remove_weight)
        logger.info_once(f"{ONEDNN_ABOVE_LINE} (their weights twice)")
        n = weight.size(0)
        onednn = ops.create_onednn_mm(weight.t(), 32)  # vLLM's own call for such a layer
        bias = getattr(layer, "bias", None)
        onednn_bias = None if bias is None else bias.detach().clone()
        packed = torch.ops._C.convert_weight_packed(weight)
        if bias is not None:
            layer.bias.data = bias.to(torch.float32)  # as vLLM's packed kernel takes it
        layer.cpu_linear = lambda x, weight, bias: linear(x, packed, bias, n, onednn, onednn_bias)
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)

    utils.dispatch_cpu_unquantized_gemm = packed_and_onednn  # imported by name where weights are loaded


def compare(path: str | Path, vllms: object) -> int:
    """The products checked against vLLM's packed kernel `vllms` with the library at `path` loaded:
    every `CHECKED_SHAPES` with and without a bias at every `CHECKED_ROWS`, and rows strided as
    a slice of a fused output. Raises AssertionError on the first that differs."""
    import torch
    from vllm import _custom_ops as ops

    use(path)
    rows = max_rows(path)
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for n, k in CHECKED_SHAPES:
        weight = torch.randn(n, k, dtype=torch.bfloat16, generator=generator)
        packed, onednn = torch.ops._C.convert_weight_packed(weight), ops.create_onednn_mm(weight.t(), 32)
        for onednn_bias in (None, torch.randn(n, dtype=torch.bfloat16, generator=generator)):
            bias = None if onednn_bias is None else onednn_bias.float()  # a bf16 layer's, as the packed kernel takes it
            for m in CHECKED_ROWS:
                x = torch.randn(m, k, dtype=torch.bfloat16, generator=generator)
                reference = vllms(x, packed, n, bias)
                assert torch.equal(reference, ops.weight_packed_linear_cpu(x, packed, n, bias)), (n, k, m)
                expected = reference if m <= rows else ops.onednn_mm(onednn, x, onednn_bias)
                got = torch.ops.llmopt.small_batch_linear_or_onednn(x, packed, bias, n, onednn.handler_tensor, onednn_bias)
                assert torch.equal(expected, got), ("or oneDNN", n, k, m)
                checked += 2
        wide = torch.randn(8, k + 64, dtype=torch.bfloat16, generator=generator)[:, :k]
        assert torch.equal(vllms(wide, packed, n, None), ops.weight_packed_linear_cpu(wide, packed, n, None)), (n, k)
    return checked
