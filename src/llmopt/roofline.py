"""What one decode step of a model must read and compute, from its safetensors headers alone: the
inputs of a roofline (the bound a machine's bandwidth and matmul rate set on tokens/s).

Decoding is bound by reading the weights: every step reads each linear layer's weights in full,
the `lm_head` in full (a tied embedding matrix is read as the `lm_head`), and one embedding row
per token. The KV cache adds its bytes per position of context, per sequence.

The machine's side, its read bandwidth and matmul rates, is measured once per machine and kept in
the llmopt home (`machine_rates`): half a minute with torch, before any engine runs.
"""

from __future__ import annotations

import json
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from llmopt import paths
from llmopt.engine import platform, vllm
from llmopt.engine.config import EngineConfig


FLOAT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}  # the engine's dtypes
STORED_FLOATS = {"BF16": 2, "F16": 2, "F32": 4}  # safetensors' names


@dataclass(frozen=True)
class Traffic:
    weights_bytes: int  # read by one decode step, whatever the batch
    kv_bytes_per_position: int  # K and V of one position, every layer, in the served dtype
    macs_int8: int  # multiply-adds per token on int8 operands
    macs_bf16: int  # on floating-point operands of the served dtype (int4 weights are dequantized to it)
    head_macs: int = 0  # the lm_head's share of those: a prefill computes it for its last position only
    dtype: str = "bfloat16"  # what the engine computes and keeps unquantized weights in


@dataclass(frozen=True)
class Rates:
    read_gb_s: float
    bf16_gflop_s: float
    int8_gflop_s: float | None = None
    copy_gb_s: float | None = None
    fp32_gflop_s: float | None = None
    # the read rate of a typical moment of the window read_gb_s is the best of: on shared VMs the two
    # differ (a 2-core EPYC VM read 31 GB/s in most seconds and 48-62 in stretches of a few seconds)
    read_median_gb_s: float | None = None


def best_seconds(run: Callable[[], object], repeats: int = 7) -> float:
    """The fastest of `repeats` timed runs after an untimed one: a rate's bound is the best the
    machine does, and the first run pays for first touches."""
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def measure_rates(cores: int, window_s: float = 20.0) -> Rates:
    """Read bandwidth (GB/s) over 1 GiB (256 MiB read 10-25% faster on a 32 MiB-L3 EPYC), sampled
    across `window_s` seconds, copy bandwidth across a quarter of it, and bf16, fp32 and int8 matmul
    throughput (GFLOP/s) on `cores` threads, best of several runs; in a process of its own, so its 2 GiB and torch's
    threads never count against the caller (whose peak memory every process it starts would report
    as its own: procs.peak_rss_bytes)."""
    done = subprocess.run([sys.executable, "-c", f"from llmopt import roofline; roofline._print_rates({int(cores)}, {float(window_s)})"],
                          capture_output=True, text=True, timeout=600 + window_s)
    if done.returncode != 0:
        raise RuntimeError(f"measuring this machine's rates failed: {done.stderr.strip()[-300:]}")
    return Rates(**json.loads(done.stdout.splitlines()[-1]))


def _sampled_seconds(run: Callable[[], object], window_s: float) -> list[float]:
    """The best of three runs, then a quarter of a second's rest, for `window_s`: a shared VM's bandwidth
    moves between two levels every few seconds (31 and 48-62 GB/s on a 2-core EPYC, one process
    reading 1 GiB twice a second for a minute), so a best of 30 back-to-back reads (about a second)
    caught whichever level that second had, and two rounds of the roofline read 35 and 62 GB/s."""
    samples, ends = [], time.perf_counter() + window_s
    while not samples or time.perf_counter() < ends:
        samples.append(best_seconds(run, 3))
        time.sleep(0.25)
    return samples


