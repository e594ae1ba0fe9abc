"""Where a benchmark writes its results: the `--out` option of the scripts that take one, a file
name in results/. The name is checked as the arguments are parsed, so a path fails at once instead
of after a run of many minutes, whose rows it would lose."""

from __future__ import annotations

import argparse
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def add_out(parser: argparse.ArgumentParser, default: str | None, default_help: str | None = None) -> None:
    """`--out NAME`, parsed to its file in results/ (None when there is no default and none is given)."""
    parser.add_argument("--out", type=_in_results, default=default,
                        help=f"the results file's name in results/ (default: {default_help or default})")


def _in_results(name: str) -> Path:
    if name in ("", ".", "..") or Path(name).name != name:
        raise argparse.ArgumentTypeError(f"takes a file name in {RESULTS}, not a path: {name!r}")
    return RESULTS / name
