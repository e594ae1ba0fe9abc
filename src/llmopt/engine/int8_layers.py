"""vLLM's CPU int8 layers (`CPUInt8ScaledMMLinearKernel`: SmoothQuant's W8A8 layers, an INT8
`lm_head`) handed to a kernel of llmopt's choosing in this process, where vLLM has only oneDNN for
them and oneDNN has no fast path (x86 without VNNI): llmopt's AVX2 W8A8 kernel
(`avx2_int8_linear`) or torch's weight-only int8 kernel (`weight_only_int8_linear`). Layers the
replacement does not take keep vLLM's. Set before the model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Replacement:
    kernel: str  # its name in the engine's log, where vLLM names its kernels (`vllm.logged_linear_kernels`)
    layers: str  # what the log line calls the layers it serves
    # (vLLM's kernel config, the int8 weight [N, K]) -> whether this layer runs the replacement
    takes: Callable[[Any, torch.Tensor], bool]
    # (the layer, its int8 weight [N, K], one float scale per output channel) -> the weight and
    # scales as `apply` reads them
    prepare: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    # (the layer, rows [M, K], prepared weight, prepared scales, bias or None, N) -> [M, N]
    apply: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]


def replace(replacement: Replacement) -> None:
    """Route the int8 layers `replacement.takes` to it, for every model this process loads after."""
    import torch
    from vllm.logger import init_logger
    from vllm.model_executor.kernels.linear.scaled_mm import cpu
    from vllm.model_executor.layers.quantization.utils import replace_parameter
    from vllm.model_executor.layers.quantization.utils.w8a8_utils import convert_to_channelwise

    logger = init_logger("vllm.llmopt")
    vllms = cpu.CPUInt8ScaledMMLinearKernel
    vllms_process, vllms_apply = vllms.process_weights_after_loading, vllms.apply_weights

    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        w_q_name, w_s_name = self.layer_param_names[:2]
        weight = getattr(layer, w_q_name)
        self.llmopt_channels = weight.shape[0] if replacement.takes(self.config, weight) else None
        if self.llmopt_channels is None:
            vllms_process(self, layer)
            return
        # in vLLM's words for its kernel choice, logged after vLLM's own line, so a job's measurement
        # records this one (`vllm.logged_linear_kernels` keeps a layer type's last)
        logger.info_once("llmopt: %s: Using %s for %s", replacement.layers, replacement.kernel,
                         type(getattr(layer, "scheme", self)).__name__)
        weight_scale = getattr(layer, w_s_name)
        if not self.config.is_channelwise:  # a scale per tensor (per part of a fused one): one per output channel
            weight_scale = convert_to_channelwise(weight_scale, layer.logical_widths)
        prepared, scales = replacement.prepare(layer, weight.data, weight_scale.data)
        replace_parameter(layer, w_q_name, torch.nn.Parameter(prepared, requires_grad=False))
        replace_parameter(layer, w_s_name, torch.nn.Parameter(scales, requires_grad=False))

    def apply_weights(self: Any, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.llmopt_channels is None:
            return vllms_apply(self, layer, x, bias)
        w_q_name, w_s_name = self.layer_param_names[:2]
        n = self.llmopt_channels
        out = replacement.apply(layer, x.reshape(-1, x.shape[-1]), getattr(layer, w_q_name), getattr(layer, w_s_name), bias, n)
        return out.to(x.dtype).reshape(*x.shape[:-1], n)

    vllms.process_weights_after_loading = process_weights_after_loading
    vllms.apply_weights = apply_weights
