"""KServe: an InferenceService for KServe's Hugging Face serving runtime with its vLLM backend,
which takes vLLM's own engine flags. KServe's storage initializer fetches the artifact from
`model_uri` (its storageUri: s3://, gs://, pvc://, hf://, https://) into the runtime's model folder;
the manifest's hash is an annotation, which KServe passes on to the pods."""

from __future__ import annotations

from typing import Any

from llmopt.errors import LlmoptError
from llmopt.exports import kubernetes
from llmopt.exports.target import Target, dump

FILE = "inferenceservice.yaml"
MODEL_DIR = "/mnt/models"  # where the storage initializer puts storageUri, and the runtime loads from
RUNTIME_ARGS = ["--backend=vllm"]  # the Hugging Face runtime's own: serve with vLLM, never its fallback


def render(target: Target) -> dict[str, str]:
    if target.uri is None:
        raise LlmoptError("KServe fetches the artifact from storage, and no model URI was given",
                          "upload the artifact folder and pass its URI, e.g. model_uri='s3://bucket/artifact'")
    model: dict[str, Any] = {
        "modelFormat": {"name": "huggingface"},
        "storageUri": target.uri,
        "args": [*RUNTIME_ARGS, *target.flags(MODEL_DIR)],
        **kubernetes.env_and_resources(target),
    }
    if target.image:
        model["image"] = target.image
    service = {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": target.name, "annotations": target.annotations},
        "spec": {"predictor": {"minReplicas": target.replicas, "maxReplicas": target.replicas, "model": model}},
    }
    return {FILE: dump(target, service)}

