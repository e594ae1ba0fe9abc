"""The Python SDK: what users import. The CLI and the studio call these functions and nothing else."""

from __future__ import annotations

from llmopt import endpoints, serving, sources
from llmopt.endpoints import Endpoint
from llmopt.engine.config import EngineConfig
from llmopt.engine.vllm import DEFAULT_HOST


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
