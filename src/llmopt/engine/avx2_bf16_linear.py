"""llmopt's float32 linear kernel with bf16-held weights for x86 processors with AVX2 and no
AVX-512 (`avx2_bf16_linear.cpp`, in the `kernels.AVX2` library beside the W8A8 one), called where
vLLM would call oneDNN for an unquantized layer (a bf16 model's layers, a quantized one's
`lm_head`) when `EngineConfig.linear_kernels` is 'llmopt' there (the default where the library is
built).

There llmopt serves float32 (`platform.default_dtype`): vLLM upcasts a bf16 checkpoint's weights
and a decode step streams 4 bytes a weight. A weight that bf16 holds exactly (every weight of a
bf16 checkpoint) is packed back to bf16 here and widened in registers, so a step streams half the
bytes; a layer whose weights are not all bf16 values keeps vLLM's oneDNN. The outputs are float32
products of the same weights, summed in another order than oneDNN's: `compare` holds them as
close to float64 as oneDNN's (speed: `benchmarks/linear_kernels.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmopt.engine import kernels

if TYPE_CHECKING:
    import torch

ENV = "LLMOPT_AVX2_BF16_LINEAR"  # set: the engine core's float32 layers run this kernel
BLOCK = 16  # output channels in one packed block (kBlockN)
KERNEL = "LlmoptAvx2Bf16Kernel"  # its name in the engine's log, where vLLM names its kernels
PACKED = "llmopt_bf16_packed"  # the attribute of a weight that holds its packing
# the order of a block's channels in memory, which the kernel's 128-bit-lane interleave puts back
LANE_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)
# Shapes a new build is checked on: SmolLM2's and Qwen2.5's layers, a vocabulary-sized one,
# channels that do not fill a block, input widths off the summing span (64) and odd.
CHECKED_SHAPES = ((960, 576), (576, 1536), (1152, 896), (49152, 64), (40, 64), (24, 75), (16, 200))
CHECKED_ROWS = (1, 2, 3, 5, 6, 7, 8, 13, 48, 49, 100)
# How much further from float64 than torch's float32 product (oneDNN's) a check may be: summed by
# spans of 32 inputs, 1.0x on SmolLM2's and Qwen's shapes and at most 1.9x on the small ones; one
# running sum over 1536 inputs was 2-3x (`avx2_bf16_linear.cpp`, kSpan)
TOLERANCE = 3.0


def exact(weight: torch.Tensor) -> bool:
    """Whether bf16 holds every one of these float32 weights: upcast from a bf16 checkpoint, or
    rounded there by a quantization's passes."""
    import torch

    return weight.dtype == torch.float32 and torch.equal(weight.bfloat16().float(), weight)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weights in the kernel's layout: blocks of 16 channels, each [K][16] bf16 with its
    channels in `LANE_ORDER`, N padded to whole blocks with zero weights."""
    import torch
    import torch.nn.functional as F

    n, k = weight.shape
    blocks = F.pad(weight.to(torch.bfloat16), (0, 0, 0, -n % BLOCK)).view(-1, BLOCK, k)
    return blocks[:, list(LANE_ORDER), :].transpose(1, 2).contiguous()


def padded(values: torch.Tensor) -> torch.Tensor:
    """A per-channel bias as float32, padded to whole blocks, as the kernel reads it."""
    import torch.nn.functional as F

    return F.pad(values.reshape(-1).float(), (0, -values.numel() % BLOCK)).contiguous()


def compare(path: str | Path) -> int:
    """The products checked against float64 with the library at `path` loaded: at each
    `CHECKED_SHAPES` with and without a bias and each `CHECKED_ROWS`, no further from it than
    `TOLERANCE` times torch's float32 product of the same weights; and rows strided as a slice of a
    wider input give the contiguous rows' bits. Raises AssertionError on the first that does not."""
    import torch
    import torch.nn.functional as F

    kernels.load(path)
    generator = torch.Generator().manual_seed(0)
    ours = torch.ops.llmopt.avx2_bf16_linear
    checked = 0
    for n, k in CHECKED_SHAPES:
        weight = torch.randn(n, k, generator=generator).bfloat16().float()
        packed = pack(weight)
        for bias in (None, torch.randn(n, generator=generator)):
            for m in CHECKED_ROWS:
                x = torch.randn(m, k, generator=generator)
                exact_out = x.double() @ weight.double().T + (0 if bias is None else bias.double())
                out = ours(x, packed, None if bias is None else padded(bias), n)
                torch_error = (F.linear(x, weight, bias).double() - exact_out).abs().max().item()
                error = (out.double() - exact_out).abs().max().item()
                assert error <= TOLERANCE * torch_error + 1e-6, (n, k, m, error, torch_error)
                checked += 1
        wide = torch.randn(8, k + 64, generator=generator)[:, :k]
        assert torch.equal(ours(wide, packed, None, n), ours(wide.contiguous(), packed, None, n)), (n, k)
    return checked


def use(path: str | Path) -> None:
    """Have vLLM's unquantized float32 layers whose weights are `exact` in bf16 run this kernel in
    this process, others keep vLLM's choice. Set before the model loads."""
    import torch
    from vllm.logger import init_logger
    from vllm.model_executor.layers import utils

    kernels.load(path)
    logger = init_logger("vllm.llmopt")
    vllms = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2 or not exact(weight.data):
            vllms(layer, remove_weight)
            return
        logger.info_once("llmopt: float32 layers: Using %s for %s", KERNEL, type(layer.quant_method).__name__)
        n = weight.shape[0]
        if not hasattr(weight, PACKED):  # a tied lm_head shares the embeddings' weight: packed once
            setattr(weight, PACKED, pack(weight.data))
        packed = getattr(weight, PACKED)
        own_bias = getattr(layer, "bias", None)
        own_padded = None if own_bias is None else padded(own_bias.data)

        def linear(x: torch.Tensor, _weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if bias is not None:  # the layer's own was padded at load; another is padded here
                bias = own_padded if bias is own_bias else padded(bias)
            out = torch.ops.llmopt.avx2_bf16_linear(x.reshape(-1, x.shape[-1]), packed, bias, n)
            return out.reshape(*x.shape[:-1], n)

        layer.cpu_linear = linear
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)

    utils.dispatch_cpu_unquantized_gemm = dispatch  # imported by name at each call, after this
