"""Metric arithmetic on recorded streams, checked against values computed by hand."""

from __future__ import annotations

import math

import pytest

from llmopt.engine import metrics as engine_metrics
from llmopt.evaluation import metrics, pricing
from llmopt.evaluation.loadgen import LevelRun, RequestRecord
from llmopt.evaluation.results import GoodputTargets
from llmopt.evaluation.tokens import TokenCounter
from llmopt.evaluation.workload import Request


class WordTokenizer:
    """A stand-in tokenizer for unit tests: one token per word; the chat template adds two."""

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        if any("FAIL" in m["content"] for m in messages):
            raise ValueError("cannot parse")
        return "<user> " + " ".join(m["content"] for m in messages) + " <assistant>"

    def __call__(self, text: str, add_special_tokens: bool = True):
        class Encoded:
            input_ids = text.split()
        return Encoded()


PRICE = pricing.HardwareProfile(name="test", description="test", price_per_hour=3.6, as_of="test", discount=0.5)
PLAN = [
    Request(({"role": "user", "content": "one two three"},), 8, expected="Paris"),  # 5 prompt tokens
    Request(({"role": "user", "content": "four five six seven eight"},), 8),  # 7 prompt tokens
    Request(({"role": "user", "content": "FAIL here"},), 8),
]


def _run() -> LevelRun:
    records = [
        # started at 10.0: chunks at 10.2, 10.3, 10.5; ended 10.6; text of 3 words
        RequestRecord(0, 10.0, 10.6, [10.2, 10.3, 10.5], "It is Paris", None, 5, 4),
        # started at 10.1: chunks at 10.5, 11.1; ended 11.1; 2 words
        RequestRecord(1, 10.1, 11.1, [10.5, 11.1], "a b", None, 7, 2),
        # an error
        RequestRecord(0, 10.2, 10.4, [], "", "HTTP 500: boom"),
        # success with no content: an empty response
        RequestRecord(1, 10.3, 10.5, [], "", None, 7, 0),
        # the prompt cannot be tokenized: a tokenizer failure, counted with the server's usage
        RequestRecord(2, 10.4, 11.4, [10.9], "x", None, 9, 1),
    ]
    return LevelRun(concurrency=2, records=records, plan=PLAN, started=10.0, ended=11.4)


def test_level_metrics_match_hand_computation() -> None:
    m = metrics.compute(_run(), TokenCounter(WordTokenizer()), PRICE, GoodputTargets(ttft_ms=300, itl_ms=201))
    duration = 1.4
    assert m.duration_s == pytest.approx(duration)
    assert m.invocations == 5 and m.invocation_errors == 1 and m.errors == {"HTTP 500: boom": 1}
    assert m.tokenizer_failures == 1 and m.empty_responses == 1
    # TTFT: 0.2, 0.4, 0.5 s
    assert m.ttft_ms.p50 == pytest.approx(400) and m.ttft_ms.mean == pytest.approx(1100 / 3)
    # ITL gaps: 0.1, 0.2 (first request), 0.6 (second)
    assert m.itl_ms.mean == pytest.approx(300) and m.itl_ms.max == pytest.approx(600)
    # TPOT: (0.6-0.2)/(3-1) = 0.2 s; (1.0-0.4)/(2-1) = 0.6 s
    assert m.tpot_ms.mean == pytest.approx(400)
    # latency: 0.6, 1.0, 0.2, 1.0 s over the four successes
    assert m.latency_ms.mean == pytest.approx(700) and m.latency_ms.p50 == pytest.approx(800)
    # tokens: prompts 5 + 7 + 7 + 9 (usage fallback) = 28; outputs 3 + 2 + 0 + 1 = 6
    assert m.input_tokens_per_s == pytest.approx(28 / duration)
    assert m.output_tokens_per_s == pytest.approx(6 / duration)
    assert m.request_throughput_per_s == pytest.approx(4 / duration)
    per = m.per_request
    assert per.input_tokens.mean == pytest.approx(7) and per.output_tokens.mean == pytest.approx(1.5)
    assert per.output_tokens_per_s.mean == pytest.approx((3 / 0.6 + 2 / 1.0 + 0 + 1 / 1.0) / 4)
    # price: $3.6/h at 50% off = $1.8/h = $0.0005/s
    hourly = 1.8
    assert m.price.per_million_input_tokens == pytest.approx(hourly / (28 / duration * 3600 / 1e6))
    assert m.price.per_million_output_tokens == pytest.approx(hourly / (6 / duration * 3600 / 1e6))
    assert m.price.blended_per_million_tokens == pytest.approx(hourly / (34 / duration * 3600 / 1e6) / 4)
    # goodput: TTFT <= 300 ms and TPOT <= 201 ms: only the first request
    assert m.goodput.requests_per_s == pytest.approx(1 / duration) and m.goodput.fraction == pytest.approx(1 / 5)
    # accuracy: the first request expected "Paris" and got it
    assert m.accuracy is not None and (m.accuracy.correct, m.accuracy.answered, m.accuracy.rate) == (1, 1, 1.0)
    assert (m.server_counted_tokens.input, m.server_counted_tokens.output) == (28, 7)


def test_blended_price_formula_from_design() -> None:
    # (1 - 0.25) x $2/h / (1000 tokens/s x 3600 / 1e6) / 4
    profile = pricing.choose(None, 2.0, 0.25)
    assert pricing.blended_per_million(profile.effective_price_per_hour, 1000) == pytest.approx(1.5 / 3.6 / 4)
    assert pricing.per_million(1.0, 0) is None


def test_speculative_counters_from_prometheus_text() -> None:
    before = engine_metrics.parse("vllm:spec_decode_num_drafts_total{model_name=\"m\"} 10.0\n"
                                  "vllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 30.0\n"
                                  "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 15.0\n")
    after = engine_metrics.parse("# HELP x\nvllm:spec_decode_num_drafts_total{model_name=\"m\"} 110.0\n"
                                 "vllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 330.0\n"
                                 "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 255.0\n")
    spec = engine_metrics.speculative(engine_metrics.delta(before, after))
    assert spec.acceptance_rate == pytest.approx(240 / 300)
    assert spec.mean_accepted_length == pytest.approx(1 + 240 / 100)
    assert engine_metrics.speculative({}) is None


def test_stats_percentiles() -> None:
    s = metrics.stats([1, 2, 3, 4])
    assert s.p50 == 2.5 and s.mean == 2.5 and math.isclose(s.p99, 3.97)
    assert metrics.stats([]) is None
