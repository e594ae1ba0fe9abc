"""What every export format shares: the artifact (its manifest, checked against its files) and the
machine it is exported for, as the caller describes it (replicas, CPUs, memory, GPUs), never the
machine the export runs on. The engine layer renders the flags and environment for that machine,
so an export serves exactly what llmopt would, and holds no library path found here."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

from llmopt import artifact
from llmopt.engine import vllm
from llmopt.engine.config import EngineConfig
from llmopt.engine.platform import Hardware
from llmopt.errors import LlmoptError

HOST = "0.0.0.0"  # inside a container: every interface; the platform's network decides who reaches it
PORT = 8000
OVERHEAD_GIB = 2  # the server's own memory beyond weights and KV cache
HASH_KEY = "llmopt/content-hash"  # annotation (or label) a deployment can be checked against the manifest by
ARTIFACT_KEY = "llmopt/artifact"
URI = re.compile(r"([a-z][a-z0-9+.-]*)://\S+")


@dataclass(frozen=True)
class Target:
    """An artifact and the machine each replica of its deployment gets."""

    root: Path  # the artifact on this machine
    manifest: artifact.Manifest
    replicas: int
    cpus: float
    memory_gib: float
    gpus: int
    image: str | None  # None: vLLM's image for the artifact's engine version
    uri: str | None  # where a cluster fetches the artifact from, fsspec-style (s3://, gs://, pvc://, file://)

    @property
    def hardware(self) -> Hardware:
        """A replica's machine, as the engine layer renders settings for it."""
        return Hardware(device="cuda" if self.gpus else "cpu", cpu_model="export target", cores=max(1, math.ceil(self.cpus)),
                        memory_gib=self.memory_gib, cpu_flags=(), gpu=None, gpu_count=self.gpus)

    @property
    def name(self) -> str:
        """The artifact's name as Kubernetes names a Service (a DNS-1035 label)."""
        label = re.sub(r"[^a-z0-9-]+", "-", self.manifest.name).strip("-")
        return ("llm-" + label if not label[:1].isalpha() else label)[:63].rstrip("-")

    @property
    def served_name(self) -> str:
        return self.manifest.engine.served_name

    @property
    def scheme(self) -> str | None:
        match = URI.fullmatch(self.uri) if self.uri else None
        return match.group(1) if match else None

    @property
    def annotations(self) -> dict[str, str]:
        return {ARTIFACT_KEY: self.manifest.name, HASH_KEY: self.manifest.content_hash}

    @property
    def container_image(self) -> str:
        return self.image or vllm.image(self.manifest.engine.version, self.hardware.device)

    def engine(self, model_dir: str) -> EngineConfig:
        """The manifest's settings, with the artifact's own paths (the draft) where `model_dir` puts it."""
        return self.manifest.located_engine(Path(model_dir))

    def flags(self, model_dir: str) -> list[str]:
        return vllm.flags(self.engine(model_dir), self.served_name, hw=self.hardware)

    def engine_kwargs(self, model_dir: str) -> dict[str, object]:
        return vllm.engine_kwargs(self.engine(model_dir), self.hardware)

    def environment(self) -> dict[str, str]:
        return vllm.image_environment(self.manifest.engine.settings, self.hardware)

    def command(self) -> list[str]:
        """The program vLLM's image runs to serve (its own entrypoint varies between versions)."""
        return vllm.server_command(vllm.IMAGE_PYTHON)

    def args(self, model_dir: str) -> list[str]:
        return vllm.server_args(model_dir, self.engine(model_dir), self.served_name, HOST, PORT, hw=self.hardware)

    def refuse_uri(self, fmt: str, fix: str) -> NoReturn:
        raise LlmoptError(f"{fmt} cannot fetch the artifact from '{self.uri}'", fix)


def describe(root: Path, replicas: int = 1, cpus: float | None = None, memory_gib: float | None = None, gpus: int = 0,
             image: str | None = None, model_uri: str | None = None) -> Target:
    """The export target, checked: the artifact whole, the resources possible, one GPU per
    tensor-parallel shard. Unset CPUs: the cores the artifact was measured on (on GPUs, one per GPU
    worker plus two for the engine core and the API server); unset memory: weights, the KV cache on
    CPU, and the server's overhead."""
    manifest = artifact.verify(root.resolve())
    shards = manifest.engine.settings.tensor_parallel_size
    if not isinstance(replicas, int) or replicas < 1:
        raise LlmoptError(f"replicas {replicas} is not a count of replicas", "pass 1 or more")
    if not isinstance(gpus, int) or gpus < 0:
        raise LlmoptError(f"gpus {gpus} is not a count of GPUs", "pass 0 (CPU) or more")
    if (gpus and gpus != shards) or (not gpus and shards > 1):
        raise LlmoptError(f"the artifact shards the model over {shards} device(s) (tensor parallelism) but {gpus} GPU(s) "
                          "were asked for each replica", f"pass gpus={shards}, and replicas to scale out")
    if (cpus is not None and not cpus > 0) or (memory_gib is not None and not memory_gib > 0):
        raise LlmoptError(f"cpus {cpus} and memory {memory_gib} GiB must be positive", "pass positive numbers, or leave them out")
    if model_uri is not None and not URI.fullmatch(model_uri):
        raise LlmoptError(f"model URI '{model_uri}' is not a URI", "pass one such as s3://bucket/artifact or pvc://claim/artifact")
    if cpus is None:
        cpus = float(gpus + 2 if gpus else manifest.hardware.cores)
    if memory_gib is None:
        kv_cache = 0 if gpus else manifest.engine.settings.kv_cache_gib
        memory_gib = float(math.ceil(manifest.metrics.size_bytes / 2**30 + kv_cache + OVERHEAD_GIB))
    return Target(root.resolve(), manifest, replicas, cpus, memory_gib, gpus, image, model_uri)


def dump(target: Target, document: dict[str, Any]) -> str:
    """One YAML document, headed by what it serves."""
    manifest = target.manifest
    header = (f"# llmopt export of artifact '{manifest.name}' (content hash {manifest.content_hash}),\n"
              f"# built with {manifest.engine.name} {manifest.engine.version}: its engine settings, exactly.\n")
    return header + yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=1 << 16)


class _Dumper(yaml.SafeDumper):
    """Every value written out where it is used: no anchors for what two places share."""

    def ignore_aliases(self, data: Any) -> bool:
        return True
