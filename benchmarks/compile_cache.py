"""Cold against precompiled engine starts, side by side: process start to ready, same model, same
flags, same machine.

Each round deletes the compile-cache entry for the configuration, deploys (a cold start: vLLM
compiles and llmopt's compile cache stores the code), stops, and deploys again (a precompiled
start: the code is loaded, nothing is compiled). Reports the medians and their ratio, and checks
that every precompiled start compiled nothing. Writes benchmarks/results/compile_cache.json.
Usage: python benchmarks/compile_cache.py [rounds]
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

import llmopt
from llmopt import EngineConfig, sources
from llmopt.engine import compile_cache, platform

MODEL = "smollm2-135m-instruct"
ENGINE = EngineConfig(max_model_len=4096, max_num_seqs=16)


def start() -> compile_cache.Start:
    with llmopt.deploy(MODEL, engine=ENGINE) as endpoint:
        return endpoint.start


def main(rounds: int) -> None:
    cold, warm = [], []
    for r in range(rounds):
        entry = compile_cache.entry_for(sources.resolve(MODEL).path, ENGINE, platform.detect())
        shutil.rmtree(entry.path)  # this round's cold start begins from nothing
        first = start()
        second = start()
        assert first.outcome == "compiled" and second.outcome == "precompiled", (first, second)
        cold.append(first.ready_seconds)
        warm.append(second.ready_seconds)
        print(f"round {r + 1}: cold {cold[-1]:.1f} s, precompiled {warm[-1]:.1f} s "
              f"({second.compiled_files_added} files compiled)", flush=True)
    row = {"model": MODEL, "engine": ENGINE.model_dump(mode="json"), "rounds": rounds, "cold_s": cold, "precompiled_s": warm,
           "cold_median_s": statistics.median(cold), "precompiled_median_s": statistics.median(warm)}
    row["ratio"] = round(row["precompiled_median_s"] / row["cold_median_s"], 3)
    print(f"\ncold start median {row['cold_median_s']:.1f} s, precompiled {row['precompiled_median_s']:.1f} s: {row['ratio']}x")
    out = Path(__file__).parent / "results" / "compile_cache.json"
    out.write_text(json.dumps(row, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
