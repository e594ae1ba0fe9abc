"""Evaluation results, typed: what `results.json` holds (its JSON schema is published in `schemas/`).

Readers use attributes. The schema is versioned: `SCHEMA_VERSION` changes whenever a field is
removed or changes meaning; a file of a newer version is refused with the version named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmopt.engine.config import EngineConfig
from llmopt.engine.metrics import PrefixCacheStats, SpeculationStats
from llmopt.errors import LlmoptError
from llmopt.evaluation.pricing import HardwareProfile
from llmopt.evaluation.quality import Agreement, Perplexity

SCHEMA_VERSION = 2


class _Result(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Stats(_Result):
    mean: float
    min: float
    max: float
    p50: float
    p90: float
    p99: float


class PerRequest(_Result):
    input_tokens: Stats | None
    output_tokens: Stats | None
    input_tokens_per_s: Stats | None
    output_tokens_per_s: Stats | None


class TokenCounts(_Result):
    input: int
    output: int


class Prices(_Result):
    """Dollars per 1M tokens if the instance did nothing but produce them at this level's rate."""

    per_million_input_tokens: float | None
    per_million_output_tokens: float | None
    blended_per_million_tokens: float | None  # input and output weighted 3:1


class Goodput(_Result):
    ttft_ms_target: float | None
    itl_ms_target: float | None
    requests_per_s: float
    fraction: float


class Accuracy(_Result):
    correct: int
    answered: int
    rate: float


class Samples(_Result):
    """Sorted, thinned samples for distribution plots."""

    ttft_ms: list[float]
    itl_ms: list[float]


class RequestSample(_Result):
    """One request that completed, kept for intervals (bootstrap over requests) and equal-work replays."""

    prompt: int  # the workload request it sent
    input_tokens: int
    output_tokens: int  # counted with the model's tokenizer
    served_tokens: int | None  # as the server counted them (exact: what an equal-work replay asks for)
    latency_ms: float
    ttft_ms: float | None
    tpot_ms: float | None


class DecodeBound(_Result):
    """How close decoding came to what the machine allows (llmopt.roofline): the bound its measured
    read bandwidth (or matmul rate, at a large batch) sets for the weights a step reads and the KV
    cache at the level's mean context, against the decode speed achieved (concurrency / TPOT p50).
    When the level speculated, a step's tokens are those its decode steps kept on average."""

    achieved_tok_s: float
    bound_tok_s: float
    limited_by: Literal["memory", "compute"]
    weights_read_per_token_bytes: int
    read_gb_s: float
    accepted_length: float | None = None  # tokens a speculating level's decode steps kept per sequence, on average

    @property
    def fraction(self) -> float:
        return self.achieved_tok_s / self.bound_tok_s


class Level(_Result):
    """One concurrency level: what the load generator saw, and what the engine's counters said."""

    concurrency: int
    duration_s: float
    aborted: str | None
    invocations: int
    invocation_errors: int
    errors: dict[str, int]
    tokenizer_failures: int
    empty_responses: int
    ttft_ms: Stats | None
    itl_ms: Stats | None  # gaps between streamed chunks
    tpot_ms: Stats | None  # per request: (latency - TTFT) / (output tokens - 1)
    latency_ms: Stats | None
    input_tokens_per_s: float
    output_tokens_per_s: float
    request_throughput_per_s: float
    per_request: PerRequest
    server_counted_tokens: TokenCounts
    price: Prices
    goodput: Goodput
    samples: Samples
    accuracy: Accuracy | None
    speculative: SpeculationStats | None
    requests: list[RequestSample] = Field(default_factory=list)
    decode_bound: DecodeBound | None = None  # where llmopt can read the served weights, on a CPU machine
    prefix_cache: PrefixCacheStats | None = None  # from the engine's counters, where it serves them (vLLM does)

    @property
    def total_tokens_per_s(self) -> float:
        return self.input_tokens_per_s + self.output_tokens_per_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens/s of the decode steps alone, every user's together, from the median time per output
        token: output tokens/s counts prefill and waits too, which the roofline's bound does not."""
        return self.concurrency * 1000 / self.tpot_ms.p50 if self.tpot_ms and self.tpot_ms.p50 > 0 else None


