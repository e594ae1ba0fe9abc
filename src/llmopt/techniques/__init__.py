"""Techniques: the registry of what a recipe can ask for, and the loops over it.

Each technique is one object in one module (see `base.Technique`): its recipe section, checks,
artifact-key inputs, engine settings, build steps, what the measure step records and what a deploy
proves. Adding one is a module and a line in REGISTRY; nothing below names a technique.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel

from llmopt import compatibility
from llmopt.engine.config import EngineConfig
from llmopt.engine.platform import Hardware
from llmopt.sources import Model
from llmopt.techniques import chunked_prefill, compilation, kv_cache, quantization, sharding, speculative
from llmopt.techniques.base import CheckContext, Running, Step, Technique, check_section

# In the order their steps run: weights first, the sweep before compiling (its schedule is part of
# the compiled shapes).
REGISTRY: tuple[Technique, ...] = (
    quantization.TECHNIQUE,
    kv_cache.TECHNIQUE,
    sharding.TECHNIQUE,
    speculative.TECHNIQUE,
    compilation.TECHNIQUE,
    chunked_prefill.TECHNIQUE,
)


def active(recipe: Any) -> Iterator[tuple[Technique, Any]]:
    """The techniques a recipe uses, with their sections."""
    for technique in REGISTRY:
        spec = getattr(recipe, technique.section)
        if spec is not None:
            yield technique, spec


def names(recipe: Any) -> list[str]:
    """The recipe's techniques as the compatibility matrix names them."""
    return [name for technique, spec in active(recipe) for name in technique.names(spec)]


def engine(recipe: Any, base: EngineConfig | None = None) -> EngineConfig:
    """The engine settings a recipe asks for, before anything is built."""
    config = base or EngineConfig()
    for technique, spec in active(recipe):
        config = technique.configure(spec, config)
    return EngineConfig.model_validate(config.model_dump())  # copies skip validation: the sections together must hold


def check_inputs(recipe: Any) -> None:
    """The files the recipe names (a calibration set), before any model is imported."""
    for technique, spec in active(recipe):
        technique.check_inputs(spec)


def check(recipe: Any, target: Model, hardware: Hardware) -> compatibility.Verdict:
    """Every section against the matrix, then its technique's own checks, for this model and machine."""
    ctx = _context(recipe, target, hardware)
    for technique, spec in active(recipe):
        check_section(technique, spec, ctx)
    return ctx.verdict


def peak_bytes(recipe: Any, target: Model, hardware: Hardware) -> int:
    """The most memory any section's own build steps hold at once (0: none says it needs any)."""
    ctx = _context(recipe, target, hardware)
    return max((technique.peak_bytes(spec, ctx) for technique, spec in active(recipe)), default=0)


def _context(recipe: Any, target: Model, hardware: Hardware) -> CheckContext:
    return CheckContext(target, json.loads((Path(target.path) / "config.json").read_text()), hardware, engine(recipe),
                        compatibility.Verdict())


def key_extras(recipe: Any, source: Model, hardware: Hardware) -> dict[str, Any]:
    """What each section reads beyond itself (files, other models) and what the building machine
    chooses for it (the dtype quantizing runs in), for the artifact key."""
    return {f"{technique.section}.{k}": v for technique, spec in active(recipe)
            for k, v in technique.key(spec, source, hardware).items()}


def steps(recipe: Any) -> list[Step]:
    """Each section's build steps, in the registry's order."""
    return [step for technique, spec in active(recipe) for step in technique.steps(spec)]


def verify(config: EngineConfig, running: Running) -> dict[str, BaseModel]:
    """What every technique proves on a running engine with these settings (any deploy, any job)."""
    proven = {}
    for technique in REGISTRY:
        result = technique.verify(config, running)
        if result is not None:
            proven[technique.section] = result
    return proven
