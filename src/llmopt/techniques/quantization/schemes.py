"""Quantization schemes: the recipe's quantization section (AWQ, SmoothQuant, FP8, and the
calibration data they see), fitted to a model's layer shapes and turned into llm-compressor modifiers.

Fitting is separate from building so the compatibility check can refuse (or warn about) a shape
before any work starts, with the same rule the quantization step applies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import reduce
from math import gcd
from typing import Annotated, Any, Literal, Union

from pydantic import Field

from llmopt.errors import LlmoptError
from llmopt.techniques.base import Section

MIN_GROUP = 16  # smaller groups cost more in scales than they win in accuracy
# Fixed seeds for everything random in quantizing (calibration order, any library sampling), so
# the same recipe on the same source gives the same weights.
SEED = 0


class Calibration(Section):
    """Data that calibration-based quantization sees."""

    dataset: str = Field("builtin", description="'builtin' (text shipped with llmopt), 'sharegpt' or a JSONL path.")
    samples: int = Field(64, gt=0, le=4096)
    sequence_length: int = Field(384, gt=0, le=32768)


IGNORE = ("Modules left unquantized: names, or 're:' regular expressions. [] quantizes the lm_head too, which "
          "every decoded token reads in full (on SmolLM2, 28M of 135M parameters): see benchmarks/README.md, roofline.py.")


class AWQ(Section):
    """INT4 weight-only (W4A16) with activation-aware scaling."""

    method: Literal["awq"] = "awq"
    group_size: int = Field(128, gt=0, le=4096)
    symmetric: bool = False
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description=IGNORE)
    calibration: Calibration = Field(default_factory=Calibration)
    max_perplexity_increase: float = Field(0.12, ge=0, le=10, description="Quality budget, as a fraction.")


class SmoothQuant(Section):
    """SmoothQuant then INT8 weights per channel and INT8 activations per token, dynamic (W8A8)."""

    method: Literal["smoothquant"] = "smoothquant"
    alpha: float = Field(0.8, gt=0, lt=1)
    weights: Literal["gptq", "rtn"] = "gptq"
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description=IGNORE)
    calibration: Calibration = Field(default_factory=Calibration)
    max_perplexity_increase: float = Field(0.03, ge=0, le=10)


class FP8(Section):
    """FP8 weights and activations: dynamic per-channel, or block-wise."""

    method: Literal["fp8"] = "fp8"
    scheme: Literal["block", "dynamic"] = "block"
    block_size: tuple[int, int] = (128, 128)
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description=IGNORE)
    max_perplexity_increase: float = Field(0.02, ge=0, le=10)


Quantization = Annotated[Union[AWQ, SmoothQuant, FP8], Field(discriminator="method")]
SCHEMES = (AWQ, SmoothQuant, FP8)


@dataclass(frozen=True)
class LayerShapes:
    """The widths of a decoder's linear layers, from its config.json."""

    inputs: tuple[int, ...]  # every linear layer's input width
    merged_outputs: tuple[int, ...]  # outputs vLLM merges into one GEMM (q,k of qkv; gate of gate_up)

    @classmethod
    def from_config(cls, config: dict) -> "LayerShapes":
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        kv = config.get("num_key_value_heads", heads) * head_dim
        intermediate = config["intermediate_size"]
        return cls(inputs=(hidden, heads * head_dim, intermediate), merged_outputs=(heads * head_dim, kv, intermediate))


@dataclass(frozen=True)
class Fit:
    """The sizes the step will use, and what the user is told when they differ from the recipe."""

    group_size: int | None = None
    block_size: tuple[int, int] | None = None
    note: str | None = None


