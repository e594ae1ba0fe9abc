"""An endpoint's live metrics, read from its Prometheus text (`/metrics`) without knowing which
engine wrote it: the namespaced series (`engine:name`), summed over their labels; counters with
their rate since the last read, histograms as their mean."""

from __future__ import annotations

import time
from dataclasses import dataclass

HISTOGRAM_PARTS = ("_bucket", "_sum", "_count", "_created")


@dataclass(frozen=True)
class Reading:
    name: str
    value: float
    kind: str  # gauge | counter | mean
    per_second: float | None = None


def parse(text: str) -> dict[str, float]:
    """Every namespaced sample, summed over its label sets."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[:line.index("{")], line[line.rindex("}") + 1:].split()
        else:
            name, *rest = line.split()
        if ":" not in name or not rest:
            continue
        try:
            totals[name] = totals.get(name, 0.0) + float(rest[0])
        except ValueError:
            continue
    return totals


class Meter:
    """Readings of one endpoint, with counter rates against its previous scrape."""

    def __init__(self) -> None:
        self.previous: tuple[float, dict[str, float]] | None = None

    def read(self, text: str, now: float | None = None) -> list[Reading]:
        now = time.monotonic() if now is None else now
        samples = parse(text)
        before = self.previous
        self.previous = (now, samples)
        readings = []
        for name, value in sorted(samples.items()):
            if name.endswith("_sum") and name.removesuffix("_sum") + "_count" in samples:
                count = samples[name.removesuffix("_sum") + "_count"]
                readings.append(Reading(name.removesuffix("_sum"), value / count if count else 0.0, "mean"))
            elif name.endswith(HISTOGRAM_PARTS):
                continue
            elif name.endswith("_total"):
                rate = None
                if before is not None and now > before[0] and name in before[1]:
                    rate = max(0.0, value - before[1][name]) / (now - before[0])
                readings.append(Reading(name.removesuffix("_total"), value, "counter", rate))
            else:
                readings.append(Reading(name, value, "gauge"))
        return readings
