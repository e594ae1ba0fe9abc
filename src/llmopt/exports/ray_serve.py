"""Ray Serve: a Serve config file (`serve run` / `serve deploy ray-serve.yaml`) for Ray Serve LLM's
OpenAI application (`ray.serve.llm:build_openai_app`) with one LLMConfig: the artifact's engine
settings as vLLM engine arguments (`engine_kwargs`), `num_replicas` replicas, each a placement
group of one bundle per tensor-parallel shard, and the environment llmopt would set. Ray loads the
artifact from a path every node can read (a shared filesystem): the folder's own, or a file:// URI.
Serve configs carry no labels, so the manifest's hash is in the replicas' environment."""

from __future__ import annotations

from typing import Any

from llmopt.errors import LlmoptError
from llmopt.exports.target import Target, dump

FILE = "ray-serve.yaml"
APPLICATION = "ray.serve.llm:build_openai_app"
HASH_ENV = "LLMOPT_CONTENT_HASH"


def render(target: Target) -> dict[str, str]:
    if target.image is not None:
        raise LlmoptError("a Ray Serve application runs in the Ray cluster's image", "leave out the image; set it in the cluster's configuration")
    model_dir = _model_dir(target)
    shards = target.engine(model_dir).tensor_parallel_size
    bundle: dict[str, float] = {"CPU": target.cpus / shards, "memory": int(target.memory_gib * 2**30 / shards)}
    if target.gpus:
        bundle["GPU"] = 1
    llm_config: dict[str, Any] = {
        "model_loading_config": {"model_id": target.served_name, "model_source": model_dir},
        "engine_kwargs": target.engine_kwargs(model_dir),
        "accelerator_config": {"kind": "gpu" if target.gpus else "cpu"},
        "placement_group_config": {"bundle_per_worker": bundle},
        "deployment_config": {"num_replicas": target.replicas},
        "runtime_env": {"env_vars": {**target.environment(), HASH_ENV: target.manifest.content_hash}},
    }
    application = {"name": target.name, "route_prefix": "/", "import_path": APPLICATION, "args": {"llm_configs": [llm_config]}}
    return {FILE: dump(target, {"applications": [application]})}


def _model_dir(target: Target) -> str:
    """Where the nodes read the artifact: a remote URI would be downloaded to a folder Ray picks,
    where the settings' draft path could not point."""
    if target.uri is None:
        return str(target.root)
    if target.scheme != "file":
        target.refuse_uri("Ray Serve", "pass the folder's path on the Ray nodes as a file:// URI, or export to kserve")
    return target.uri.removeprefix("file://")
