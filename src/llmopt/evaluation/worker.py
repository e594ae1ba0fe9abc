"""The background process that runs one recorded evaluation: `python -m llmopt.evaluation.worker NAME`.
SIGTERM (from `llmopt evaluations stop`) ends it; the targets it deployed are stopped on the way out."""

from __future__ import annotations

import signal
import sys

from llmopt.errors import LlmoptError
from llmopt.evaluation import runs


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        runs.execute(sys.argv[1])
    except LlmoptError as exc:  # the record says why
        print(f"evaluation failed: {exc.one_line()}", file=sys.stderr)
        sys.exit(1)
