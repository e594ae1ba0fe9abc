"""How much one deployment differs from another of the same model: the noise floor of every ratio
llmopt reports (evaluation/compare.py, NOISE).

SmolLM2-135M is deployed `ROUNDS` times in turn; each deployment runs the same workload (the
built-in QA prompts at temperature 0, so the same answers every time; 16 requests and at least
30 seconds per level, as `evaluate` runs by default) at concurrency 1 and 4. Every deployment's
requests/s is divided by the first's: the spread of those ratios is what a bootstrap within one
run cannot see. The floor it implies: a ratio of two deployments, each with the relative spread
measured here (log scale), lies within 1.96 x sqrt(2) of it 95% of the time.

    .venv/bin/python benchmarks/compare_noise.py
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import llmopt
from llmopt.engine import platform

MODEL = "smollm2-135m-instruct"
ROUNDS = 5
LEVELS = (1, 4)
RESULTS = Path(__file__).parent / "results" / "compare_noise.json"


def floor(rates: list[float]) -> float:
    """The noise floor in compare.NOISE's terms: an interval [p(1-NOISE), p/(1-NOISE)] spans 95% of
    the ratios of two deployments whose log rates spread as these do."""
    return 1 - math.exp(-1.96 * math.sqrt(2) * statistics.stdev(math.log(r) for r in rates))


def main() -> None:
    runs = []
    for _ in range(ROUNDS):
        with llmopt.deploy(MODEL) as endpoint:
            results = llmopt.evaluate(endpoint=endpoint.name, dataset="builtin-qa", concurrency=LEVELS, requests=16,
                                      min_duration_s=30, quality=False)
        runs.append({lvl.concurrency: lvl.request_throughput_per_s for lvl in results.targets[0].levels})
    table = []
    for level in LEVELS:
        ratios = [run[level] / runs[0][level] for run in runs[1:]]
        table.append({"concurrency": level, "requests_per_s": [round(run[level], 4) for run in runs],
                      "ratios_to_first": [round(r, 4) for r in ratios],
                      "largest_deviation": round(max(abs(r - 1) for r in ratios), 4),
                      "stdev": round(statistics.stdev([run[level] for run in runs]) / statistics.mean([run[level] for run in runs]), 4),
                      "floor": round(floor([run[level] for run in runs]), 4)})
    hardware = platform.detect()
    out = {"model": MODEL, "rounds": ROUNDS, "processor": hardware.cpu_label, "cores": hardware.cores, "levels": table}
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"{MODEL}, {ROUNDS} deployments in turn on {hardware.cpu_label} ({hardware.cores} cores)")
    print("concurrency | requests/s per deployment | ratio to the first | largest deviation | relative stdev | floor")
    for row in table:
        print(f"{row['concurrency']:>11} | {', '.join(f'{r:.3f}' for r in row['requests_per_s'])} | "
              f"{', '.join(f'{r:.3f}' for r in row['ratios_to_first'])} | {row['largest_deviation']:.1%} | {row['stdev']:.1%} | {row['floor']:.1%}")


if __name__ == "__main__":
    main()
