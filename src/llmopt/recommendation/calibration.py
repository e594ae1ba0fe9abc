"""How long candidates took on this machine against their estimates, kept so that the next
estimates here follow the machine.

`candidates.estimate_seconds` is fitted on one processor (2 cores of a Zen 4 EPYC) from the model's
size and the core count. Another processor moves every candidate alike: on a Zen 5 EPYC of the same
name and cores, SmolLM2-135M's candidates took 0.42-0.84x their estimates. Each candidate that
finishes keeps its time over its unscaled estimate, per machine (processor, signature, cores), and a
new run scales its estimates by the median of the last ones, once there are a few."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from llmopt import paths
from llmopt.engine.platform import Hardware

KEPT = 24  # the last ratios kept
AT_LEAST = 3  # ratios before they scale an estimate
BOUNDS = (0.25, 4.0)  # a scale outside these says more about a broken run than about the machine


def _fact(hardware: Hardware) -> Path:
    return paths.engine_fact(f"recommend-timings-{hardware.slug}.json")


def ratios(hardware: Hardware) -> list[float]:
    """The last candidates' times over their unscaled estimates on this machine, oldest first."""
    try:
        found = json.loads(_fact(hardware).read_text())
    except (OSError, ValueError):
        return []
    return [float(r) for r in found if isinstance(r, (int, float)) and r > 0][-KEPT:] if isinstance(found, list) else []


def scale(hardware: Hardware) -> float:
    """What this machine's estimates are multiplied by: 1 until it has timed a few candidates."""
    found = ratios(hardware)
    if len(found) < AT_LEAST:
        return 1.0
    return round(min(max(statistics.median(found), BOUNDS[0]), BOUNDS[1]), 3)


def record(hardware: Hardware, unscaled_estimate_s: float, seconds: float) -> None:
    """Keep one finished candidate's time against what `estimate_seconds` said for it."""
    if unscaled_estimate_s > 0 and seconds > 0:
        paths.keep_fact(_fact(hardware), json.dumps((ratios(hardware) + [round(seconds / unscaled_estimate_s, 4)])[-KEPT:]))
