"""What to serve: a model folder with the exact engine flags and environment, from a store model
or from an optimized artifact's manifest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmopt import artifact, sources
from llmopt.engine import platform
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError


@dataclass
class ServingSpec:
    model_path: str
    model_label: str
    engine_args: dict[str, object]
    env: dict[str, str]

    @property
    def served_name(self) -> str:
        return str(self.engine_args["served-model-name"])

    def args(self) -> dict[str, object]:
        return dict(self.engine_args)


def for_target(target: str, config: EngineConfig | None = None) -> ServingSpec:
    """An artifact folder is served exactly as its manifest says; anything else is a model spec."""
    if artifact.is_artifact(Path(target)):
        if config is not None:
            raise LlmoptError("an artifact carries its own engine settings", "deploy it without engine flags, or optimize again")
        return artifact.load(Path(target)).serving_spec()
    model = sources.resolve(target)
    config = config or EngineConfig()
    return ServingSpec(
        model_path=model.path,
        model_label=model.id,
        engine_args=config.to_args(served_name=model.id),
        env=config.to_env(platform.detect()),
    )
