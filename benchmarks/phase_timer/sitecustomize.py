"""Imported by every Python process whose PYTHONPATH holds this folder: `served_step.py` gives it to
a server, whose forked engine core then times vLLM's phases (`phase_timer`)."""

import os
from pathlib import Path

import phase_timer  # the standard library's only

if os.environ.get(phase_timer.ENV):
    phase_timer.serve_in_background(Path(os.environ[phase_timer.ENV]))
