"""The build of one artifact: plan a recipe's steps, run them in a hidden work folder, then
finalize the folder with its manifest."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from llmopt import artifact, hashing, procs, roofline, techniques
from llmopt.engine import platform, vllm
from llmopt.sources import Model
from llmopt.techniques import measure, package
from llmopt.techniques.base import BuildContext, Step

PUBLISH = "publish"  # after the build, a job with an output URI copies the artifact there
StepReporter = Callable[[str, str, float, float | None], None]
SERVER_OVERHEAD_BYTES = 2 * 2**30  # a vLLM server's memory beyond weights and KV cache (exports assume the same)


def plan(recipe: Any) -> list[Step]:
    """The weights (copied as they are unless a section rewrites them), each section's steps, then
    the measure step."""
    steps = techniques.steps(recipe)
    if not any(step.writes_weights for step in steps):
        steps.insert(0, package.STEP)
    return [*steps, measure.MEASURE]


def peak_memory_bytes(source: Model, recipe: Any, hardware: platform.Hardware) -> int:
    """What a job's worker may hold at once, for a scheduler to reserve: the larger of its build
    steps' peak, each technique's own estimate (quantizing: about three times the source's weights,
    the model in the dtype it quantizes in and its compressed copy, six where that is float32, plus
    the libraries and the calibration activations), and
    the measure step's server (the source's weights, at least the artifact's; the KV cache when it
    is in host memory; the server's overhead). A draft model's weights are not counted."""
    kv_cache = techniques.engine(recipe).kv_cache_gib * 2**30 if hardware.device == "cpu" else 0
    serving = source.size_bytes + kv_cache + SERVER_OVERHEAD_BYTES
    return max(serving, techniques.peak_bytes(recipe, source, hardware))


def artifact_key(source: Model, recipe: Any, hardware: platform.Hardware) -> str:
    """Everything that makes an artifact what it is; the same key means the same artifact."""
    recipe_data = recipe.to_dict()
    recipe_data.pop("name", None)
    return hashing.json_sha256({
        "schema": artifact.SCHEMA_VERSION,
        "source": source.content_hash,
        "recipe": recipe_data,
        "engine": list(vllm.engine_name_version()),
        "device": hardware.device,
        **techniques.key_extras(recipe, source, hardware),
    })


def build(
    name: str,
    key: str,
    source: Model,
    recipe: Any,
    workdir: Path,
    output: Path,
    log: logging.Logger,
    report: StepReporter,
    finalize_guard: Callable[[], Any],
) -> artifact.Manifest:
    """Run every step into `workdir`, then write the manifest and rename it to `output`.

    `finalize_guard` is a context manager around the rename into place; the worker's holds off stop
    signals and records COMPLETED inside it, so a stop never leaves a complete artifact behind a
    record that says otherwise.
    """
    hardware = platform.detect()
    ctx = BuildContext(recipe=recipe, source=source, workdir=workdir, engine=techniques.engine(recipe), hardware=hardware,
                       log=log, progress=lambda fraction: None)
    timings = []
    for step in plan(recipe):
        log.info("step %s: start", step.name)
        started = time.monotonic()
        ctx.progress = lambda fraction, s=step.name: report(s, "running", fraction, None)
        report(step.name, "running", 0.0, None)
        step.run(ctx)
        seconds = time.monotonic() - started
        report(step.name, "done", 1.0, seconds)
        timings.append(artifact.StepTiming(name=step.name, seconds=round(seconds, 2)))
        log.info("step %s: done in %.1f s", step.name, seconds)

    engine_name, engine_version = vllm.engine_name_version()
    metrics = artifact.ArtifactMetrics(
        **ctx.measured.model_dump(),
        **{section: record.model_dump() for section, record in ctx.metrics.items()},
        size_bytes=sum(p.stat().st_size for p in workdir.rglob("*") if p.is_file()),
        source_size_bytes=source.size_bytes,
        peak_rss_bytes=procs.peak_rss_bytes(),
        weights_read_per_token_bytes=roofline.served_traffic(workdir, ctx.engine, hardware).weights_bytes or None,
    )
    manifest = artifact.Manifest(
        name=name,
        key=key,
        source=artifact.SourceRecord(model=source.id, origin=source.source, content_hash=source.content_hash),
        recipe=recipe,
        engine=artifact.EngineRecord(name=engine_name, version=engine_version, served_name=name, settings=ctx.engine),
        hardware=artifact.HardwareRecord(**hardware.model_dump(), torch=platform.torch_version()),
        steps=timings,
        metrics=metrics,
        references=ctx.references,
    )
    with finalize_guard():
        artifact.finalize(workdir, output, manifest)
    log.info("artifact %s complete: %s", name, output)
    return manifest
