"""The last step of every job: serve the built artifact with its final engine settings, prove it
answers, and measure what the manifest reports (time to ready, perplexity, greedy outputs, the
kernels vLLM chose). A recipe that changes the numbers (quantization, an FP8 KV cache) is also
measured against the source model, and fails over its quality budget rather than ship."""

from __future__ import annotations

import json
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from llmopt import artifact, corpus, hashing, paths
from llmopt.engine import compile_cache
from llmopt.engine import metrics as engine_metrics
from llmopt.engine import vllm
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError
from llmopt.evaluation import quality
from llmopt.techniques import BuildContext

MEASURE_SERVED_NAME = "artifact-under-test"
READY_TIMEOUT_S = 900.0
KERNEL_LINE = re.compile(r"(?:Selected|Using) (\w+Kernel) for (\w+)$", re.MULTILINE)  # the linear kernel per layer type


def run(ctx: BuildContext) -> None:
    label = ctx.workdir.name.removeprefix(".build")
    with served(ctx, str(ctx.workdir), ctx.engine, f"measure{label}") as run:
        server, ready_seconds = run.server, run.ready_seconds
        ctx.metrics["ready_seconds"] = ready_seconds
        ctx.metrics["start"] = run.compile_cache
        ctx.progress(0.5)
        ppl = quality.perplexity(server.url, MEASURE_SERVED_NAME, corpus.heldout_texts())
        ctx.metrics["perplexity"] = ppl.to_dict()
        ctx.progress(0.6)
        ctx.metrics["greedy_tokens"] = quality.greedy_tokens(server.url, MEASURE_SERVED_NAME)
        if ctx.engine.speculative_config:
            ctx.metrics["speculative"] = engine_metrics.verify_speculation(server.url, MEASURE_SERVED_NAME)
            ctx.log.info("speculation verified: %s", ctx.metrics["speculative"])
        kernels = {layer: kernel for kernel, layer in KERNEL_LINE.findall(run.log_path.read_text(errors="replace"))}
        if kernels:
            ctx.metrics["kernels"] = kernels
    ctx.log.info("measured: ready in %.1f s, perplexity %.3f over %d tokens", ready_seconds, ppl.perplexity, ppl.tokens)
    if _changes_numerics(ctx):
        ctx.progress(0.7)
        _against_base(ctx, ppl.perplexity)
    else:
        _base_file(ctx).write_text(json.dumps(ppl.to_dict()))  # this job measured the source's own numbers
    ctx.progress(1.0)


def _changes_numerics(ctx: BuildContext) -> bool:
    return ctx.recipe.quantization is not None or ctx.engine.kv_cache_dtype not in (None, "auto")


def _against_base(ctx: BuildContext, perplexity: float) -> None:
    base = _base_perplexity(ctx)
    increase = perplexity / base["perplexity"] - 1
    ctx.metrics["perplexity_base"] = base
    ctx.metrics["perplexity_increase"] = round(increase, 5)
    q = ctx.recipe.quantization
    ctx.log.info("perplexity %.3f against %.3f for the source: %+.2f%%", perplexity, base["perplexity"], 100 * increase)
    if q is not None and increase > q.max_perplexity_increase:
        raise LlmoptError(
            f"quality budget exceeded: perplexity rose {100 * increase:.1f}% ({base['perplexity']:.2f} -> {perplexity:.2f} "
            f"on {base['tokens']} held-out tokens), over quantization.max_perplexity_increase {q.max_perplexity_increase:g} "
            f"for {q.method}",
            "raise the budget, or calibrate on more data, or use a smaller group_size (awq) or another scheme",
        )


def _base_key(ctx: BuildContext) -> str:
    """The source's perplexity depends on its weights, the engine, the dtype and the held-out text."""
    return hashing.json_sha256({
        "source": ctx.source.content_hash,
        "engine": vllm.engine_name_version(),
        "dtype": EngineConfig().dtype,
        "heldout": corpus.heldout_texts(),
    })


def _base_file(ctx: BuildContext) -> Path:
    folder = paths.home() / "baselines"
    folder.mkdir(exist_ok=True)
    return folder / f"{_base_key(ctx)}.json"


def _base_perplexity(ctx: BuildContext) -> dict:
    cached = _base_file(ctx)
    if cached.is_file():
        ctx.log.info("source perplexity from an earlier measurement: %s", cached)
        return json.loads(cached.read_text())
    ctx.log.info("serving the source model to measure its perplexity")
    with served(ctx, ctx.source.path, EngineConfig(), f"measure-base{ctx.workdir.name.removeprefix('.build')}") as run:
        base = quality.perplexity(run.server.url, MEASURE_SERVED_NAME, corpus.heldout_texts()).to_dict()
    cached.write_text(json.dumps(base))
    return base


@dataclass
class Served:
    server: vllm.ServerProcess
    log_path: Path
    ready_seconds: float
    compile_cache: dict  # compile_cache.Watch.result: precompiled or compiled, and the key
    cache_entry: compile_cache.Entry


@contextmanager
def served(ctx: BuildContext, model_path: str, engine: EngineConfig, log_name: str) -> Iterator[Served]:
    """A vLLM server for `model_path` in the worker's process group (a stopped job takes it down),
    started against its compile-cache entry."""
    args = {k: artifact.absolute(v, ctx.workdir) for k, v in engine.to_args(served_name=MEASURE_SERVED_NAME).items()}
    cache = compile_cache.Watch(compile_cache.entry_for(model_path, args, ctx.hardware))
    log_path = paths.logs_dir() / f"{log_name}.log"
    ctx.log.info("serving %s; engine log: %s", model_path, log_path)
    host = vllm.DEFAULT_HOST
    started = time.monotonic()
    env = {**engine.to_env(ctx.hardware), **cache.entry.env}
    server = vllm.start_server(model_path, args, env, log_path, host, vllm.free_port(host), own_session=False)
    try:
        server.wait_ready(READY_TIMEOUT_S)
        ready = round(time.monotonic() - started, 2)
        yield Served(server, log_path, ready, cache.result(ready), cache.entry)
    finally:
        server.stop()
