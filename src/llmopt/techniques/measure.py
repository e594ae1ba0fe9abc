"""The last step of every job: serve the built artifact with its final engine settings, prove it
answers, and measure what the manifest reports (time to ready, perplexity, greedy outputs)."""

from __future__ import annotations

import time

from llmopt import artifact, corpus, paths
from llmopt.engine import metrics as engine_metrics
from llmopt.engine import vllm
from llmopt.evaluation import quality
from llmopt.techniques import BuildContext

MEASURE_SERVED_NAME = "artifact-under-test"
READY_TIMEOUT_S = 900.0


def run(ctx: BuildContext) -> None:
    args = ctx.engine.to_args(served_name=MEASURE_SERVED_NAME)
    args = {k: artifact.absolute(v, ctx.workdir) for k, v in args.items()}
    log_path = paths.logs_dir() / f"measure{ctx.workdir.name.removeprefix('.build')}.log"
    ctx.log.info("serving the artifact to measure it; engine log: %s", log_path)
    host = vllm.DEFAULT_HOST
    started = time.monotonic()
    server = vllm.start_server(
        str(ctx.workdir), args, ctx.engine.to_env(ctx.hardware), log_path, host, vllm.free_port(host), own_session=False
    )
    try:
        ctx.progress(0.05)
        server.wait_ready(READY_TIMEOUT_S)
        ctx.metrics["ready_seconds"] = round(time.monotonic() - started, 2)
        ctx.progress(0.7)
        ppl = quality.perplexity(server.url, MEASURE_SERVED_NAME, corpus.heldout_texts())
        ctx.metrics["perplexity"] = ppl.to_dict()
        ctx.progress(0.85)
        ctx.metrics["greedy_tokens"] = quality.greedy_tokens(server.url, MEASURE_SERVED_NAME)
        if ctx.engine.speculative_config:
            ctx.metrics["speculative"] = engine_metrics.verify_speculation(server.url, MEASURE_SERVED_NAME)
            ctx.log.info("speculation verified: %s", ctx.metrics["speculative"])
        ctx.log.info("measured: ready in %.1f s, perplexity %.3f over %d tokens",
                     ctx.metrics["ready_seconds"], ppl.perplexity, ppl.tokens)
    finally:
        server.stop()
    ctx.progress(1.0)
