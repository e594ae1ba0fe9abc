"""The last step of every job: serve the built artifact with its final engine settings, prove it
answers and that every technique does what it promises, and measure what the manifest reports
(time to ready, perplexity, greedy outputs, the kernels vLLM chose). A recipe that changes the
numbers is also measured against the source model, and each technique judges its quality cost."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from llmopt import corpus, hashing, paths, techniques
from llmopt.engine import compile_cache, vllm
from llmopt.engine.config import EngineConfig
from llmopt.evaluation import quality
from llmopt.techniques.base import BuildContext, Step
from llmopt.techniques.served import Served, served


class Measurements(BaseModel):
    """What the measure step found, for any recipe."""

    ready_seconds: float
    start: compile_cache.Start
    perplexity: quality.Perplexity
    greedy_tokens: list[list[int]]
    kernels: dict[str, str] = {}  # the linear kernel vLLM chose per layer type
    verified: dict[str, Any] = {}  # what each technique proved on the running engine
    greedy_agreement: quality.Agreement | None = None  # against the source's greedy outputs
    perplexity_base: quality.Perplexity | None = None  # the source's, when the recipe changes numerics
    perplexity_increase: float | None = None


class SourceNumbers(BaseModel):
    perplexity: quality.Perplexity
    greedy_tokens: list[list[int]]


def run(ctx: BuildContext) -> None:
    used = list(techniques.active(ctx.recipe))
    base = _base(ctx) if used else None  # first, so the served artifact is fed the source's greedy outputs
    ctx.progress(0.2)
    with served(ctx, str(ctx.workdir), ctx.engine, "measure") as run:
        ctx.progress(0.4)
        verified = techniques.verify(vllm.located(ctx.engine, ctx.workdir), run.running)
        for technique, spec in techniques.active(ctx.recipe):
            technique.measure(spec, ctx, run)
        ctx.progress(0.5)
        ppl = quality.perplexity(run.server.url, run.running.served_name, corpus.heldout_texts())
        ctx.progress(0.6)
        greedy = _greedy(ctx, run)
        forced = None if base is None else quality.forced_agreement(
            run.server.url, run.running.served_name, base.greedy_tokens, chat=ctx.source.chat_template is not None)
        ctx.progress(0.7)
        measured = Measurements(ready_seconds=run.ready_seconds, start=run.start, perplexity=ppl, greedy_tokens=greedy,
                                kernels=vllm.logged_linear_kernels(run.log_path.read_text(errors="replace")),
                                verified={k: v.model_dump(mode="json") for k, v in verified.items()})
    ctx.log.info("measured: ready in %.1f s, perplexity %.3f over %d tokens; verified %s", measured.ready_seconds,
                 ppl.perplexity, ppl.tokens, ", ".join(verified) or "nothing to verify")
    if base is None:  # this job measured the source's own numbers
        _base_file(ctx).write_text(SourceNumbers(perplexity=ppl, greedy_tokens=greedy).model_dump_json())
    else:
        # temperature 0, one request at a time on both sides: speculation must agree but for bf16 ties
        measured.greedy_agreement = quality.agreement(base.greedy_tokens, greedy, forced)
        ctx.log.info("greedy outputs agree with the source's on %.1f%% of positions; given the source's answer so far, "
                     "%s of its tokens are ranked first here too", 100 * measured.greedy_agreement.token_agreement,
                     "none" if forced is None else f"{forced:.1%}")
        if any(technique.changes_numerics(spec) for technique, spec in used):
            increase = ppl.perplexity / base.perplexity.perplexity - 1
            measured.perplexity_base, measured.perplexity_increase = base.perplexity, round(increase, 5)
            ctx.log.info("perplexity %.3f against %.3f for the source: %+.2f%%", ppl.perplexity, base.perplexity.perplexity,
                         100 * increase)
            for technique, spec in used:
                technique.judge(spec, ctx, increase, base.perplexity)
    ctx.measured = measured
    ctx.progress(1.0)


MEASURE = Step("measure", run)


def _base_key(ctx: BuildContext) -> str:
    """The source's numbers depend on its weights, the engine, the dtype, the held-out text, and the
    prompts and sampling of its greedy outputs."""
    return hashing.json_sha256({
        "source": ctx.source.content_hash,
        "engine": vllm.engine_name_version(),
        "dtype": vllm.dtype(EngineConfig(), ctx.hardware),
        "heldout": corpus.heldout_texts(),
        "greedy_prompts": quality.GREEDY_PROMPTS,
        "greedy_sampling": quality.GREEDY_SAMPLING,
    })


def _base_file(ctx: BuildContext) -> Path:
    folder = paths.home() / "baselines"
    folder.mkdir(exist_ok=True)
    return folder / f"{_base_key(ctx)}.json"


def _base(ctx: BuildContext) -> SourceNumbers:
    """The source's perplexity and greedy outputs: from an earlier job's measurement, or measured
    now. Jobs of one source running side by side measure it once: the others wait for its numbers
    (the lock goes with the process that holds it, a stopped job's too)."""
    cached = _base_file(ctx)
    with cached.with_suffix(".lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            ctx.log.info("waiting for another job's measurement of the source")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if cached.is_file():
            ctx.log.info("source's numbers from an earlier measurement: %s", cached)
            return SourceNumbers.model_validate_json(cached.read_text())
        ctx.log.info("serving the source model to measure its perplexity and greedy outputs")
        with served(ctx, ctx.source.path, EngineConfig(), "measure-base") as run:
            base = SourceNumbers(perplexity=quality.perplexity(run.server.url, run.running.served_name, corpus.heldout_texts()),
                                 greedy_tokens=_greedy(ctx, run))
        paths.write_atomic(cached, base.model_dump_json())
        return base


def _greedy(ctx: BuildContext, run: Served) -> list[list[int]]:
    """Greedy outputs through the chat template, or of plain prompts for a model that has none."""
    return quality.greedy_tokens(run.server.url, run.running.served_name, chat=ctx.source.chat_template is not None)
