"""vLLM's two CPU linear kernels side by side, on SmolLM2-135M's layer shapes: oneDNN (what vLLM
gives every layer without AMX) against its packed-weight kernels (`weight_packed_linear` for bf16,
`int8_scaled_mm_with_quant` for int8; what llmopt gives them there, `EngineConfig.linear_kernels`),
and llmopt's small-batch kernels over the same packed weights (`small_batch_linear` for bf16,
`small_batch_int8_linear` for int8; built if they are not yet), which stand in for vLLM's up to 64
rows and at 5 to 32 (with AMX, the build for it: the bf16 kernel alone, up to 4 rows). `--out NAME` writes results/NAME instead.
On x86 without AVX-512 (float32 served, no packed kernels), it compares what runs there instead,
llmopt's AVX2 W8A8 kernel and its float32 kernel with bf16-held weights among them (`avx2` below),
and writes results/linear_kernels_avx2.json.

Weights are cold, as in a decode step that streams the whole model: each shape gets enough
distinct weight copies to fill 300 MB (ten times this machine's last-level cache) and the copies
are taken in turn, the best of five passes over them. Prints the time per call and the weight bytes streamed per second, at 1, 4, 8,
16, 40 and 256 rows (decode at batch 1, 8 and 16, n-gram verifying 3 drafted tokens at batch 1 and
4 at batch 8, a prefill chunk), with the largest difference from an fp32 reference relative to its largest
value. Runs itself again in the environment llmopt gives the engine here (tcmalloc and Intel
OpenMP preloaded, its OpenMP threads). Writes
benchmarks/results/linear_kernels.json.

With `--zentorch` (AMD processors; needs `pip install zentorch==2.13.0.2`, AMD's ZenDNN plugin for
this torch), bf16 layers also run on `zentorch_linear_unary` with prepacked weights, what vLLM's
`ZenCpuPlatform` gives every unquantized layer once zentorch can be imported, at 1, 8 and 16 rows
(results/linear_kernels_zentorch.json). Uninstall it afterwards: vLLM switches platform whenever it
is importable.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Callable

import torch

import results_file
from llmopt.engine import (avx2_bf16_linear, avx2_int8_linear, kernels, platform, small_batch_int8_linear, small_batch_linear,
                           vllm)
from llmopt.engine.config import EngineConfig

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}  # (N, K) of SmolLM2-135M
ROWS = (1, 4, 8, 16, 40, 256)
HW = platform.detect()
COLD_BYTES = 300e6
ROUNDS = 5


def _time(call: Callable[[int], torch.Tensor], copies: int) -> float:
    """Seconds a call, the best of `ROUNDS` passes over the copies: on these shared 2-core machines
    a mean of passes takes in whatever else ran (a mean of three read the AVX2 bf16-held kernel at
    0.86x oneDNN at 256 rows, the best of five 1.03-1.07x)."""
    for i in range(copies):
        call(i)
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for i in range(copies):
            call(i)
        best = min(best, (time.perf_counter() - start) / copies)
    return best


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return round(((out.float() - ref).abs().max() / ref.abs().max()).item(), 4)


def vllm_packed(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """vLLM's `_C::weight_packed_linear` called directly (its last flag: the weights are packed),
    not through vLLM's Python wrapper, which `small_batch_linear.use` points at llmopt's kernel."""
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    torch.ops._C.weight_packed_linear(out, x, packed, None, True)
    return out


def small_batch(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """llmopt's op, which returns its output (`engine/small_batch_linear.cpp`)."""
    return torch.ops.llmopt.small_batch_linear(x, packed, None, n)


