"""Exports: an artifact as a deployment for systems other than llmopt (Ray Serve, KServe, plain
Kubernetes, Docker Compose), serving exactly the engine settings llmopt would, rendered for the
machine the caller describes. One module per format; `target` holds what they share."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Literal

from llmopt.errors import LlmoptError
from llmopt.exports import compose, kserve, kubernetes, ray_serve, target

Format = Literal["ray-serve", "kserve", "kubernetes", "compose"]
RENDERERS: dict[str, Callable[[target.Target], dict[str, str]]] = {
    "ray-serve": ray_serve.render,
    "kserve": kserve.render,
    "kubernetes": kubernetes.render,
    "compose": compose.render,
}
FORMATS = tuple(RENDERERS)


def render(artifact_dir: str | Path, fmt: Format, replicas: int = 1, cpus: float | None = None,
           memory_gib: float | None = None, gpus: int = 0, image: str | None = None,
           model_uri: str | None = None) -> dict[str, str]:
    """File name -> text of the artifact's deployment in `fmt`: `replicas` replicas of `cpus` CPUs,
    `memory_gib` GiB and `gpus` GPUs each (unset: derived from the manifest), in `image` (unset:
    vLLM's for the artifact's engine version), the artifact mounted from here or fetched from `model_uri`."""
    if fmt not in RENDERERS:
        raise LlmoptError(f"unknown export format '{fmt}'", f"pass one of {', '.join(FORMATS)}")
    return RENDERERS[fmt](target.describe(Path(artifact_dir), replicas, cpus, memory_gib, gpus, image, model_uri))


def export(artifact_dir: str | Path, fmt: Format, output: str | Path, replicas: int = 1, cpus: float | None = None,
           memory_gib: float | None = None, gpus: int = 0, image: str | None = None,
           model_uri: str | None = None) -> list[Path]:
    """Write the artifact's deployment in `fmt` into the folder `output` (made if missing, files of
    the same names replaced); returns the files written."""
    files = render(artifact_dir, fmt, replicas, cpus, memory_gib, gpus, image, model_uri)
    folder = Path(output).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        (folder / name).write_text(text)
        written.append(folder / name)
    return written
