"""SmoothQuant's int8 layers where vLLM has only oneDNN for them (x86 without AVX-512 nor VNNI,
float32 served): vLLM's oneDNN W8A8 (`linear_kernels: vllm`), torch's weight-only int8 kernel with
bf16 activations (`linear_kernels: weight_only`), and llmopt's AVX2 W8A8 kernel (`linear_kernels:
llmopt`, llmopt's default there where it is built), beside the float32 source, served as llmopt
serves it there (its weights held in bf16 by llmopt's AVX2 float32 kernel where it is built,
`avx2_bf16_linear`) and as vLLM does (`linear_kernels: vllm`: float32 weights through oneDNN).

Without VNNI, oneDNN sums pairs of int8 products in 16 bits, which saturate, and its int8 products
stream 0.3-1.6 GB/s of weights (`linear_kernels.py`). The weight-only kernel reads the same int8
weights and per-channel scales and keeps the activations in bf16; llmopt's quantizes them per row
as vLLM's W8A8 does and multiplies in exact 32-bit sums of 16-bit products (`avx2_int8_linear`).

One SmoothQuant artifact of SmolLM2-135M (the suite's quick recipe: round-to-nearest weights from
8 calibration samples, the lm_head in INT8 too; built or reused by key), served with each kernel,
and the source, in turn, `--rounds` times: decode tokens/s at batch 1 and 8 from the median time per
output token of fixed-length requests (16 tokens in, 128 out, end-of-sequence ignored), and in the
first round the perplexity of the built-in held-out text served. Writes
benchmarks/results/int8_weight_only.json (or --out).

    .venv/bin/python benchmarks/int8_weight_only.py [--rounds N] [--rows KERNEL ...] [--out NAME.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import llmopt
import results_file
from llmopt import serving
from llmopt.engine import platform
from llmopt.engine.config import EngineConfig

MODEL = "smollm2-135m-instruct"
RECIPE = {"name": "smoothquant-quick", "quantization": {
    "method": "smoothquant", "weights": "rtn", "calibration": {"samples": 8, "sequence_length": 128}, "ignore": [],
    "max_perplexity_increase": 0.08}}
CASES = {"batch 1": (1, 6), "batch 8": (8, 16)}  # concurrency, requests
KERNELS = {"SmoothQuant, oneDNN W8A8": "vllm", "SmoothQuant, weight-only int8": "weight_only",
           "SmoothQuant, llmopt AVX2 W8A8": "llmopt"}  # row: linear_kernels


def measure(spec: serving.ServingSpec, quality: bool) -> dict[str, float]:
    found: dict[str, float] = {}
    with serving.deploy(spec) as endpoint:
        for case, (concurrency, requests) in CASES.items():
            results = llmopt.evaluate(endpoint=endpoint.name, dataset="synthetic:16,128", concurrency=[concurrency],
                                      requests=requests, min_duration_s=0, quality=False)
            level = results.targets[0].levels[0]
            if level.decode_tokens_per_s is None:
                raise SystemExit(f"{spec.model_label} at {case}: no time per output token measured ({level.invocation_errors} failed requests)")
            found[case] = round(level.decode_tokens_per_s, 1)
        if quality:
            scored = llmopt.evaluate(endpoint=endpoint.name, concurrency=[1], requests=1, min_duration_s=0, quality=True)
            perplexity = scored.targets[0].quality.perplexity if scored.targets[0].quality else None
            found["perplexity"] = round(perplexity.perplexity, 3) if perplexity else float("nan")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="serve and measure every row this many times, in turn")
    parser.add_argument("--rows", nargs="+", choices=[*KERNELS.values(), "all"], default=["all"],
                        help="the linear kernels of the SmoothQuant rows served beside the float32 source (oneDNN's, vllm, is slow: about 4 min a round)")
    results_file.add_out(parser, "int8_weight_only.json")
    args = parser.parse_args()
    hardware = platform.detect()
    job = llmopt.optimize(MODEL, RECIPE)
    if job.artifact is None:
        raise SystemExit(f"job {job.name} ended {job.status}: {job.record.failure_reason}")
    quantized = serving.for_target(str(job.artifact))
    rows = {"float32 source": serving.for_target(MODEL, EngineConfig()),
            "float32 source, oneDNN": serving.for_target(MODEL, EngineConfig(linear_kernels="vllm"))}
    for label, kernel in KERNELS.items():
        if kernel in args.rows or "all" in args.rows:
            rows[label] = replace(quantized, engine=quantized.engine.model_copy(update={"linear_kernels": kernel}))
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in rows}
    for round_ in range(1, args.rounds + 1):
        for label, spec in rows.items():
            runs[label].append(measure(spec, quality=round_ == 1))
            print(f"round {round_}, {label}: {runs[label][-1]}", flush=True)
    base = {case: statistics.median(r[case] for r in runs["float32 source"]) for case in CASES}
    table = []
    print(f"\n{hardware.cpu_label}, {hardware.cores} cores; medians of {args.rounds} rounds (tokens/s, and over float32)")
    print(f"{'row':<32} {'batch 1':>16} {'batch 8':>16} {'perplexity':>18}")
    for label, found in runs.items():
        speeds = {case: statistics.median(r[case] for r in found) for case in CASES}
        perplexity = found[0]["perplexity"]
        increase = perplexity / runs["float32 source"][0]["perplexity"] - 1
        table.append({"row": label, **{case: {"tokens_per_s": speeds[case], "over_float32": round(speeds[case] / base[case], 3),
                                              "rounds": [r[case] for r in found]} for case in CASES},
                      "perplexity": perplexity, "perplexity_increase": round(increase, 4)})
        cells = " ".join(f"{speeds[case]:>8.1f} ({speeds[case] / base[case]:.2f}x)" for case in CASES)
        print(f"{label:<32} {cells} {perplexity:>9.3f} ({increase:+.2%})")
    args.out.write_text(json.dumps(
        {"cpu": hardware.cpu_label, "cpu_flags": hardware.cpu_flags, "cores": hardware.cores, "artifact": Path(job.artifact).name,
         "recipe": RECIPE, "rounds": args.rounds, "rows": table}, indent=2))


if __name__ == "__main__":
    main()