def bf16(m: int, n: int, k: int, zentorch: bool = False) -> dict[str, float]:
    from vllm import _custom_ops as ops

    copies = max(1, int(COLD_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.bfloat16)
    handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]
    packed = [torch.ops._C.convert_weight_packed(w) for w in weights]
    ref = x.float() @ weights[0].float().t()
    found = {"onednn_s": _time(lambda i: ops.onednn_mm(handlers[i], x, None), copies),
             "packed_s": _time(lambda i: vllm_packed(x, packed[i], n), copies),
             "onednn_error": _error(ops.onednn_mm(handlers[0], x, None), ref),
             "packed_error": _error(vllm_packed(x, packed[0], n), ref), "weight_bytes": n * k * 2}
    if m <= small_batch_linear.max_rows(kernels.library_path(platform.kernel_library(HW))):
        found |= {"llmopt_s": _time(lambda i: small_batch(x, packed[i], n), copies),
                  "llmopt_error": _error(small_batch(x, packed[0], n), ref)}
    if zentorch:
        zen = [torch.ops.zentorch.zentorch_weight_prepack_for_linear(w) for w in weights]

        def zen_mm(i: int) -> torch.Tensor:
            return torch.ops.zentorch.zentorch_linear_unary(x, zen[i], None, is_weight_prepacked=True)

        found |= {"zentorch_s": _time(zen_mm, copies), "zentorch_error": _error(zen_mm(0), ref)}
    return found


def zentorch_rows() -> list[dict]:
    """bf16 layers on ZenDNN against the packed kernels, and a whole decode step's linear layers
    (30 of each layer, one lm_head) at each row count."""
    import zentorch  # noqa: F401  (registers torch.ops.zentorch)

    rows = []
    print(f"{'rows':>4} {'layer':<13} {'packed us':>10} {'GB/s':>6} {'zentorch us':>12} {'GB/s':>6} {'speed-up':>9}")
    for m in (1, 8, 16):
        step = {"packed_s": 0.0, "zentorch_s": 0.0}
        for layer, (n, k) in SHAPES.items():
            row = {"dtype": "bf16", "rows": m, "layer": layer, "n": n, "k": k, **bf16(m, n, k, zentorch=True)}
            row["speedup"] = round(row["packed_s"] / row["zentorch_s"], 3)
            rows.append(row)
            for kind in step:
                step[kind] += row[kind] * (1 if layer == "lm_head" else 30)
            print(f"{m:>4} {layer:<13} {row['packed_s'] * 1e6:>10.1f} {row['weight_bytes'] / row['packed_s'] / 1e9:>6.1f} "
                  f"{row['zentorch_s'] * 1e6:>12.1f} {row['weight_bytes'] / row['zentorch_s'] / 1e9:>6.1f} "
                  f"{row['speedup']:>8.2f}x", flush=True)
        rows.append({"rows": m, "layer": "a decode step", **step, "speedup": round(step["packed_s"] / step["zentorch_s"], 3)})
        print(f"{m:>4} {'a decode step':<13} {step['packed_s'] * 1e3:>9.2f}ms {'':>6} {step['zentorch_s'] * 1e3:>11.2f}ms "
              f"{'':>6} {rows[-1]['speedup']:>8.2f}x", flush=True)
    return rows


def onednn_int8(handler: object, x: torch.Tensor, n: int) -> torch.Tensor:
    """vLLM's oneDNN W8A8 as its CPU int8 layer calls it: activations quantized per token, then the product."""
    from vllm import _custom_ops as ops

    x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x, None, None, True)
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    ops.onednn_scaled_mm(handler, x_q, out, x_s, x_zp, None, None)
    return out


