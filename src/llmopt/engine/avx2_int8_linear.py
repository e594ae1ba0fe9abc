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

from llmopt.engine import kernels

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


def use(path: str | Path) -> None:
    """Have vLLM's int8 layers run this kernel in this process, where their activations are
    quantized per row and symmetrically (SmoothQuant's dynamic scheme) and their input width is even;
    other int8 layers keep vLLM's oneDNN. Set before the model loads."""
    import torch
    from vllm.logger import init_logger
    from vllm.model_executor.kernels.linear.scaled_mm import cpu
    from vllm.model_executor.layers.quantization.utils import replace_parameter
    from vllm.model_executor.layers.quantization.utils.w8a8_utils import convert_to_channelwise

    kernels.load(path)
    logger = init_logger("vllm.llmopt")
    kernel = cpu.CPUInt8ScaledMMLinearKernel
    vllms_process, vllms_apply = kernel.process_weights_after_loading, kernel.apply_weights

    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        w_q_name, w_s_name = self.layer_param_names[:2]
        weight = getattr(layer, w_q_name)
        self.avx2_int8 = (self.config.input_symmetric and not self.config.is_static_input_scheme
                          and weight.shape[1] % 2 == 0)
        if not self.avx2_int8:
            vllms_process(self, layer)
            return
        # in vLLM's words for its kernel choice, after vLLM's own line: a job's measurement records it
        logger.info_once("llmopt: int8 layers: Using %s for %s", KERNEL, type(getattr(layer, "scheme", self)).__name__)
        weight_scale = getattr(layer, w_s_name)
        if not self.config.is_channelwise:  # a scale per tensor (per part of a fused one): one per output channel
            weight_scale = convert_to_channelwise(weight_scale, layer.logical_widths)
        self.avx2_int8_channels = weight.shape[0]
        replace_parameter(layer, w_q_name, torch.nn.Parameter(pack(weight.data), requires_grad=False))
        replace_parameter(layer, w_s_name, torch.nn.Parameter(padded(weight_scale.data), requires_grad=False))
        if getattr(layer, "bias", None) is not None:
            layer.avx2_int8_bias = torch.nn.Parameter(padded(layer.bias.data), requires_grad=False)

    def apply_weights(self: Any, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.avx2_int8:
            return vllms_apply(self, layer, x, bias)
        w_q_name, w_s_name = self.layer_param_names[:2]
        n = self.avx2_int8_channels
        rows = x.reshape(-1, x.shape[-1]).float()
        if bias is not None:
            bias = layer.avx2_int8_bias if bias is getattr(layer, "bias", None) else padded(bias)
        out = torch.ops.llmopt.avx2_int8_linear(rows, getattr(layer, w_q_name), getattr(layer, w_s_name), bias, n)
        return out.to(x.dtype).reshape(*x.shape[:-1], n)

    kernel.process_weights_after_loading = process_weights_after_loading
    kernel.apply_weights = apply_weights
