"""The build of one artifact: run a recipe's steps in a hidden work folder, then finalize it."""

from __future__ import annotations

import logging
import resource
import time
from pathlib import Path
from typing import Callable

from llmopt import artifact, hashing
from llmopt.engine import platform, vllm
from llmopt.engine.config import EngineConfig
from llmopt.recipe import Recipe
from llmopt.sources import Model
from llmopt.techniques import BuildContext, plan

StepReporter = Callable[[str, str, float, float | None], None]


def artifact_key(source: Model, recipe: Recipe, hardware: platform.Hardware, extra: dict | None = None) -> str:
    """Everything that makes an artifact what it is; the same key means the same artifact."""
    engine_name, engine_version = vllm.engine_name_version()
    recipe_data = recipe.to_dict()
    recipe_data.pop("name", None)
    return hashing.json_sha256(
        {
            "schema": artifact.SCHEMA_VERSION,
            "source": source.content_hash,
            "recipe": recipe_data,
            "engine": [engine_name, engine_version],
            "device": hardware.device,
            **(extra or {}),
        }
    )


def build(
    name: str,
    key: str,
    source: Model,
    recipe: Recipe,
    workdir: Path,
    output: Path,
    log: logging.Logger,
    report: StepReporter,
    finalize_guard: Callable[[], object],
) -> artifact.Manifest:
    """Run every step into `workdir`, then write the manifest and rename it to `output`.

    `finalize_guard` is a context manager around the rename into place; the worker's holds off stop
    signals and records COMPLETED inside it, so a stop never leaves a complete artifact behind a
    record that says otherwise.
    """
    hardware = platform.detect()
    ctx = BuildContext(
        recipe=recipe,
        source=source,
        workdir=workdir,
        engine=EngineConfig(),
        hardware=hardware,
        log=log,
        progress=lambda fraction: None,
    )
    timings = []
    for step in plan(recipe):
        log.info("step %s: start", step.name)
        started = time.monotonic()
        ctx.progress = lambda fraction, s=step.name: report(s, "running", fraction, None)
        report(step.name, "running", 0.0, None)
        step.run(ctx)
        seconds = time.monotonic() - started
        report(step.name, "done", 1.0, seconds)
        timings.append({"name": step.name, "seconds": round(seconds, 2)})
        log.info("step %s: done in %.1f s", step.name, seconds)

    engine_name, engine_version = vllm.engine_name_version()
    size = sum(p.stat().st_size for p in workdir.rglob("*") if p.is_file())
    ctx.metrics.update(
        size_bytes=size,
        source_size_bytes=source.size_bytes,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    manifest = artifact.Manifest(
        name=name,
        key=key,
        source={"model": source.id, "origin": source.source, "content_hash": source.content_hash},
        recipe=recipe.to_dict(),
        engine={
            "name": engine_name,
            "version": engine_version,
            "args": ctx.engine.to_args(served_name=name),
            "env": ctx.engine.to_env(hardware),
        },
        hardware={**hardware.to_dict(), "torch": platform.torch_version()},
        content_hash="",
        created_at=0.0,
        steps=timings,
        metrics=ctx.metrics,
        references=ctx.references,
    )
    with finalize_guard():
        artifact.finalize(workdir, output, manifest)
    log.info("artifact %s complete: %s", name, output)
    return manifest

