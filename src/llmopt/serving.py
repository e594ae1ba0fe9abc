"""What to serve, and serving it: a model folder with its engine settings, from an optimized
artifact's manifest or from a store model, deployed as an endpoint that has proven, before it is
called ready, everything its settings promise."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt import artifact, chat_templates, endpoints, locations, names, sources, techniques
from llmopt.endpoints import Endpoint
from llmopt.engine import platform, vllm
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError
from llmopt.jobs import store
from llmopt.techniques.base import Running


@dataclass(frozen=True)
class ServingSpec:
    model_path: str
    model_label: str
    served_name: str
    engine: EngineConfig  # with paths located for model_path
    compiled_code_trusted: bool = False  # an artifact a job of this home built: its compile-cache copy may load
    is_artifact: bool = False

    @property
    def has_chat_template(self) -> bool:
        return chat_templates.present(Path(self.model_path))


def for_target(target: str, engine: EngineConfig | None = None) -> ServingSpec:
    """An artifact folder, or an artifact's URI (fetched into a verified local copy), is served
    exactly as its manifest says; anything else is a model spec."""
    path = locations.fetch(target) if locations.is_uri(target) else Path(target).expanduser()
    if artifact.is_artifact(path):
        if engine is not None:
            raise LlmoptError("an artifact carries its own engine settings", "deploy it without engine flags, or optimize again")
        root = path.resolve()
        manifest = artifact.verify(root)
        return ServingSpec(str(root), manifest.name, manifest.engine.served_name,
                           vllm.for_checkpoint(manifest.located_engine(root), root, platform.detect()),
                           store.built_here(manifest.content_hash), is_artifact=True)
    model = sources.resolve(target)
    return ServingSpec(model.path, model.id, model.id, vllm.for_checkpoint(engine or EngineConfig(), model.path, platform.detect()))


def deploy(
    spec: ServingSpec,
    name: str | None = None,
    port: int | None = None,
    host: str = vllm.DEFAULT_HOST,
    timeout_s: float = endpoints.DEFAULT_READY_TIMEOUT_S,
    api_key: str | None = None,
    insecure: bool = False,
    trust_remote_code: bool = False,
    temporary: bool = False,
    chat_template: str | Path | None = None,
    trust_compiled_code: bool = False,
) -> Endpoint:
    """Start an endpoint for `spec`; it is READY once it answers and every technique has verified it.
    Remote code in a model folder runs only when the caller asks for it (`trust_remote_code`), and
    an artifact's compiled code (its compile-cache copy) loads only where a job of this home built
    it or the caller asks for it (`trust_compiled_code`); otherwise the engine compiles. A
    `temporary` endpoint (one a run deploys for itself) is stopped when the process that deployed it dies.
    A model with no chat template of its own takes `chat_template` (a file); without one, chat
    requests are answered with what to do."""
    name = name or f"{names.slug(spec.served_name, 'endpoint')[:55]}-{secrets.token_hex(3)}"
    template = str(Path(chat_template).expanduser().resolve()) if chat_template else None
    if template is not None:
        chat_templates.read(Path(template))
    return endpoints.launch(spec.model_path, spec.model_label, spec.served_name, spec.engine, name, _verify,
                            port=port, host=host, timeout_s=timeout_s, api_key=api_key, insecure=insecure,
                            trust_remote_code=trust_remote_code, temporary=temporary, chat_template=template,
                            chat=spec.has_chat_template,
                            compiled_code_trusted=spec.compiled_code_trusted or (trust_compiled_code and spec.is_artifact))


def _verify(endpoint: Endpoint) -> dict[str, Any]:
    running = Running(endpoint.url, endpoint.served_name, Path(endpoint.log_path), endpoint.headers)
    return {section: proof.model_dump(mode="json") for section, proof in techniques.verify(endpoint.engine, running).items()}
