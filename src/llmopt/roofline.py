"""What one decode step of a model must read and compute, from its safetensors headers alone: the
inputs of a roofline (the bound a machine's bandwidth and matmul rate set on tokens/s).

Decoding is bound by reading the weights: every step reads each linear layer's weights in full,
the `lm_head` in full (a tied embedding matrix is read as the `lm_head`), and one embedding row
per token. The KV cache adds its bytes per position of context, per sequence.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Traffic:
    weights_bytes: int  # read by one decode step, whatever the batch
    kv_bytes_per_position: int  # K and V of one position, every layer, bf16
    macs_int8: int  # multiply-adds per token on int8 operands
    macs_bf16: int  # on bf16 operands (int4 weights are dequantized to bf16)


@dataclass(frozen=True)
class Rates:
    read_gb_s: float
    bf16_gflop_s: float
    int8_gflop_s: float | None = None


def tensors(folder: Path) -> dict[str, dict]:
    """Name -> dtype, shape and data offsets of every tensor in the folder's safetensors files."""
    found: dict[str, dict] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        found.update({k: v for k, v in header.items() if k != "__metadata__"})
    return found


def traffic(folder: Path) -> Traffic:
    config = json.loads((folder / "config.json").read_text())
    found = tensors(folder)
    tied = not any("lm_head" in name for name in found)  # no lm_head of its own: the embeddings serve as one
    streamed, macs_int8, macs_bf16 = 0, 0, 0
    for name, info in found.items():
        size = info["data_offsets"][1] - info["data_offsets"][0]
        if "embed_tokens" in name:
            streamed += size // info["shape"][0]  # one row per token
            if tied:
                streamed += size  # the lm_head is the embedding matrix, read in full
                macs_bf16 += info["shape"][0] * info["shape"][1]
            continue
        streamed += size
        if name.endswith("weight") and len(info["shape"]) == 2 and "norm" not in name:
            if info["dtype"] == "I8":
                macs_int8 += info["shape"][0] * info["shape"][1]
            elif info["dtype"] in ("BF16", "F16", "F32", "F8_E4M3"):
                macs_bf16 += info["shape"][0] * info["shape"][1]
        elif name.endswith("weight_packed"):  # AWQ: 8 int4 values per int32, dequantized to bf16
            macs_bf16 += info["shape"][0] * info["shape"][1] * 8
    layers, heads = config.get("num_hidden_layers", 0), config.get("num_attention_heads", 0)
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    kv = 2 * layers * (config.get("num_key_value_heads") or heads) * head_dim * 2  # 0 where the config does not say
    return Traffic(weights_bytes=streamed, kv_bytes_per_position=kv, macs_int8=macs_int8, macs_bf16=macs_bf16)


def bound_tokens_per_s(found: Traffic, rates: Rates, batch: int, context: int) -> tuple[float, str]:
    """A step reads the weights once and each sequence's KV cache, and does each sequence's
    multiply-adds; its time is the larger of the two. Tokens/s, and which of the two bounds it."""
    memory_s = (found.weights_bytes + batch * context * found.kv_bytes_per_position) / (rates.read_gb_s * 1e9)
    int8_rate = rates.int8_gflop_s or rates.bf16_gflop_s
    compute_s = batch * 2 * (found.macs_int8 / (int8_rate * 1e9) + found.macs_bf16 / (rates.bf16_gflop_s * 1e9))
    return batch / max(memory_s, compute_s), "memory" if memory_s >= compute_s else "compute"
