"""The Python SDK: what users import. The CLI and the studio call these functions and nothing else."""

from __future__ import annotations

from pathlib import Path

from llmopt import artifact, endpoints, serving, sources
from llmopt import recipe as recipes
from llmopt.endpoints import Endpoint
from llmopt.engine import vllm
from llmopt.engine.config import EngineConfig
from llmopt.engine.vllm import DEFAULT_HOST
from llmopt.jobs import runner
from llmopt.jobs.runner import Job
from llmopt.recipe import Recipe


def import_model(spec: str, name: str | None = None) -> sources.Model:
    """Import a catalogue id, a Hugging Face folder or a GGUF file into the model store."""
    return sources.import_model(spec, name=name)


def deploy(
    model: str,
    name: str | None = None,
    port: int | None = None,
    host: str = DEFAULT_HOST,
    engine: EngineConfig | None = None,
    timeout_s: float = endpoints.DEFAULT_READY_TIMEOUT_S,
) -> Endpoint:
    """Serve a model or an optimized artifact; returns once the endpoint answers.

    `model` is an artifact folder, an imported model, a catalogue id, a Hugging Face folder or a
    GGUF file (the last three are imported on first use).
    """
    spec = serving.for_target(model, engine)
    return endpoints.deploy(spec, name=name, port=port, host=host, timeout_s=timeout_s)


def optimize(
    model: str,
    recipe: Recipe | str | dict = "baseline",
    name: str | None = None,
    output: str | None = None,
    force: bool = False,
    wait: bool = True,
) -> Job:
    """Run a recipe on a model in a background job that writes one self-contained artifact.

    The same recipe on the same source reuses the earlier artifact unless `force` is set.
    """
    if isinstance(recipe, str):
        recipe = recipes.load(recipe)
    elif isinstance(recipe, dict):
        recipe = recipes.parse(recipe)
    job = runner.create(model, recipe, name=name, output=output, force=force)
    return job.wait() if wait else job


def export_command(artifact_dir: str, host: str = DEFAULT_HOST, port: int = 8000) -> str:
    """The plain vLLM command that serves an artifact without llmopt."""
    spec = artifact.load(Path(artifact_dir)).serving_spec()
    return vllm.shell_command(vllm.server_argv(spec.model_path, spec.args(), host, port), spec.env)
