"""A model or an optimized artifact served with each of two ways of running its compiled graph in
turn: Inductor's graph wrappers (`--compare wrapper`: Python's, vLLM's default, and the C++ one) or
what Inductor compiles on a CPU (`--compare graph`: the whole graph, vLLM's CPU default, or its
pieces split at the attention ops), output tokens/s and time between tokens at each of
`engine_cpu_settings.LEVELS`. An artifact carries its own engine settings and takes none at deploy,
so the choice is made here by patching `platform.default_graph_wrapper` or
`platform.default_compiled_graph` in this process, where deploy renders vLLM's flags and
environment and the compile cache's key; everything else is llmopt's choice. Writes
results/graph_wrapper.json (or `--out`).

    .venv/bin/python benchmarks/graph_wrapper.py [--compare wrapper|graph] [--model M] [--repeat N] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
from unittest import mock

import results_file
from engine_cpu_settings import LEVELS, deploy_and_measure
from llmopt.engine import platform

CHOICES = {"wrapper": ("default_graph_wrapper", ("python", "cpp")),
           "graph": ("default_compiled_graph", ("whole", "piecewise"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=CHOICES, default="wrapper", help="the graph's wrappers, or whole against piecewise")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a catalogued or imported model, or an artifact's folder")
    parser.add_argument("--repeat", type=int, default=3, help="take the two choices in turn this many times")
    results_file.add_out(parser, "graph_wrapper.json")
    args = parser.parse_args()
    default, choices = CHOICES[args.compare]
    rows = []
    for _ in range(args.repeat):
        for choice in choices:
            with mock.patch.object(platform, default, lambda *args, chosen=choice: chosen):
                row = deploy_and_measure(f"{choice} {args.compare}", None, {}, None, model=args.model) | {args.compare: choice}
            rows.append(row)
            print(f"{row['config']:<16} ready {row['ready_s']:>6} s  " + "  ".join(
                f"c={level} {row[f'out_tok_s_c{level}']:>7} tok/s (ITL p50 {row[f'itl_p50_ms_c{level}']} ms)" for level in LEVELS), flush=True)
    medians = {c: {f"out_tok_s_c{level}": statistics.median(r[f"out_tok_s_c{level}"] for r in rows if r[args.compare] == c)
                   for level in LEVELS} for c in choices}
    for c, median in medians.items():
        print(f"median of {args.repeat}, {c} {args.compare}: " + "  ".join(f"{k} {v}" for k, v in median.items()))
    args.out.write_text(json.dumps({"processor": platform.detect().cpu_label, "model": args.model, "compare": args.compare,
                                    "rows": rows, "medians": medians}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
