"""Quantized against bf16 on SmolLM2-135M: decode speed at batch 1 and 16, side by side in one run,
with the quality cost and the cost of quantizing that each job recorded in its manifest.

Each scheme is built by a real optimization job with the built-in recipe's defaults (or reused
when one with the same key exists), then deployed with llmopt's engine settings and loaded with
fixed lengths (64 in, 128 out, end-of-sequence ignored). Configurations are measured in
alternating rounds, so drift on this noisy machine hits them all alike; the table shows the
median of the rounds. Writes benchmarks/results/quantization.json.
Usage: python benchmarks/quantization.py [rounds]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import llmopt
from llmopt import artifact

MODEL = "smollm2-135m-instruct"
SCHEMES = {"bf16": "baseline", "SmoothQuant W8A8": "smoothquant", "AWQ W4A16": "awq", "block FP8": "fp8-block",
           "bf16 + FP8 KV cache": "kv-fp8"}
LEVELS = {1: 6, 16: 48}  # concurrency -> requests
WORKLOAD = "synthetic:64,128"


def decode_speed(path: Path) -> dict[int, float]:
    with llmopt.deploy(str(path)) as endpoint:
        speeds = {}
        for level, count in LEVELS.items():
            result = llmopt.evaluate(endpoint=endpoint.name, dataset=WORKLOAD, concurrency=[level], requests=count, quality=False)
            speeds[level] = result.targets[0].levels[0].output_tokens_per_s
    return speeds


def main(rounds: int) -> None:
    built = {}
    for label, recipe in SCHEMES.items():
        job = llmopt.optimize(MODEL, recipe)
        if job.artifact is None:
            raise SystemExit(f"{label}: job {job.name} {job.status}: {job.record.failure_reason}")
        built[label] = job.artifact
    samples: dict[str, dict[int, list[float]]] = {label: {lvl: [] for lvl in LEVELS} for label in SCHEMES}
    for r in range(rounds):
        for label, path in built.items():
            for level, speed in decode_speed(path).items():
                samples[label][level].append(speed)
            print(f"round {r + 1}: {label}: " + ", ".join(f"b{lvl} {samples[label][lvl][-1]:.1f}" for lvl in LEVELS), flush=True)
    rows = []
    base = {lvl: statistics.median(samples["bf16"][lvl]) for lvl in LEVELS}
    for label, path in built.items():
        metrics = artifact.verify(path).metrics
        q = metrics.quantization
        row = {"scheme": label, "artifact": path.name, "perplexity": round(metrics.perplexity.perplexity, 3),
               "perplexity_increase": metrics.perplexity_increase or 0.0, "kernels": metrics.kernels,
               "weights_mb": round((q.size_bytes if q else metrics.source_size_bytes) / 1e6, 1),
               "quantize_seconds": q.seconds if q else None, "quantize_peak_gib": round(q.peak_rss_bytes / 2**30, 2) if q else None,
               "calibration": q.calibration.model_dump() if q and q.calibration else None,
               "group_size": q.group_size if q else None, "block_size": q.block_size if q else None}
        for level in LEVELS:
            median = statistics.median(samples[label][level])
            row[f"tok_s_b{level}"] = round(median, 1)
            row[f"tok_s_b{level}_rounds"] = [round(x, 1) for x in samples[label][level]]
            row[f"speedup_b{level}"] = round(median / base[level], 3)
        rows.append(row)
    print(f"\n{'scheme':<22} {'tok/s b1':>9} {'x':>6} {'tok/s b16':>10} {'x':>6} {'ppl':>8} {'ppl +%':>7} {'MB':>6} {'quant s':>8}")
    for row in rows:
        print(f"{row['scheme']:<22} {row['tok_s_b1']:>9} {row['speedup_b1']:>6} {row['tok_s_b16']:>10} {row['speedup_b16']:>6} "
              f"{row['perplexity']:>8} {100 * row['perplexity_increase']:>6.2f}% {row['weights_mb']:>6} {row['quantize_seconds'] or '':>8}")
    out = Path(__file__).parent / "results" / "quantization.json"
    out.write_text(json.dumps({"model": MODEL, "workload": WORKLOAD, "rounds": rounds, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