def fit(q: Quantization, config: dict, tensor_parallel: int = 1) -> Fit:
    """The largest power-of-two group (AWQ) or block (FP8) size, at most the requested one, that
    every layer of the model divides into; raises when none does."""
    shapes = LayerShapes.from_config(config)
    if isinstance(q, AWQ):
        _check_awq_ignore(q, config.get("num_hidden_layers", 1))
        size = _largest_fitting(q.group_size, shapes.inputs)
        if size is None:
            raise LlmoptError(
                f"awq: no group size from {MIN_GROUP} to {q.group_size} divides the layer widths {sorted(set(shapes.inputs))}",
                "use a model whose hidden and intermediate sizes are multiples of 16",
            )
        note = None if size == q.group_size else (
            f"awq group_size {q.group_size} does not divide the layer widths {sorted(set(shapes.inputs))}; using {size}"
        )
        return Fit(group_size=size, note=note)
    if isinstance(q, FP8) and q.scheme == "block":
        n, k = q.block_size
        # vLLM checks block_n against the outputs it merges into one GEMM, and block_k against the
        # input per device only when the layer is split over devices (fp8_utils.validate_fp8_block_shape).
        outputs = [o // tensor_parallel for o in shapes.merged_outputs]
        fit_n = _largest_fitting(n, outputs)
        fit_k = _largest_fitting(k, [i // tensor_parallel for i in shapes.inputs]) if tensor_parallel > 1 else k
        if fit_n is None or fit_k is None:
            raise LlmoptError(
                f"fp8 block: no block size up to {n}x{k} divides the merged output widths {sorted(set(outputs))}",
                "use fp8 scheme dynamic, or a model whose layer widths are multiples of 16",
            )
        note = None if (fit_n, fit_k) == (n, k) else (
            f"fp8 block_size {n}x{k} does not divide the merged output widths {sorted(set(outputs))}; using {fit_n}x{fit_k}"
        )
        return Fit(block_size=(fit_n, fit_k), note=note)
    return Fit()


# AWQ balances each group against the norm or layer before it; llm-compressor 0.12 divides by zero
# when every layer of a group is left unquantized (awq/base.py, _compute_layer_means).
AWQ_BALANCE_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                      ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def _check_awq_ignore(q: AWQ, layers: int) -> None:
    def ignored(name: str) -> bool:
        return any(re.fullmatch(p[3:], name) if p.startswith("re:") else name.endswith(p) for p in q.ignore)

    for index in range(layers):
        for group in AWQ_BALANCE_GROUPS:
            if all(ignored(f"model.layers.{index}.{member}") for member in group):
                raise LlmoptError(
                    f"awq: ignore leaves {', '.join(group)} of layer {index} all unquantized, which AWQ's smoothing cannot balance",
                    "keep at least one layer of each group quantized, or use a smaller group_size for quality",
                )


def _largest_fitting(requested: int, widths: list[int] | tuple[int, ...]) -> int | None:
    common = reduce(gcd, widths)
    size = 1 << (requested.bit_length() - 1)  # the largest power of two <= requested
    while size >= MIN_GROUP:
        if common % size == 0:
            return size
        size //= 2
    return None


def needs_calibration(q: Quantization) -> bool:
    return isinstance(q, (AWQ, SmoothQuant))


def name(q: Quantization) -> str:
    """The compatibility matrix's name for a scheme."""
    return f"quantization.{q.method}" + (f".{q.scheme}" if isinstance(q, FP8) else "")


def modifiers(q: Quantization, fitted: Fit) -> list[Any]:
    """The llm-compressor recipe (a list of modifiers) for a quantization section."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    ignore = list(q.ignore)
    if isinstance(q, AWQ):
        from llmcompressor.modifiers.awq import AWQModifier

        weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=fitted.group_size,
                                   symmetric=q.symmetric, dynamic=False)
        scheme = QuantizationScheme(targets=["Linear"], weights=weights)
        return [AWQModifier(ignore=ignore),
                QuantizationModifier(config_groups={"group_0": scheme}, ignore=ignore)]
    if isinstance(q, SmoothQuant):
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        quantizer = GPTQModifier if q.weights == "gptq" else QuantizationModifier
        return [SmoothQuantModifier(smoothing_strength=q.alpha, ignore=ignore),
                quantizer(targets=["Linear"], scheme="W8A8", ignore=ignore)]
    assert isinstance(q, FP8)
    if q.scheme == "dynamic":
        return [QuantizationModifier(targets=["Linear"], scheme="FP8_DYNAMIC", ignore=ignore)]
    n, k = fitted.block_size or q.block_size
    weights = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[n, k],
                               symmetric=True, dynamic=False)
    activations = QuantizationArgs(num_bits=8, type="float", strategy="group", group_size=k,
                                   symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    return [QuantizationModifier(config_groups={"group_0": scheme}, ignore=ignore)]
