"""llmopt's small-batch W8A8 linear kernel (`small_batch_int8_linear.cpp`): in the same library as
the bf16 one (`kernels`), called where vLLM calls its packed int8 kernel (SmoothQuant's layers, an
INT8 `lm_head`) on AVX-512 VNNI processors without AMX, whenever llmopt's bf16 kernel is on
(`EngineConfig.linear_kernels` 'llmopt').

vLLM's int8 kernel multiplies 4 rows at a time, so 8 rows read each block of weights twice: on the
project's Zen 4 EPYC it streamed 16-23 GB/s at 8 rows against 21-29 at one. Here up to 8 rows share
each weight load, from 5 rows to 32 (fewer or more go to vLLM's); the outputs are vLLM's bits
(`compare`; speed: `benchmarks/linear_kernels.py`).
"""

from __future__ import annotations

from pathlib import Path

from llmopt.engine import kernels

MIN_ROWS, MAX_ROWS = kernels.INT8_MIN_ROWS, kernels.INT8_MAX_ROWS
# Products a new build must give vLLM's bits for before it is kept: SmolLM2's and Qwen2.5's layer
# shapes, one block of 32 channels; every row count, so every tile height after whole tiles of 8,
# and the hand-overs to vLLM's kernel on both sides.
CHECKED_SHAPES = ((576, 576), (960, 576), (576, 1536), (3072, 576), (1152, 896), (32, 64))
CHECKED_ROWS = tuple(range(1, MAX_ROWS + 2))


def use(path: str | Path) -> None:
    """Have vLLM's packed int8 layers call `torch.ops.llmopt.small_batch_int8_linear` in this
    process: set before the model loads, which is when vLLM binds each layer's method."""
    import torch
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    kernels.load(path)

    def packed_int8_linear(self: object, layer: torch.nn.Module, x: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
        w_q, w_s, _, _, _ = self._get_layer_params(layer)  # type: ignore[attr-defined]
        return torch.ops.llmopt.small_batch_int8_linear(x, w_q, w_s, layer.bias_fp32 if bias is not None else None)

    cpu.CPUInt8ScaledMMLinearKernel._apply_weights_sgl = packed_int8_linear


def used() -> bool:
    """Whether vLLM's packed int8 layers call llmopt's kernel in this process (`use` has run)."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    return cpu.CPUInt8ScaledMMLinearKernel._apply_weights_sgl.__module__ == __name__


def compare(path: str | Path) -> int:
    """The products checked against vLLM's packed int8 kernel with the library at `path` loaded:
    every `CHECKED_SHAPES` with and without a bias at every `CHECKED_ROWS`, and rows strided as a
    slice of a wider input. Raises AssertionError on the first that differs."""
    import torch

    kernels.load(path)
    generator = torch.Generator().manual_seed(0)
    ours = torch.ops.llmopt.small_batch_int8_linear

    def vllms(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops._C.int8_scaled_mm_with_quant(x, packed, scales, bias, x.dtype, True)  # strided rows too

    checked = 0
    for n, k in CHECKED_SHAPES:
        packed = torch.ops._C.convert_weight_packed(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator))
        scales = torch.rand(n, generator=generator) / 100
        for bias in (None, torch.randn(n, generator=generator)):
            for m in CHECKED_ROWS:
                x = torch.randn(m, k, dtype=torch.bfloat16, generator=generator) * 4
                assert torch.equal(vllms(x, packed, scales, bias), ours(x, packed, scales, bias)), (n, k, m)
                checked += 1
        wide = torch.randn(8, k + 64, dtype=torch.bfloat16, generator=generator)[:, :k]
        assert torch.equal(vllms(wide, packed, scales, None), ours(wide, packed, scales, None)), (n, k)
    return checked