class Quality(_Result):
    """Perplexity of held-out text, greedy outputs, and teacher-forced agreement with the first
    target's; any may be unavailable on a foreign server."""

    perplexity: Perplexity | None = None
    perplexity_error: str | None = None
    greedy_tokens: list[list[int]] | None = None
    greedy_error: str | None = None
    forced_token_agreement: float | None = None  # of the first target's greedy tokens (`quality.forced_agreement`)
    forced_error: str | None = None


class TargetResult(_Result):
    label: str
    kind: Literal["endpoint", "url", "deployed"]
    url: str
    served_name: str
    tokenizer: str | None
    engine: EngineConfig | None = None  # the settings it served with, when llmopt knows them
    seconds_to_ready: float | None = None
    levels: list[Level] = Field(default_factory=list)  # the workload as it is (natural output lengths)
    equal_work: list[Level] = Field(default_factory=list)  # the reference's output lengths replayed, end-of-sequence ignored
    quality: Quality | None = None
    aborted: str | None = None
    warning: str | None = None


class Ratio(_Result):
    """A target's figure over the reference's, with a 95% interval (bootstrap over requests, never
    narrower than the noise between deployments), the leg it comes from, and which way is better."""

    value: float
    low: float
    high: float
    leg: Literal["natural", "equal work"]
    better: Literal["higher", "lower"]

    @property
    def measurable(self) -> bool:
        """False when the interval spans 1.0: no measurable difference."""
        return not self.low <= 1.0 <= self.high

    @property
    def gain(self) -> float:
        """How many times better (above 1) or worse (below 1), whichever way the metric points."""
        return self.value if self.better == "higher" else 1 / self.value

    @property
    def gain_interval(self) -> tuple[float, float]:
        return (self.low, self.high) if self.better == "higher" else (1 / self.high, 1 / self.low)


class LevelRatios(_Result):
    """A target against the reference at one level. Throughput and price on equal work (the same
    prompts and output lengths), latency on the natural leg."""

    concurrency: int
    output_tokens_per_s: Ratio | None
    requests_per_s: Ratio | None
    total_tokens_per_s: Ratio | None
    blended_price: Ratio | None
    ttft_p50: Ratio | None
    tpot_p50: Ratio | None  # per output token: a stream that carries several tokens per chunk is not slower per chunk gap
    latency_p50: Ratio | None


class TargetComparison(_Result):
    label: str
    reference: str
    levels: list[LevelRatios]
    perplexity_ratio: float | None = None
    greedy_agreement: Agreement | None = None
    accuracy_change: float | None = None


class Comparison(_Result):
    reference: str
    targets: list[TargetComparison]


class GoodputTargets(_Result):
    ttft_ms: float | None = Field(None, gt=0)
    itl_ms: float | None = Field(None, gt=0)  # applied to each request's time per output token


class Settings(_Result):
    concurrency: list[int]
    requests_per_level: int | None  # what every level sends at least (levels past their minimum time send whole passes more)
    duration_s: float | None
    min_duration_s: float
    timeout_s: float
    seed: int
    goodput_targets: GoodputTargets


class Spread(_Result):
    min: float
    max: float
    mean: float


class SkippedLines(_Result):
    count: int
    line_numbers: list[int]


class WorkloadInfo(_Result):
    """What the results record about the workload (not the prompts themselves)."""

    name: str
    requests: int
    temperature: float
    seed: int
    ignore_eos: bool
    max_tokens: int | Spread
    source: str | None = None
    skipped_lines: SkippedLines | None = None


class EvaluationResults(_Result):
    schema_version: int = SCHEMA_VERSION
    created_at: float
    price: HardwareProfile
    settings: Settings
    workload: WorkloadInfo | None = None
    targets: list[TargetResult] = Field(default_factory=list)
    comparison: Comparison | None = None


def load(path: Path) -> EvaluationResults:
    """A results.json file, checked against the schema this llmopt writes."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LlmoptError(f"cannot read evaluation results '{path}' ({type(exc).__name__})", "pass a results.json written by llmopt") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        raise LlmoptError(f"'{path}' has results schema version {version}, this llmopt reads {SCHEMA_VERSION}",
                          "re-run the evaluation with this llmopt")
    try:
        return EvaluationResults.model_validate(data)
    except ValidationError as exc:
        raise LlmoptError(f"'{path}' does not match the results schema ({exc.error_count()} errors)",
                          "re-run the evaluation with this llmopt") from None
