"""The supported-models matrix from real runs: every architecture of llmopt.coverage through import,
each quantization scheme, n-gram speculation and a deploy with a completion, on this machine.
Writes src/llmopt/catalog/coverage.json (what `llmopt models matrix` shows) and the README's table
between its markers, so both come from the same runs.

    .venv/bin/python benchmarks/coverage.py [MODEL_TYPE ...]
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

from llmopt import coverage

README = Path(__file__).resolve().parent.parent / "README.md"
MARKERS = ("<!-- coverage:start -->", "<!-- coverage:end -->")


def main() -> None:
    chosen = sys.argv[1:] or list(coverage.ARCHITECTURES)
    with tempfile.TemporaryDirectory() as scratch:
        for model_type in chosen:
            started = time.monotonic()
            outcomes = coverage.run(model_type, Path(scratch))
            coverage.save(outcomes)
            print(f"{model_type}: {', '.join(f'{o.technique} {o.status}' for o in outcomes)} ({time.monotonic() - started:.0f} s)")
    table = coverage.markdown(coverage.load())
    text = README.read_text()
    start, end = MARKERS
    README.write_text(re.sub(f"{re.escape(start)}.*?{re.escape(end)}", lambda _: f"{start}\n{table}{end}", text, flags=re.S))
    print(table)


if __name__ == "__main__":
    main()
