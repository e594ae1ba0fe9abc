"""How long importing a catalogued GGUF model takes, with gguf's own reader against llmopt's
(`llmopt.gguf.read`: the same parse over the mapped file viewed as a plain array), side by side.

Each round parses the model's GGUF with each reader in turn (and checks both see the same fields and
tensor bytes), then imports the model twice into this script's home, once with each reader behind
the conversion (`sources.import_model` under a fresh name each time, so nothing is reused). The
first pass's imports carry torch's and transformers' imports and are not counted.

    LLMOPT_HOME=/tmp/bench-home .venv/bin/python benchmarks/model_import.py [--model ID] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import numpy as np
from results_file import add_out

from llmopt import catalog, gguf, sources
from llmopt.engine import platform


def _same(stock: Any, ours: Any) -> bool:
    fields = all(len(a.data) == len(b.data) and all(np.array_equal(a.parts[i], b.parts[i]) for i in a.data)
                 for a, b in zip(stock.fields.values(), ours.fields.values()))
    return fields and list(stock.fields) == list(ours.fields) and all(
        x.name == y.name and np.array_equal(x.data, y.data) for x, y in zip(stock.tensors, ours.tensors))


def _timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=catalog.DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    add_out(parser, "model_import.json")
    args = parser.parse_args()
    from gguf.gguf_reader import GGUFReader

    entry = catalog.get(args.model)
    files = entry.weight_files()
    if len(files) != 1:
        raise SystemExit(f"{args.model} ships in {len(files)} parts; this script times single-file GGUFs")
    path = files[0]
    readers = {"gguf's reader": lambda p, mode="r": GGUFReader(str(p), mode), "llmopt's reader": gguf.read}
    ours = gguf._reader_class
    rows: dict[str, dict[str, list[float]]] = {name: {"parse_s": [], "import_s": []} for name in readers}
    for round_ in range(args.rounds + 1):
        parsed = {}
        for name, reader in readers.items():
            seconds = _timed(lambda: parsed.setdefault(name, reader(path)))
            if round_:
                rows[name]["parse_s"].append(round(seconds, 2))
        if not _same(*parsed.values()):
            raise SystemExit("the two readers disagree on the file's fields or tensors")
        for name, reader in readers.items():
            gguf._reader_class = (lambda: GGUFReader) if name == "gguf's reader" else ours
            tag = "stock" if name == "gguf's reader" else "llmopt"
            seconds = _timed(lambda: sources.import_model(str(path), name=f"bench-{tag}-{round_}-{time.time_ns()}"))
            gguf._reader_class = ours
            if round_:
                rows[name]["import_s"].append(round(seconds, 2))
    hardware = platform.detect()
    table = {name: {**row, "parse_median_s": statistics.median(row["parse_s"]),
                    "import_median_s": statistics.median(row["import_s"])} for name, row in rows.items()}
    out = {"model": args.model, "file": path.name, "size_bytes": path.stat().st_size, "rounds": args.rounds,
           "processor": hardware.cpu_label, "cores": hardware.cores, "readers": table}
    args.out.write_text(json.dumps(out, indent=2))
    print(f"{args.model} ({path.name}, {path.stat().st_size / 1e6:.0f} MB), {args.rounds} rounds on {hardware.cpu_label}")
    print("reader | parse (s, by round) | median | whole import (s, by round) | median")
    for name, row in table.items():
        print(f"{name} | {', '.join(map(str, row['parse_s']))} | {row['parse_median_s']} | "
              f"{', '.join(map(str, row['import_s']))} | {row['import_median_s']}")


if __name__ == "__main__":
    main()
