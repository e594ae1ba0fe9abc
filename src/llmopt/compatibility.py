"""The compatibility matrix (catalog/compatibility.yaml): technique x architecture x engine x hardware.

Rules that depend only on technique, architecture and hardware are data, applied here. The rules
that need to look at the model or the machine belong to each technique (`Technique.check`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict

from llmopt.engine.platform import Hardware
from llmopt.errors import LlmoptError

MATRIX_FILE = Path(__file__).parent / "catalog" / "compatibility.yaml"


class Row(BaseModel):
    """One row of the matrix; the first row naming a technique, hardware and architecture applies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    technique: str
    hardware: str  # cpu | cuda | any
    architectures: list[str] | str  # a list, or "any"
    status: str  # supported | slow (runs, with a warning) | refused | unavailable (not built yet)
    reason: str = ""
    instead: str = ""
    # CPU flags a row needs, e.g. [amx_int8], or alternatives, "avx_vnni|amx_int8", or lacks, "!avx512f"; unset: any
    processors: list[str] | None = None

    def matches(self, technique: str, architecture: str, hardware: Hardware) -> bool:
        def has(flag: str) -> bool:
            return flag[1:] not in hardware.cpu_flags if flag.startswith("!") else flag in hardware.cpu_flags

        return (self.technique == technique and self.hardware in ("any", hardware.device)
                and (self.architectures == "any" or architecture in self.architectures)
                and (self.processors is None or all(any(map(has, need.split("|"))) for need in self.processors)))


@dataclass
class Verdict:
    refusals: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def raise_if_refused(self) -> None:
        if self.refusals:
            raise LlmoptError("recipe refused: " + "; ".join(self.refusals), "change the recipe as suggested")


@cache
def matrix() -> tuple[Row, ...]:
    return tuple(Row.model_validate(row) for row in yaml.safe_load(MATRIX_FILE.read_text()))


def apply(technique: str, architecture: str, hardware: Hardware, verdict: Verdict) -> Row | None:
    """The row for a technique on this model and machine, its refusal or warning added to the
    verdict; None when the technique may not run here at all."""
    rows = [r for r in matrix() if r.technique == technique and r.hardware in ("any", hardware.device)]
    if not rows:
        verdict.refusals.append(f"{technique} is not in the compatibility matrix for {hardware.device}")
        return None
    row = next((r for r in rows if r.matches(technique, architecture, hardware)), None)
    if row is None:
        supported = sorted({a for r in rows if isinstance(r.architectures, list) for a in r.architectures})
        verdict.refusals.append(f"{technique} is not supported for {architecture} (supported: {', '.join(supported)})")
        return None
    advice = f"{row.reason}" + (f"; instead: {row.instead}" if row.instead else "")
    if row.status in ("refused", "unavailable"):
        verdict.refusals.append(f"{technique}: {advice}")
        return None
    if row.status == "slow":
        verdict.warnings.append(f"{technique}: {advice}")
    return row
