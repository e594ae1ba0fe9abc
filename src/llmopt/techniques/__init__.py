"""Techniques: each turns a recipe section into work on the artifact being built.

A step is a function of the build context. It may rewrite the weights in the work folder, add
files (a draft model, a compile cache), change the engine settings, or record metrics. `plan`
orders the steps a recipe needs; the job runner runs them and reports progress per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from llmopt.engine.config import EngineConfig
from llmopt.engine.platform import Hardware
from llmopt.recipe import Recipe
from llmopt.sources import Model


@dataclass
class BuildContext:
    recipe: Recipe
    source: Model
    workdir: Path
    engine: EngineConfig
    hardware: Hardware
    log: logging.Logger
    progress: Callable[[float], None]
    metrics: dict[str, Any] = field(default_factory=dict)
    references: dict[str, Any] = field(default_factory=dict)  # models the artifact points at, by hash


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[BuildContext], None]


def plan(recipe: Recipe) -> list[Step]:
    from llmopt.techniques import compilation, measure, package, quantize, settings, speculative

    steps = [Step("quantize", quantize.apply) if recipe.quantization else Step("weights", package.copy_weights)]
    if recipe.kv_cache or recipe.sharding:
        steps.append(Step("engine-settings", settings.apply))
    if recipe.speculative:
        steps.append(Step("speculative", speculative.apply))
        if recipe.speculative.disable_above_batch == "auto":
            steps.append(Step("speculation-sweep", speculative.sweep))
    if recipe.compilation:
        steps.append(Step("compile", compilation.apply))
    steps.append(Step("measure", measure.run))
    return steps
