"""What a technique is: one object that owns a recipe section through every phase of its life.

A technique declares its section's type and, for that section: the compatibility-matrix names it
answers to and the checks that need the model or the machine; its contribution to the artifact key;
the engine settings it sets; its build steps (and the memory they need at their peak); whether it
changes the model's numbers (so the measure step compares quality with the source) and what it then
requires; and what it proves on every running engine that uses its settings. The registry
(`techniques/__init__.py`) lists the techniques; planning, checking, keying, measuring and
verifying loop over it and name none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict

from llmopt import compatibility
from llmopt.engine.config import EngineConfig
from llmopt.engine.platform import Hardware
from llmopt.sources import Model


class Section(BaseModel):
    """A recipe section: typed, validated knobs that round-trip through YAML and JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class CheckContext:
    """What a technique's checks look at, and the verdict they add to."""

    target: Model
    config: dict[str, Any]  # the model's config.json
    hardware: Hardware
    engine: EngineConfig  # the settings the whole recipe asks for
    verdict: compatibility.Verdict

    @property
    def architecture(self) -> str:
        return (self.config.get("architectures") or ["unknown"])[0]


@dataclass
class BuildContext:
    """One artifact being built: the steps read and change it in turn."""

    recipe: Any  # llmopt.recipe.Recipe (built from this registry, so not importable here)
    source: Model
    workdir: Path
    engine: EngineConfig
    hardware: Hardware
    log: logging.Logger
    progress: Callable[[float], None]
    metrics: dict[str, BaseModel] = field(default_factory=dict)  # by section: what each technique recorded
    references: dict[str, Reference] = field(default_factory=dict)  # models the artifact carries, by role
    measured: Any = None  # the measure step's findings (techniques/measure.Measurements)


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[BuildContext], None]
    writes_weights: bool = False  # a step that writes the artifact's weights replaces the plain copy


class Reference(BaseModel):
    """A model an artifact carries (a draft, say), by identity and where it lies inside the artifact."""

    model_config = ConfigDict(extra="forbid")

    model: str
    content_hash: str
    path: str
    quantization: str | None = None


@dataclass(frozen=True)
class Running:
    """An engine serving with some settings: an endpoint, or a job's measuring engine."""

    url: str
    served_name: str
    log_path: Path
    headers: dict[str, str]


class Technique:
    """The base every technique derives from; each hook's default is 'nothing to do'."""

    section: ClassVar[str]  # the recipe key
    spec: ClassVar[Any]  # the section's type: a Section, or an annotated union of them
    metrics: ClassVar[type[BaseModel] | None] = None  # what its steps record in the manifest
    verification: ClassVar[type[BaseModel] | None] = None  # what it proves on a running engine

    def names(self, spec: Any) -> list[str]:
        """The compatibility matrix's names for this section."""
        return [self.section]

    def validate(self, spec: Any, recipe: Any) -> None:
        """Contradictions with the recipe's other sections: raise ValueError."""

    def configure(self, spec: Any, engine: EngineConfig) -> EngineConfig:
        """The engine settings this section sets, known before anything is built."""
        return engine

    def check_inputs(self, spec: Any) -> None:
        """The user's files this section reads, checked before a job imports its model (an import
        can take minutes) or records anything: raise LlmoptError."""

    def check(self, spec: Any, ctx: CheckContext) -> None:
        """Rules that need the model or the machine: add refusals or warnings to ctx.verdict."""

    def peak_bytes(self, spec: Any, ctx: CheckContext) -> int:
        """Memory this section's own build steps hold at their peak in the job's worker (for a
        scheduler to reserve); 0: no more than serving the artifact takes."""
        return 0

    def key(self, spec: Any, source: Model, hardware: Hardware) -> dict[str, Any]:
        """Inputs beyond the section itself that make the artifact what it is (files it reads, what
        the machine that builds it chooses)."""
        return {}

    def steps(self, spec: Any) -> list[Step]:
        return []

    def changes_numerics(self, spec: Any) -> bool:
        """Whether outputs may differ from the source's beyond bf16 ties (quality is then measured)."""
        return False

    def measure(self, spec: Any, ctx: BuildContext, served: Any) -> None:
        """Record what this section changed, with the built artifact served (techniques/served.Served)."""

    def judge(self, spec: Any, ctx: BuildContext, perplexity_increase: float, base: Any) -> None:
        """Refuse to ship when the quality cost against the source is over this section's budget."""

    def verify(self, engine: EngineConfig, running: Running) -> BaseModel | None:
        """Prove on a running engine what these settings promise; None when they promise nothing."""
        return None


def check_section(technique: Technique, spec: Any, ctx: CheckContext) -> None:
    """The matrix's rows for a section on this model and machine, then the technique's own checks
    (skipped when the matrix already refuses it here)."""
    if all(compatibility.apply(name, ctx.architecture, ctx.hardware, ctx.verdict) for name in technique.names(spec)):
        technique.check(spec, ctx)
