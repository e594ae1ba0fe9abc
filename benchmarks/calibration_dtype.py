"""Quantizing in bf16 against float32, side by side in one run: the seconds llm-compressor takes for
the built-in SmoothQuant recipe (SmoothQuant smoothing, then GPTQ over 64 calibration samples of 384
tokens) on SmolLM2-135M, on this machine.

On x86 without AVX-512 torch multiplies bf16 at 1-10 GFLOP/s against float32's 19-85, so llmopt
quantizes in float32 there (`quantization.calibration_dtype`). Each dtype quantizes into a folder
of its own (nothing is kept or reused), in turn, `--rounds` times; the quality of the weights each
makes is judged by the jobs that build them (their perplexity against the source, served), not
here. Writes benchmarks/results/calibration_dtype.json (or --out).

    .venv/bin/python benchmarks/calibration_dtype.py [--rounds N] [--out NAME.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

import results_file
from llmopt import recipe as recipes
from llmopt import sources
from llmopt.engine import platform
from llmopt.techniques import quantization

MODEL = "smollm2-135m-instruct"
DTYPES = ("bfloat16", "float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="quantize in each dtype this many times, in turn")
    results_file.add_out(parser, "calibration_dtype.json")
    args = parser.parse_args()
    hardware = platform.detect()
    source = sources.resolve(MODEL)
    q = recipes.load("smoothquant").quantization
    log = logging.getLogger("calibration_dtype")
    seconds: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    quantization.load_llmcompressor()  # imported before the clock starts, so the first dtype does not pay for it
    for round_ in range(1, args.rounds + 1):
        for dtype in DTYPES:
            with tempfile.TemporaryDirectory() as folder:
                record = quantization._quantize(q, source, Path(folder), 1, dtype, log, lambda _: None)
            seconds[dtype].append(record.seconds)
            print(f"round {round_}, {dtype}: {record.seconds:.1f} s", flush=True)
    medians = {dtype: statistics.median(found) for dtype, found in seconds.items()}
    print(f"\n{hardware.cpu_label}, {hardware.cores} cores; built-in SmoothQuant on {MODEL}, medians of {args.rounds}")
    for dtype in DTYPES:
        print(f"{dtype:<10} {medians[dtype]:>8.1f} s ({medians['bfloat16'] / medians[dtype]:.2f}x bf16's speed)")
    args.out.write_text(json.dumps(
        {"cpu": hardware.cpu_label, "cpu_flags": hardware.cpu_flags, "cores": hardware.cores, "model": MODEL,
         "recipe": q.model_dump(mode="json"), "rounds": args.rounds, "seconds": seconds, "median_seconds": medians,
         "served_dtype_here": platform.default_dtype(hardware)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
