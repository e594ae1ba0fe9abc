"""Quantized against bf16 on SmolLM2-135M: decode speed at batch 1 and 16, side by side in one run,
with the quality cost and the cost of quantizing that each job recorded in its manifest.

Each scheme is built by a real optimization job with the built-in recipe's defaults (or reused
when one with the same key exists), then deployed with llmopt's engine settings and loaded with
fixed lengths (64 in, 128 out, end-of-sequence ignored). Configurations are measured in
alternating rounds, so drift on this noisy machine hits them all alike; the table shows the
median of the rounds. A scheme the compatibility matrix refuses on this processor is listed as
refused. Writes benchmarks/results/quantization.json (or --out).

    .venv/bin/python benchmarks/quantization.py [SCHEME ...] [--rounds N] [--out NAME.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import llmopt
import results_file
from llmopt import artifact
from llmopt.engine import platform
from llmopt.errors import LlmoptError

MODEL = "smollm2-135m-instruct"
SCHEMES = {"bf16": "baseline", "SmoothQuant W8A8": "smoothquant",
           "SmoothQuant + lm_head": {"quantization": {"method": "smoothquant", "ignore": []}},
           "AWQ W4A16": "awq", "block FP8": "fp8-block", "bf16 + FP8 KV cache": "kv-fp8"}
LEVELS = {1: 6, 16: 48}  # concurrency -> requests
WORKLOAD = "synthetic:64,128"


def decode_speed(path: Path) -> dict[int, float]:
    with llmopt.deploy(str(path)) as endpoint:
        speeds = {}
        for level, count in LEVELS.items():
            result = llmopt.evaluate(endpoint=endpoint.name, dataset=WORKLOAD, concurrency=[level], requests=count, quality=False)
            speeds[level] = result.targets[0].levels[0].output_tokens_per_s
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("schemes", nargs="*", help=f"the rows to run besides bf16 (default: every one): {', '.join(SCHEMES)}")
    parser.add_argument("--rounds", type=int, default=3)
    results_file.add_out(parser, "quantization.json")
    args = parser.parse_args()
    if unknown := [name for name in args.schemes if name not in SCHEMES]:
        parser.error(f"no scheme named {', '.join(unknown)}")
    labels = ["bf16", *[name for name in args.schemes or SCHEMES if name != "bf16"]]
    built, refused = {}, {}
    for label in labels:
        try:
            job = llmopt.optimize(MODEL, SCHEMES[label])
        except LlmoptError as exc:
            refused[label] = exc.one_line()
            print(f"{label}: refused here: {refused[label]}", flush=True)
            continue
        if job.artifact is None:
            raise SystemExit(f"{label}: job {job.name} {job.status}: {job.record.failure_reason}")
        built[label] = job.artifact
    samples: dict[str, dict[int, list[float]]] = {label: {lvl: [] for lvl in LEVELS} for label in built}
    for r in range(args.rounds):
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
        if "refused" in row:
            print(f"{row['scheme']:<22} refused here")
            continue
        print(f"{row['scheme']:<22} {row['tok_s_b1']:>9} {row['speedup_b1']:>6} {row['tok_s_b16']:>10} {row['speedup_b16']:>6} "
              f"{row['perplexity']:>8} {100 * row['perplexity_increase']:>6.2f}% {row['weights_mb']:>6} {row['quantize_seconds'] or '':>8}")
    rows += [{"scheme": label, "refused": reason} for label, reason in refused.items()]
    hardware = platform.detect()
    args.out.write_text(json.dumps({"model": MODEL, "processor": hardware.cpu_label, "cores": hardware.cores,
                               "cpu_flags_amx": hardware.has_amx,
                               "linear_kernels": platform.default_linear_kernels(hardware), "workload": WORKLOAD,
                               "rounds": args.rounds, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