def int8(m: int, n: int, k: int) -> dict[str, float]:
    """Per-channel weights, per-token dynamic activations (SmoothQuant W8A8 as llmopt writes it)."""
    from vllm import _custom_ops as ops

    copies = max(1, int(COLD_BYTES // (n * k)))
    floats = [torch.randn(n, k) for _ in range(copies)]
    scales = [w.abs().amax(1, keepdim=True) / 127 for w in floats]
    weights = [(w / s).round().clamp(-127, 127).to(torch.int8) for w, s in zip(floats, scales)]
    x = torch.randn(m, k, dtype=torch.bfloat16)
    handlers = [ops.create_onednn_scaled_mm(w.t(), s, torch.bfloat16, True, False, 32) for w, s in zip(weights, scales)]
    packed = [torch.ops._C.convert_weight_packed(w) for w in weights]

    def onednn(i: int) -> torch.Tensor:
        return onednn_int8(handlers[i], x, n)

    def packed_mm(i: int) -> torch.Tensor:
        return torch.ops._C.int8_scaled_mm_with_quant(x, packed[i], scales[i], None, x.dtype, True)

    def small_batch_int8(i: int) -> torch.Tensor:
        return torch.ops.llmopt.small_batch_int8_linear(x, packed[i], scales[i], None)

    ref = x.float() @ (weights[0].float() * scales[0]).t()
    found = {"onednn_s": _time(onednn, copies), "packed_s": _time(packed_mm, copies), "onednn_error": _error(onednn(0), ref),
             "packed_error": _error(packed_mm(0), ref), "weight_bytes": n * k}
    if small_batch_int8_linear.MIN_ROWS <= m <= small_batch_int8_linear.MAX_ROWS and hasattr(torch.ops.llmopt, "small_batch_int8_linear"):
        found |= {"llmopt_s": _time(small_batch_int8, copies), "llmopt_error": _error(small_batch_int8(0), ref)}
    return found


def avx2(m: int, n: int, k: int) -> dict[str, float]:
    """Without AVX-512 (vLLM's AVX2 build, float32 served): float32 `F.linear`, and vLLM's oneDNN
    float32 product (`onednn_mm`, what vLLM gives an unquantized layer there),
    vLLM's oneDNN W8A8 (a SmoothQuant layer: per-channel weights, per-token dynamic activations) and
    torch's weight-only int8 kernel (`_weight_int8pack_mm`, gpt-fast's int8), whose vectorized path
    takes bf16 activations: cast from float32 and back, as a float32 model would call it; and
    llmopt's AVX2 W8A8 kernel (`avx2_int8_linear`, the same W8A8 product as oneDNN's), over its
    packed copies of the same weights; and llmopt's float32 kernel over the float weights held in
    bf16 (`avx2_bf16_linear`: a bf16 checkpoint's unquantized layer), against `F.linear` of the same
    bf16 values in float32."""
    from vllm import _custom_ops as ops

    fp32_copies, int8_copies = max(1, int(COLD_BYTES // (n * k * 4))), max(1, int(COLD_BYTES // (n * k)))
    floats = [torch.randn(n, k) for _ in range(fp32_copies)]
    scales = [w.abs().amax(1, keepdim=True) / 127 for w in floats]
    weights = [(w / s).round().clamp(-127, 127).to(torch.int8) for w, s in zip(floats, scales)]
    weights += [weights[i % fp32_copies].clone() for i in range(fp32_copies, int8_copies)]
    scales += [scales[i % fp32_copies] for i in range(fp32_copies, int8_copies)]
    x = torch.randn(m, k)
    handlers = [ops.create_onednn_scaled_mm(w.t(), s, torch.float32, True, False, 32) for w, s in zip(weights, scales)]
    bf16_scales = [s.squeeze(1).to(torch.bfloat16) for s in scales]
    packed = [avx2_int8_linear.pack(w) for w in weights]
    padded_scales = [avx2_int8_linear.padded(s) for s in scales]
    held_copies = max(1, int(COLD_BYTES // (n * k * 2)))
    float_handlers = [ops.create_onednn_mm(w.t(), 32) for w in floats]
    held = [avx2_bf16_linear.pack(floats[i % fp32_copies].bfloat16().float()) for i in range(held_copies)]

    def onednn(i: int) -> torch.Tensor:
        return onednn_int8(handlers[i], x, n)

    def weight_only(i: int) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), weights[i], bf16_scales[i]).float()

    def llmopt(i: int) -> torch.Tensor:
        return torch.ops.llmopt.avx2_int8_linear(x, packed[i], padded_scales[i], None, n)

    def bf16_held(i: int) -> torch.Tensor:
        return torch.ops.llmopt.avx2_bf16_linear(x, held[i], None, n)

    ref = x @ (weights[0].float() * scales[0]).t()
    return {"fp32_s": _time(lambda i: torch.nn.functional.linear(x, floats[i]), fp32_copies),
            "onednn_fp32_s": _time(lambda i: ops.onednn_mm(float_handlers[i], x, None), fp32_copies),
            "bf16_held_s": _time(bf16_held, held_copies),
            "bf16_held_error": _error(bf16_held(0), x @ floats[0].bfloat16().float().t()),
            "onednn_s": _time(onednn, int8_copies), "weight_only_s": _time(weight_only, int8_copies),
            "llmopt_s": _time(llmopt, int8_copies), "onednn_error": _error(onednn(0), ref),
            "weight_only_error": _error(weight_only(0), ref), "llmopt_error": _error(llmopt(0), ref), "weight_bytes": n * k}


def avx2_rows() -> list[dict]:
    """Every layer shape and a whole decode step's linear layers (30 of each layer, one lm_head) at
    1, 8 and 16 rows, and a prefill chunk of 256, each kernel's time and the weight bytes it
    streamed per second."""
    kernels.load(kernels.build(kernels.AVX2))
    kinds = ("fp32", "onednn_fp32", "bf16_held", "onednn", "weight_only", "llmopt")
    rows = []
    print(f"{'rows':>4} {'layer':<13} {'float32 us':>11} {'GB/s':>6} {'oneDNN float32 us':>18} {'GB/s':>6} "
          f"{'llmopt bf16-held us':>20} {'GB/s':>6} "
          f"{'oneDNN W8A8 us':>15} {'GB/s':>6} {'int8 weight-only us':>20} {'GB/s':>6} {'llmopt AVX2 W8A8 us':>20} {'GB/s':>6}")
    for m in (1, 8, 16, 256):
        step = dict.fromkeys(kinds, 0.0)
        for layer, (n, k) in SHAPES.items():
            row = {"dtype": "avx2", "rows": m, "layer": layer, "n": n, "k": k, **avx2(m, n, k)}
            rows.append(row)
            for kind in kinds:
                step[kind] += row[f"{kind}_s"] * (1 if layer == "lm_head" else 30)
            widths = {"fp32": 4, "onednn_fp32": 4, "bf16_held": 2, "onednn": 1, "weight_only": 1, "llmopt": 1}
            cells = [f"{row[f'{kind}_s'] * 1e6:>{w}.1f} {row['weight_bytes'] * widths[kind] / row[f'{kind}_s'] / 1e9:>6.1f}"
                     for kind, w in zip(kinds, (11, 18, 20, 15, 20, 20))]
            print(f"{m:>4} {layer:<13} {' '.join(cells)}", flush=True)
        rows.append({"dtype": "avx2", "rows": m, "layer": "a decode step", **{f"{kind}_s": step[kind] for kind in kinds}})
        print(f"{m:>4} a decode step: float32 {step['fp32'] * 1e3:.2f} ms, oneDNN float32 {step['onednn_fp32'] * 1e3:.2f} ms, "
              f"llmopt bf16-held {step['bf16_held'] * 1e3:.2f} ms ({step['onednn_fp32'] / step['bf16_held']:.2f}x oneDNN "
              f"float32), oneDNN W8A8 {step['onednn'] * 1e3:.2f} ms "
              f"({step['fp32'] / step['onednn']:.2f}x float32), int8 weight-only {step['weight_only'] * 1e3:.2f} ms "
              f"({step['fp32'] / step['weight_only']:.2f}x float32), llmopt AVX2 W8A8 {step['llmopt'] * 1e3:.2f} ms "
              f"({step['fp32'] / step['llmopt']:.2f}x float32)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zentorch", action="store_true", help="bf16 layers on zentorch's kernel too (AMD processors; zentorch installed)")
    results_file.add_out(parser, None, "linear_kernels.json; linear_kernels_avx2.json without AVX-512, linear_kernels_zentorch.json "
                                       "with --zentorch")
    args = parser.parse_args()
    engine_env = vllm.environment(EngineConfig(), HW)
    if any(os.environ.get(name) != value for name, value in engine_env.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | engine_env)
    print(f"{HW.cpu_label}, {torch.get_num_threads()} threads, flags {' '.join(HW.cpu_flags)}")
    if HW.x86_without_avx512:
        (args.out or results_file.RESULTS / "linear_kernels_avx2.json").write_text(json.dumps(
            {"cpu": HW.cpu_label, "cpu_flags": HW.cpu_flags, "threads": torch.get_num_threads(), "cold_bytes": COLD_BYTES,
             "torch": torch.__version__, "rows": avx2_rows()}, indent=2))
        return
    if not platform.packed_linear_supported(HW):
        raise SystemExit(f"{HW.cpu_model} lacks AVX-512 BF16 or VNNI: vLLM's packed kernels do not run here")
    small_batch_linear.use(kernels.build(platform.kernel_library(HW)))  # loads the library: both small-batch ops (with AMX, its build of the bf16 one)
    if args.zentorch:
        (args.out or results_file.RESULTS / "linear_kernels_zentorch.json").write_text(json.dumps(
            {"cpu": HW.cpu_label, "cpu_flags": HW.cpu_flags, "threads": torch.get_num_threads(), "cold_bytes": COLD_BYTES,
             "zentorch": importlib.metadata.version("zentorch"), "rows": zentorch_rows()}, indent=2))
        return
    rows = []
    print(f"{'dtype':<6} {'rows':>4} {'layer':<13} {'oneDNN us':>10} {'GB/s':>6} {'packed us':>10} {'GB/s':>6} {'speed-up':>9} "
          f"{'llmopt us':>10} {'over packed':>12}")
    for dtype, measure in (("bf16", bf16), ("int8", int8)):
        for m in ROWS:
            for layer, (n, k) in SHAPES.items():
                row = {"dtype": dtype, "rows": m, "layer": layer, "n": n, "k": k, **measure(m, n, k)}
                row["speedup"] = round(row["onednn_s"] / row["packed_s"], 3)
                if "llmopt_s" in row:
                    row["llmopt_over_packed"] = round(row["packed_s"] / row["llmopt_s"], 3)
                rows.append(row)
                gbs = [row["weight_bytes"] / row[f"{kind}_s"] / 1e9 for kind in ("onednn", "packed")]
                ours = f"{row['llmopt_s'] * 1e6:>10.1f} {row['llmopt_over_packed']:>11.2f}x" if "llmopt_s" in row else ""
                print(f"{dtype:<6} {m:>4} {layer:<13} {row['onednn_s'] * 1e6:>10.1f} {gbs[0]:>6.1f} "
                      f"{row['packed_s'] * 1e6:>10.1f} {gbs[1]:>6.1f} {row['speedup']:>8.2f}x {ours}", flush=True)
    for dtype in ("bf16", "int8"):  # a decode step's linear layers: 30 of each layer, one lm_head
        for m in ROWS:
            step = {kind: sum(r[f"{kind}_s"] * (1 if r["layer"] == "lm_head" else 30) for r in rows
                              if r["dtype"] == dtype and r["rows"] == m and f"{kind}_s" in r) for kind in ("onednn", "packed", "llmopt")}
            rows.append({"dtype": dtype, "rows": m, "layer": "a decode step", **{f"{k}_s": v for k, v in step.items() if v}})
            print(f"{dtype:<6} {m:>4} a decode step: oneDNN {step['onednn'] * 1e3:.2f} ms, packed {step['packed'] * 1e3:.2f} ms"
                  + (f", llmopt {step['llmopt'] * 1e3:.2f} ms ({step['packed'] / step['llmopt']:.2f}x packed)" if step["llmopt"] else ""))
    (args.out or results_file.RESULTS / "linear_kernels.json").write_text(json.dumps(
        {"cpu": HW.cpu_label, "cpu_flags": HW.cpu_flags, "threads": torch.get_num_threads(), "cold_bytes": COLD_BYTES,
         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
