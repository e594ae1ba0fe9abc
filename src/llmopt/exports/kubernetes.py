"""Plain Kubernetes: a Deployment running vLLM's OpenAI server in vLLM's image with the artifact's
flags and environment, and a Service in front of it (ClusterIP: reachable inside the cluster only,
the server has no API key). The artifact is a folder on the node (hostPath) or a volume claim
(`pvc://claim/path`), mounted read-only; the manifest's hash is an annotation on both and on the pods."""

from __future__ import annotations

from typing import Any

from llmopt.exports.target import PORT, Target, dump

DEPLOYMENT_FILE = "deployment.yaml"
SERVICE_FILE = "service.yaml"
MODEL_DIR = "/artifact"
GPU_RESOURCE = "nvidia.com/gpu"
NAME_LABEL = "app.kubernetes.io/name"
# vLLM's processes share tensors through /dev/shm; a container's default 64 MiB is too small
SHARED_MEMORY = ({"name": "dshm", "emptyDir": {"medium": "Memory"}}, {"name": "dshm", "mountPath": "/dev/shm"})


def resources(target: Target) -> dict[str, Any]:
    """A replica's requests, and the same as limits: a guaranteed pod whose cores are its own."""
    amounts: dict[str, Any] = {"cpu": f"{target.cpus:g}", "memory": f"{target.memory_gib:g}Gi"}
    if target.gpus:
        amounts[GPU_RESOURCE] = str(target.gpus)
    return {"requests": amounts, "limits": dict(amounts)}


def env_and_resources(target: Target) -> dict[str, Any]:
    """What a serving container needs whatever runs it: the environment and the resources."""
    env = [{"name": key, "value": value} for key, value in target.environment().items()]
    return {**({"env": env} if env else {}), "resources": resources(target)}


def render(target: Target) -> dict[str, str]:
    volume, mount = _artifact_volume(target)
    selector = {NAME_LABEL: target.name}
    metadata = {"name": target.name, "labels": {**selector, "app.kubernetes.io/managed-by": "llmopt"},
                "annotations": target.annotations}
    container = {
        "name": "vllm",
        "image": target.container_image,
        "command": target.command(),
        "args": target.args(MODEL_DIR),
        **env_and_resources(target),
        "ports": [{"name": "http", "containerPort": PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "volumeMounts": [mount, SHARED_MEMORY[1]],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": target.replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": metadata["labels"], "annotations": target.annotations},
                "spec": {"containers": [container], "volumes": [volume, SHARED_MEMORY[0]]},
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {"selector": selector, "ports": [{"name": "http", "port": PORT, "targetPort": "http"}]},
    }
    return {DEPLOYMENT_FILE: dump(target, deployment), SERVICE_FILE: dump(target, service)}


def _artifact_volume(target: Target) -> tuple[dict[str, Any], dict[str, Any]]:
    """The artifact's volume and its read-only mount: the folder on the node, or a claim's sub-path."""
    mount: dict[str, Any] = {"name": "artifact", "mountPath": MODEL_DIR, "readOnly": True}
    if target.uri is None:
        return {"name": "artifact", "hostPath": {"path": str(target.root), "type": "Directory"}}, mount
    if target.scheme != "pvc":
        target.refuse_uri("a Kubernetes Deployment", "pass a pvc://claim/path URI, or export to kserve, which fetches it")
    claim, _, path = target.uri.removeprefix("pvc://").partition("/")
    if path:
        mount["subPath"] = path
    return {"name": "artifact", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}, mount