def _print_rates(cores: int, window_s: float) -> None:
    import torch  # the engine's; only this measuring process needs it

    torch.set_num_threads(cores)
    x = torch.ones(2**28, dtype=torch.float32)
    y = torch.empty_like(x)
    size = x.numel() * 4
    # a bound is the best the machine does, over a window long enough to see its fast level
    reads = [size / seconds / 1e9 for seconds in _sampled_seconds(lambda: x.sum(), window_s)]
    copy = 2 * size / min(_sampled_seconds(lambda: y.copy_(x), window_s / 4)) / 1e9  # only for the record
    def matmul_gflop_s(dtype: torch.dtype, n: int) -> float:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        return 2 * n**3 / best_seconds(lambda: a @ b) / 1e9

    n = 2048
    hw = platform.detect()
    # the dtype the engine does not serve in here only for the record, at a size that takes a second
    # where its matmul is slow (bf16 without AVX-512: 1-10 GFLOP/s, half a minute a product at 2048)
    serves_fp32 = platform.default_dtype(hw) == "float32"
    bf16 = matmul_gflop_s(torch.bfloat16, 512 if serves_fp32 else n)
    fp32 = matmul_gflop_s(torch.float32, n)
    int8: float | None = None
    # without VNNI torch's int8 matmul is a reference loop (0.9 GFLOP/s on a Zen 3 EPYC), nothing like
    # the engine's int8 kernel (llmopt's AVX2 W8A8, which multiplies at about float32's rate there):
    # no int8 rate, and the bound takes the float one for int8 layers
    if hw.has_vnni:
        try:
            ai, bi = torch.randint(-8, 8, (n, n), dtype=torch.int8), torch.randint(-8, 8, (n, n), dtype=torch.int8)
            int8 = round(2 * n**3 / best_seconds(lambda: torch._int_mm(ai, bi)) / 1e9, 1)
        except RuntimeError:
            pass
    print(json.dumps(asdict(Rates(read_gb_s=round(max(reads), 2), bf16_gflop_s=round(bf16, 1), int8_gflop_s=int8,
                                  copy_gb_s=round(copy, 2), fp32_gflop_s=round(fp32, 1),
                                  read_median_gb_s=round(statistics.median(reads), 2)))))


def machine_rates(hw: platform.Hardware | None = None) -> Rates | None:
    """This machine's rates, measured the first time and kept under its processor and core count
    (delete the file in `engine-facts/` to measure again, on an idle machine; a file kept before the
    bandwidth was read over a window is measured again); None on a GPU
    machine, whose bound is the GPU's memory, which this does not measure."""
    hw = hw or platform.detect()
    if hw.device != "cpu":
        return None
    kept = paths.engine_fact(f"rates-{hw.slug}.json")
    try:
        found = Rates(**json.loads(kept.read_text()))
        if found.read_median_gb_s is not None:  # else kept before the window, from a second's best reads
            return found
    except (OSError, ValueError, TypeError):
        pass
    try:
        found = measure_rates(hw.cores)
    except (RuntimeError, OSError, ValueError, TypeError, IndexError, subprocess.TimeoutExpired):
        return None  # no room for the 2 GiB it reads, say: no bound shown, nothing else lost
    paths.keep_fact(kept, json.dumps(asdict(found)))
    return found


