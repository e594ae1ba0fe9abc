"""A model or an optimized artifact served with each of Inductor's graph wrappers in turn (Python's,
vLLM's default, and the C++ one), output tokens/s and time between tokens at each of
`engine_cpu_settings.LEVELS`. An artifact carries its own engine settings and takes none at deploy,
so the wrapper is chosen here by patching `platform.default_graph_wrapper` in this process, where
deploy renders vLLM's flags and the compile cache's key; everything else is llmopt's choice.
Writes results/graph_wrapper.json (or `--out`).

    .venv/bin/python benchmarks/graph_wrapper.py [--model M] [--repeat N] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
from unittest import mock

import results_file
from engine_cpu_settings import LEVELS, deploy_and_measure
from llmopt.engine import platform

WRAPPERS = ("python", "cpp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a catalogued or imported model, or an artifact's folder")
    parser.add_argument("--repeat", type=int, default=3, help="take the two wrappers in turn this many times")
    results_file.add_out(parser, "graph_wrapper.json")
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeat):
        for wrapper in WRAPPERS:
            with mock.patch.object(platform, "default_graph_wrapper", lambda hw, chosen=wrapper: chosen):
                row = deploy_and_measure(f"{wrapper} wrapper", None, {}, None, model=args.model) | {"wrapper": wrapper}
            rows.append(row)
            print(f"{row['config']:<16} ready {row['ready_s']:>6} s  " + "  ".join(
                f"c={level} {row[f'out_tok_s_c{level}']:>7} tok/s (ITL p50 {row[f'itl_p50_ms_c{level}']} ms)" for level in LEVELS), flush=True)
    medians = {w: {f"out_tok_s_c{level}": statistics.median(r[f"out_tok_s_c{level}"] for r in rows if r["wrapper"] == w)
                   for level in LEVELS} for w in WRAPPERS}
    for w, median in medians.items():
        print(f"median of {args.repeat}, {w} wrapper: " + "  ".join(f"{k} {v}" for k, v in median.items()))
    args.out.write_text(json.dumps({"processor": platform.detect().cpu_label, "model": args.model, "rows": rows,
                                    "medians": medians}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
