"""Imported by every Python process whose PYTHONPATH holds this folder: `served_step.py` gives it to
a server, whose forked engine core then times vLLM's phases (`phase_timer`)."""

import os
from pathlib import Path

if os.environ.get("LLMOPT_PHASE_TIMES"):  # phase_timer.ENV, not imported unless asked
    import phase_timer

    phase_timer.serve_in_background(Path(os.environ[phase_timer.ENV]))
