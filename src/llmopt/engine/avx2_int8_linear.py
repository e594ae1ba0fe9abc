"""llmopt's W8A8 linear kernel for x86 processors with AVX2 and neither AVX-512 nor VNNI
(`avx2_int8_linear.cpp`, its own library: `kernels.AVX2`), called where vLLM would call oneDNN for
an int8 layer (SmoothQuant's layers, an INT8 `lm_head`) when `EngineConfig.linear_kernels` is
'llmopt' there (the default where the library is built).

vLLM's oneDNN int8 product has no fast path without VNNI (0.3-1.6 GB/s of weights on the project's
Zen 3 EPYC, and its 16-bit sums saturate), and torch's weight-only int8 kernel falls behind float32
from about eight rows. This one widens the weights to 16 bits and multiplies them with the row's
int8 values in exact int32 sums, for every row count; its outputs are `reference`'s bits (`compare`;
speed: `benchmarks/linear_kernels.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmopt.engine import int8_layers, kernels

if TYPE_CHECKING:
    import torch

ENV = "LLMOPT_AVX2_INT8_LINEAR"  # set: the engine core's int8 layers run this kernel
BLOCK = 16  # output channels in one packed block (kBlockN)
KERNEL = "LlmoptAvx2Int8Kernel"  # its name in the engine's log, where vLLM names its kernels
# Shapes a new build must give `reference`'s bits for before it is kept: SmolLM2's and Qwen2.5's
# layers, channels that do not fill a block, an input width past whole vectors (the quantization's
# scalar tail), and row counts across every tile height and chunk.
CHECKED_SHAPES = ((576, 576), (960, 576), (576, 1536), (3072, 576), (1152, 896), (40, 64), (24, 74))
CHECKED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 48, 49, 100)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 weights (K even) in the kernel's layout: blocks of 16 channels, each [K/2][16][2],
    N padded to whole blocks with zero weights."""
    import torch.nn.functional as F

    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, -n % BLOCK))
    return padded.view(-1, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous().view(-1)


def padded(values: torch.Tensor) -> torch.Tensor:
    """A per-channel float32 vector padded to whole blocks, as the kernel reads scales and biases."""
    import torch.nn.functional as F

    return F.pad(values.reshape(-1).float(), (0, -values.numel() % BLOCK)).contiguous()


def reference(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in torch: vLLM's dynamic per-token int8 quantization of the rows,
    exact integer products, then (sum * row scale) * channel scale (+ bias) in float32."""
    import torch

    amax = x.abs().amax(dim=1).clamp(min=1e-7)
    inverse = torch.full_like(amax, 127) / amax  # a true division: `127 / amax` is 127 times a reciprocal
    quantized = torch.round(x * inverse[:, None])
    sums = (quantized.double() @ weight.double().T).float()
    out = sums * (amax / 127)[:, None] * scales.reshape(1, -1).float()
    return out if bias is None else out + bias.float()


def compare(path: str | Path) -> int:
    """The products checked against `reference` with the library at `path` loaded: every
    `CHECKED_SHAPES` with and without a bias at every `CHECKED_ROWS`, and rows strided as a slice
    of a wider input. Raises AssertionError on the first that differs."""
    import torch

    kernels.load(path)
    generator = torch.Generator().manual_seed(0)
    ours = torch.ops.llmopt.avx2_int8_linear
    checked = 0
    for n, k in CHECKED_SHAPES:
        weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
        scales = torch.rand(n, generator=generator) / 100
        packed = pack(weight)
        for bias in (None, torch.randn(n, generator=generator)):
            for m in CHECKED_ROWS:
                x = torch.randn(m, k, generator=generator) * 4
                out = ours(x, packed, padded(scales), None if bias is None else padded(bias), n)
                assert torch.equal(out, reference(x, weight, scales, bias)), (n, k, m)
                checked += 1
        wide = torch.randn(8, k + 64, generator=generator)[:, :k]
        assert torch.equal(ours(wide, packed, padded(scales), None, n), reference(wide, weight, scales, None)), (n, k)
    return checked


def takes(config: Any, weight: torch.Tensor) -> bool:
    """Layers whose activations are quantized per row and symmetrically (SmoothQuant's dynamic
    scheme) and whose input width is even (the kernel reads the weights in pairs)."""
    return config.input_symmetric and not config.is_static_input_scheme and weight.shape[1] % 2 == 0


def _prepare(layer: torch.nn.Module, weight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    if getattr(layer, "bias", None) is not None:
        layer.avx2_int8_bias = torch.nn.Parameter(padded(layer.bias.data), requires_grad=False)
    return pack(weight), padded(scales)


def _apply(layer: torch.nn.Module, rows: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None, channels: int) -> torch.Tensor:
    import torch

    if bias is not None:  # the layer's own was padded at load; another is padded here
        bias = layer.avx2_int8_bias if bias is getattr(layer, "bias", None) else padded(bias)
    return torch.ops.llmopt.avx2_int8_linear(rows.float(), weight, scales, bias, channels)


def use(path: str | Path) -> None:
    """Have vLLM's int8 layers this kernel `takes` run it in this process; other int8 layers keep
    vLLM's oneDNN. Set before the model loads."""
    kernels.load(path)
    int8_layers.replace(int8_layers.Replacement(KERNEL, "int8 layers", takes, _prepare, _apply))
