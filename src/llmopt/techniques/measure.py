"""The last step of every job: serve the built artifact with its final engine settings, prove it
answers, and measure what the manifest reports (time to ready, perplexity, greedy outputs, the
kernels vLLM chose). A recipe that changes the numbers (quantization, an FP8 KV cache) is also
measured against the source model, and fails over its quality budget rather than ship."""

from __future__ import annotations

import json
import re
from pathlib import Path

from llmopt import corpus, hashing, paths
from llmopt.engine import metrics as engine_metrics
from llmopt.engine import vllm
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError
from llmopt.evaluation import quality
from llmopt.techniques import BuildContext, compilation
from llmopt.techniques.served import SERVED_NAME, served

KERNEL_LINE = re.compile(r"(?:Selected|Using) (\w+Kernel) for (\w+)$", re.MULTILINE)  # the linear kernel per layer type


def run(ctx: BuildContext) -> None:
    with served(ctx, str(ctx.workdir), ctx.engine, "measure") as run:
        server, ready_seconds = run.server, run.ready_seconds
        ctx.metrics["ready_seconds"] = ready_seconds
        ctx.metrics["start"] = run.compile_cache
        if ctx.recipe.compilation:
            compilation.record_precompiled_start(ctx, run.compile_cache)
        ctx.progress(0.5)
        ppl = quality.perplexity(server.url, SERVED_NAME, corpus.heldout_texts())
        ctx.metrics["perplexity"] = ppl.to_dict()
        ctx.progress(0.6)
        ctx.metrics["greedy_tokens"] = quality.greedy_tokens(server.url, SERVED_NAME)
        if ctx.engine.speculative_config:
            ctx.metrics["speculative"] = engine_metrics.verify_speculation(server.url, SERVED_NAME)
            ctx.log.info("speculation verified: %s", ctx.metrics["speculative"])
        kernels = {layer: kernel for kernel, layer in KERNEL_LINE.findall(run.log_path.read_text(errors="replace"))}
        if kernels:
            ctx.metrics["kernels"] = kernels
    ctx.log.info("measured: ready in %.1f s, perplexity %.3f over %d tokens", ready_seconds, ppl.perplexity, ppl.tokens)
    if not ctx.recipe.techniques():  # this job measured the source's own numbers
        _base_file(ctx).write_text(json.dumps({"perplexity": ppl.to_dict(), "greedy_tokens": ctx.metrics["greedy_tokens"]}))
    else:
        ctx.progress(0.7)
        base = _base(ctx)
        # temperature 0, one request at a time on both sides: speculation must agree but for bf16 ties
        ctx.metrics["greedy_agreement"] = agreed = quality.agreement(base["greedy_tokens"], ctx.metrics["greedy_tokens"])
        ctx.log.info("greedy outputs agree with the source's on %.1f%% of tokens", 100 * agreed["token_agreement"])
        if _changes_numerics(ctx):
            _against_base(ctx, ppl.perplexity, base["perplexity"])
    ctx.progress(1.0)


def _changes_numerics(ctx: BuildContext) -> bool:
    return ctx.recipe.quantization is not None or ctx.engine.kv_cache_dtype not in (None, "auto")


def _against_base(ctx: BuildContext, perplexity: float, base: dict) -> None:
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
    """The source's numbers depend on its weights, the engine, the dtype, the held-out text and the prompts."""
    return hashing.json_sha256({
        "source": ctx.source.content_hash,
        "engine": vllm.engine_name_version(),
        "dtype": EngineConfig().dtype,
        "heldout": corpus.heldout_texts(),
        "greedy_prompts": quality.GREEDY_PROMPTS,
    })


def _base_file(ctx: BuildContext) -> Path:
    folder = paths.home() / "baselines"
    folder.mkdir(exist_ok=True)
    return folder / f"{_base_key(ctx)}.json"


def _base(ctx: BuildContext) -> dict:
    """The source's perplexity and greedy outputs: from an earlier job's measurement, or measured now."""
    cached = _base_file(ctx)
    if cached.is_file():
        ctx.log.info("source's numbers from an earlier measurement: %s", cached)
        return json.loads(cached.read_text())
    ctx.log.info("serving the source model to measure its perplexity and greedy outputs")
    with served(ctx, ctx.source.path, EngineConfig(), "measure-base") as run:
        base = {"perplexity": quality.perplexity(run.server.url, SERVED_NAME, corpus.heldout_texts()).to_dict(),
                "greedy_tokens": quality.greedy_tokens(run.server.url, SERVED_NAME)}
    cached.write_text(json.dumps(base))
    return base