def tensors(folder: Path) -> dict[str, dict]:
    """Name -> dtype, shape and data offsets of every tensor in the folder's safetensors files (those
    its index names, where it has one: a folder may hold a consolidated copy beside the shards)."""
    found: dict[str, dict] = {}
    index = folder / "model.safetensors.index.json"
    files = ([folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
             if index.is_file() else sorted(folder.glob("*.safetensors")))
    for path in files:
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        found.update({k: v for k, v in header.items() if k != "__metadata__"})
    return found


def served_traffic(folder: Path, settings: EngineConfig, hw: platform.Hardware | None) -> Traffic:
    """`traffic` as the engine serves the folder with these settings on `hw` (None: this machine)."""
    return traffic(folder, vllm.dtype(settings, hw), vllm.holds_bf16_weights(settings, hw))


def traffic(folder: Path, dtype: str = "bfloat16", bf16_held: bool = False) -> Traffic:
    """What a decode step reads and computes served in `dtype`: vLLM casts unquantized weights and
    biases to it, and keeps the KV cache in it; quantized weights and their scales stay as stored.
    `bf16_held`: the matrices of unquantized layers stored in bf16 stream as stored whatever `dtype`
    (llmopt's AVX2 float32 kernel, `vllm.holds_bf16_weights`). All zeros for what is not a model
    folder with safetensors (a GGUF file, a remote server's)."""
    if not (folder / "config.json").is_file():
        return Traffic(weights_bytes=0, kv_bytes_per_position=0, macs_int8=0, macs_bf16=0, dtype=dtype)
    config = json.loads((folder / "config.json").read_text())
    found = tensors(folder)
    width = FLOAT_BYTES[dtype]
    tied = not any("lm_head" in name for name in found)  # no lm_head of its own: the embeddings serve as one
    streamed, macs_int8, macs_bf16, head_macs = 0, 0, 0, 0
    for name, info in found.items():
        stored = info["data_offsets"][1] - info["data_offsets"][0]
        size = stored
        if info["dtype"] in STORED_FLOATS and name.endswith(("weight", "bias")):
            size = stored // STORED_FLOATS[info["dtype"]] * width
        held = bf16_held and info["dtype"] == "BF16" and name.endswith("weight") and len(info["shape"]) == 2
        if "embed_tokens" in name:
            streamed += size // info["shape"][0]  # one row per token, looked up in `dtype`
            if tied:
                streamed += stored if held else size  # the lm_head is the embedding matrix, read in full
                head_macs = info["shape"][0] * info["shape"][1]
                macs_bf16 += head_macs
            continue
        if name == "lm_head.weight":
            head_macs = info["shape"][0] * info["shape"][1]
        streamed += stored if held and "norm" not in name else size
        if name.endswith("weight") and len(info["shape"]) == 2 and "norm" not in name:
            if info["dtype"] == "I8":
                macs_int8 += info["shape"][0] * info["shape"][1]
            elif info["dtype"] in ("BF16", "F16", "F32", "F8_E4M3"):
                macs_bf16 += info["shape"][0] * info["shape"][1]
        elif name.endswith("weight_packed"):  # AWQ: 8 int4 values per int32, dequantized to bf16
            macs_bf16 += info["shape"][0] * info["shape"][1] * 8
    layers, heads = config.get("num_hidden_layers", 0), config.get("num_attention_heads", 0)
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    kv = 2 * layers * (config.get("num_key_value_heads") or heads) * head_dim * width  # 0 where the config does not say
    return Traffic(weights_bytes=streamed, kv_bytes_per_position=kv, macs_int8=macs_int8, macs_bf16=macs_bf16,
                   head_macs=head_macs, dtype=dtype)


@dataclass(frozen=True)
class Speculation:
    """A speculating step: each sequence verifies `proposed` drafted tokens in one pass of the target
    and keeps `accepted_length` tokens on average (1 + the accepted drafts); a draft model (None for
    n-gram lookup, which reads no weights) runs `proposed` passes of its own to draft them."""

    proposed: float
    accepted_length: float
    draft: Traffic | None = None


def matmul_gflop_s(found: Traffic, rates: Rates) -> tuple[float, float]:
    """The rates a model's float layers (in the dtype it is served in) and its int8 layers multiply
    at: the float one for int8 layers where no int8 rate was measured (no VNNI)."""
    float_rate = (rates.fp32_gflop_s if found.dtype == "float32" else None) or rates.bf16_gflop_s
    return float_rate, rates.int8_gflop_s or float_rate


def bound_tokens_per_s(found: Traffic, rates: Rates, batch: int, context: int,
                       speculation: Speculation | None = None) -> tuple[float, str]:
    """A step reads the weights once and each sequence's KV cache, and does each sequence's
    multiply-adds for every token it verifies; a draft model's passes add theirs. Its time is the
    larger of reading and computing; it yields one token per sequence, or the accepted length when
    speculating. Tokens/s, and which of the two bounds it."""
    float_rate, int8_rate = matmul_gflop_s(found, rates)

    def seconds(model: Traffic, passes: float, tokens: float) -> tuple[float, float]:
        read = passes * (model.weights_bytes + batch * context * model.kv_bytes_per_position) / (rates.read_gb_s * 1e9)
        compute = batch * tokens * 2 * (model.macs_int8 / (int8_rate * 1e9) + model.macs_bf16 / (float_rate * 1e9))
        return read, compute

    memory_s, compute_s = seconds(found, 1, 1 + (speculation.proposed if speculation else 0))
    if speculation is not None and speculation.draft is not None:
        draft_read, draft_compute = seconds(speculation.draft, speculation.proposed, speculation.proposed)
        memory_s, compute_s = memory_s + draft_read, compute_s + draft_compute
    tokens = batch * (speculation.accepted_length if speculation else 1)
    return tokens / max(memory_s, compute_s), "memory" if memory_s >= compute_s else "compute"
