"""Docker Compose: one service running vLLM's OpenAI server in vLLM's image with the artifact's
flags and environment, the artifact folder on this machine mounted read-only, GPUs reserved
through the NVIDIA runtime; the manifest's hash is a label on the container."""

from __future__ import annotations

from typing import Any

from llmopt.exports.target import PORT, Target, dump

FILE = "docker-compose.yaml"
MODEL_DIR = "/artifact"


def render(target: Target) -> dict[str, str]:
    if target.uri is not None:
        target.refuse_uri("docker compose", "leave out the model URI: compose mounts the artifact folder from this machine")
    limits: dict[str, Any] = {"cpus": f"{target.cpus:g}", "memory": f"{round(target.memory_gib * 1024)}M"}
    deploy: dict[str, Any] = {"replicas": target.replicas, "resources": {"limits": limits}}
    if target.gpus:
        deploy["resources"]["reservations"] = {"devices": [{"driver": "nvidia", "count": target.gpus, "capabilities": ["gpu"]}]}
    last_port = PORT + target.replicas - 1  # each replica publishes one port of the range
    service: dict[str, Any] = {
        "image": target.container_image,
        "entrypoint": target.command(),
        "command": target.args(MODEL_DIR),
        "environment": target.environment(),
        "ports": [f"{PORT}:{PORT}" if last_port == PORT else f"{PORT}-{last_port}:{PORT}"],
        "volumes": [{"type": "bind", "source": str(target.root), "target": MODEL_DIR, "read_only": True}],
        "ipc": "host",  # vLLM's processes share tensors through /dev/shm; Docker's default 64 MiB is too small
        "labels": target.annotations,
        "deploy": deploy,
    }
    if not service["environment"]:
        del service["environment"]
    return {FILE: dump(target, {"services": {target.name: service}})}
