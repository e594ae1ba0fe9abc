"""Metrics of one concurrency level, computed from raw request records after the run.

Meanings follow the SageMaker toolkit's evaluation:
- time to first token: request sent to first streamed token; client latency: sent to last byte;
- inter-token latency: the gaps between streamed chunks, pooled over all requests (as vLLM's
  serving benchmark computes it); time per output token: (latency - TTFT) / (output tokens - 1);
- input/output tokens per second: the level's total tokens over the level's duration (first
  request sent to last response received);
- per request: input and output tokens, and each divided by that request's client latency;
- invocations (requests sent), invocation errors, tokenizer failures (the tokenizer could not
  parse the request or the response), empty responses (no output tokens, or an unparsable one).
Tokens are counted with the model's tokenizer; the server's own usage counts are kept beside.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from llmopt.engine import metrics as engine_metrics
from llmopt.evaluation import pricing, quality
from llmopt.evaluation.loadgen import LevelRun
from llmopt.evaluation.results import (
    Accuracy, Goodput, GoodputTargets, Level, PerRequest, Prices, RequestSample, Samples, Stats, TokenCounts,
)
from llmopt.evaluation.tokens import TokenCounter
from llmopt.evaluation.workload import Workload

PERCENTILES = (50, 90, 99)


def stats(values: list[float]) -> Stats | None:
    if not values:
        return None
    array = np.asarray(values, dtype=float)
    p50, p90, p99 = (float(np.percentile(array, p)) for p in PERCENTILES)
    return Stats(mean=float(array.mean()), min=float(array.min()), max=float(array.max()), p50=p50, p90=p90, p99=p99)


def compute(run: LevelRun, counter: TokenCounter | None, price: pricing.HardwareProfile,
            targets: GoodputTargets = GoodputTargets(), work: Workload | None = None) -> Level:
    """The level's figures; `work` (the workload the plan came from) names each request's prompt."""
    records = run.records
    samples: list[RequestSample] = []
    ok = [r for r in records if r.error is None]
    tokenizer_failures = 0
    empty = 0
    input_tokens: list[int] = []
    output_tokens: list[int] = []
    ttft_ms, latency_ms, tpot_ms, itl_ms = [], [], [], []
    in_tps, out_tps = [], []
    good = 0
    correct = answered = 0
    for record in ok:
        request = run.plan[record.index % len(run.plan)]
        n_in = counter.prompt_tokens(request.messages) if counter else record.usage_prompt_tokens
        n_out = counter.output_tokens(record.text) if counter else record.usage_completion_tokens
        failed = counter is not None and (n_in is None or n_out is None)
        tokenizer_failures += failed
        n_in = n_in if n_in is not None else (record.usage_prompt_tokens or 0)
        if n_out is None or n_out == 0 or not record.chunk_times:
            empty += 1
            n_out = 0
        input_tokens.append(n_in)
        output_tokens.append(n_out)
        latency = record.latency
        latency_ms.append(latency * 1000)
        in_tps.append(n_in / latency if latency > 0 else 0.0)
        out_tps.append(n_out / latency if latency > 0 else 0.0)
        itl_ms.extend(np.diff(record.chunk_times) * 1000 if len(record.chunk_times) > 1 else [])
        tpot = None
        if record.ttft is not None:
            ttft_ms.append(record.ttft * 1000)
            if n_out > 1:
                tpot = (latency - record.ttft) / (n_out - 1) * 1000
                tpot_ms.append(tpot)
        if record.ttft is not None and _meets(record.ttft * 1000, targets.ttft_ms) and _meets(tpot, targets.itl_ms):
            good += 1
        if request.expected is not None:
            answered += 1
            correct += quality.is_correct(record.text, request.expected)
        samples.append(RequestSample(
            prompt=work.position(request) if work else record.index % len(run.plan), input_tokens=n_in,
            output_tokens=n_out, served_tokens=record.usage_completion_tokens, latency_ms=latency * 1000,
            ttft_ms=record.ttft * 1000 if record.ttft is not None else None, tpot_ms=tpot))

    duration = run.duration
    input_tps = sum(input_tokens) / duration
    output_tps = sum(output_tokens) / duration
    hourly = price.effective_price_per_hour
    errors = Counter(r.error for r in records if r.error)
    return Level(
        concurrency=run.concurrency,
        duration_s=duration,
        aborted=run.aborted,
        invocations=len(records),
        invocation_errors=len(records) - len(ok),
        errors=dict(errors.most_common(10)),
        tokenizer_failures=tokenizer_failures,
        empty_responses=empty,
        ttft_ms=stats(ttft_ms),
        itl_ms=stats(itl_ms),
        tpot_ms=stats(tpot_ms),
        latency_ms=stats(latency_ms),
        input_tokens_per_s=input_tps,
        output_tokens_per_s=output_tps,
        request_throughput_per_s=len(ok) / duration,
        per_request=PerRequest(input_tokens=stats(input_tokens), output_tokens=stats(output_tokens),
                               input_tokens_per_s=stats(in_tps), output_tokens_per_s=stats(out_tps)),
        server_counted_tokens=TokenCounts(input=sum(r.usage_prompt_tokens or 0 for r in ok),
                                          output=sum(r.usage_completion_tokens or 0 for r in ok)),
        price=Prices(per_million_input_tokens=pricing.per_million(hourly, input_tps),
                     per_million_output_tokens=pricing.per_million(hourly, output_tps),
                     blended_per_million_tokens=pricing.blended_per_million(hourly, input_tps + output_tps)),
        goodput=Goodput(ttft_ms_target=targets.ttft_ms, itl_ms_target=targets.itl_ms, requests_per_s=good / duration,
                        fraction=good / len(records) if records else 0.0),
        samples=Samples(ttft_ms=_thin(ttft_ms), itl_ms=_thin(itl_ms)),
        accuracy=Accuracy(correct=correct, answered=answered, rate=correct / answered) if answered else None,
        speculative=engine_metrics.speculative(run.engine_counters),
        prefix_cache=engine_metrics.prefix_cache(run.engine_counters),
        requests=samples,
    )


def _thin(values: list[float], most: int = 2000) -> list[float]:
    """At most `most` evenly spaced samples of a sorted copy, for distribution plots."""
    ordered = sorted(values)
    if len(ordered) <= most:
        return [round(v, 3) for v in ordered]
    step = (len(ordered) - 1) / (most - 1)
    return [round(ordered[round(i * step)], 3) for i in range(most)]


def _meets(value: float | None, target: float | None) -> bool:
    return target is None or (value is not None and value <= target)
