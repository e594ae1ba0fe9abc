"""int8 layers (SmoothQuant's W8A8, an INT8 `lm_head`) through torch's weight-only int8 kernel,
their activations in bf16 instead of quantized to int8 (`EngineConfig.linear_kernels:
weight_only`, the default on x86 without AVX-512 where llmopt's AVX2 kernel is not built).

There vLLM has only oneDNN for int8 layers, and without VNNI its int8 products stream 0.3-1.6 GB/s
of weights: 0.35x float32's linear layers at one row, against 2.43x for this kernel, which falls
behind float32 from about eight rows (`benchmarks/linear_kernels.py`). Layers whose input width it
does not take keep vLLM's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmopt.engine import int8_layers

if TYPE_CHECKING:
    import torch

ENV = "LLMOPT_INT8_WEIGHT_ONLY"  # set: the engine core's int8 layers run this kernel
KERNEL = "TorchInt8WeightOnlyKernel"  # its name in the engine's log, where vLLM names its kernels


def takes(config: Any, weight: torch.Tensor) -> bool:
    """Torch's kernel reads each row of weights in blocks of 8: other widths came out wrong, or crashed."""
    return weight.shape[1] % 8 == 0


def _prepare(layer: torch.nn.Module, weight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return weight.contiguous(), scales.reshape(-1).to(torch.bfloat16)


def _apply(layer: torch.nn.Module, rows: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None, channels: int) -> torch.Tensor:
    import torch

    out = torch._weight_int8pack_mm(rows.to(torch.bfloat16), weight, scales)
    return out if bias is None else out.to(rows.dtype) + bias


def use() -> None:
    """Have vLLM's int8 layers run this kernel in this process. Set before the model loads."""
    int8_layers.replace(int8_layers.Replacement(KERNEL, "int8 layers with bf16 activations", takes, _prepare, _apply))
