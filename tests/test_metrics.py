"""Metric arithmetic on recorded streams, checked against values computed by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from llmopt import roofline, sources
from llmopt.engine import metrics as engine_metrics
from llmopt.engine import platform
from llmopt.engine.config import EngineConfig, SpeculativeConfig
from llmopt.evaluation import benchmark, compare, levels, metrics, pricing, quality, workload
from llmopt.evaluation.loadgen import LevelRun, RequestRecord
from llmopt.evaluation.results import GoodputTargets, Level, RequestSample
from llmopt.presentation import format
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


def test_engine_counters_from_prometheus_text() -> None:
    """vLLM's counters, with their `_created` companions and another engine's labels: summed, and
    read as speculation's and the prefix cache's statistics over the run between two scrapes."""
    before = engine_metrics.parse("vllm:spec_decode_num_drafts_total{model_name=\"m\"} 10.0\n"
                                  "vllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 30.0\n"
                                  "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 15.0\n"
                                  'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
                                  'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 200.0\n'
                                  'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n')
    after = engine_metrics.parse("# HELP x\nvllm:spec_decode_num_drafts_total{model_name=\"m\"} 110.0\n"
                                 "vllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 330.0\n"
                                 "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 255.0\n"
                                 'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4000.0\n'
                                 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1100.0\n'
                                 'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 1000.0\n')
    run = engine_metrics.delta(before, after)
    spec = engine_metrics.speculative(run)
    assert spec.acceptance_rate == pytest.approx(240 / 300)
    assert spec.mean_accepted_length == pytest.approx(1 + 240 / 100)
    cache = engine_metrics.prefix_cache(run)
    assert (cache.queried_tokens, cache.hit_tokens, cache.hit_rate) == (4000, 900, pytest.approx(900 / 4000))
    assert engine_metrics.speculative({}) is None and engine_metrics.prefix_cache({}) is None


def test_stats_percentiles() -> None:
    s = metrics.stats([1, 2, 3, 4])
    assert s.p50 == 2.5 and s.mean == 2.5 and math.isclose(s.p99, 3.97)
    assert metrics.stats([]) is None


def _level(concurrency: int, latencies_ms: list[float], tokens: int = 10, tpot_ms: float = 20.0) -> Level:
    """A level whose requests each produced `tokens` tokens in the given latencies (a closed loop)."""
    samples = [RequestSample(prompt=i, input_tokens=100, output_tokens=tokens, served_tokens=tokens, latency_ms=lat,
                             ttft_ms=lat / 10, tpot_ms=tpot_ms * lat / latencies_ms[0]) for i, lat in enumerate(latencies_ms)]
    duration = sum(latencies_ms) / 1000 / concurrency
    level = metrics.compute(LevelRun(concurrency, [], PLAN, 0.0, 1.0), None, PRICE)
    return level.model_copy(update={
        "requests": samples, "output_tokens_per_s": tokens * len(samples) / duration,
        "input_tokens_per_s": 100 * len(samples) / duration, "request_throughput_per_s": len(samples) / duration,
        "ttft_ms": metrics.stats([s.ttft_ms for s in samples]), "tpot_ms": metrics.stats([s.tpot_ms for s in samples]),
        "latency_ms": metrics.stats(latencies_ms)})


def test_a_target_against_itself_is_no_measurable_difference() -> None:
    rng = __import__("random").Random(1)
    latencies = [1000 + rng.gauss(0, 60) for _ in range(16)]
    a, b = _level(1, latencies), _level(1, sorted(latencies))  # the same requests, in another order
    ratio = compare.throughput_ratio(a, b, a.request_throughput_per_s, b.request_throughput_per_s, lambda s: 1.0, "higher", "equal work")
    assert not ratio.measurable and ratio.low < 1 < ratio.high
    assert format.ratio(ratio).startswith("no measurable difference [")
    assert ratio.high - ratio.low >= 2 * compare.NOISE * ratio.value * 0.999  # never narrower than the noise between deployments


def test_a_faster_target_is_a_measurable_speedup_in_the_right_direction() -> None:
    rng = __import__("random").Random(2)
    slow = _level(1, [1000 + rng.gauss(0, 50) for _ in range(16)])
    fast = _level(1, [500 + rng.gauss(0, 25) for _ in range(16)], tpot_ms=10.0)
    requests = compare.throughput_ratio(fast, slow, fast.request_throughput_per_s, slow.request_throughput_per_s,
                                        lambda s: 1.0, "higher", "equal work")
    assert requests.measurable and requests.value == pytest.approx(2.0, rel=0.05) and requests.low < 2.0 < requests.high
    price = compare.throughput_ratio(fast, slow, fast.total_tokens_per_s, slow.total_tokens_per_s,
                                     lambda s: s.input_tokens + s.output_tokens, "lower", "equal work")
    assert price.value == pytest.approx(0.5, rel=0.05) and price.gain == pytest.approx(2.0, rel=0.05)
    assert format.ratio(price, "cheaper", "dearer").startswith(("1.9", "2.0")) and "cheaper" in format.ratio(price, "cheaper", "dearer")
    tpot = compare.latency_ratio(fast, slow, lambda lvl: lvl.tpot_ms, "tpot_ms")
    assert tpot.better == "lower" and tpot.value == pytest.approx(0.5, rel=0.1)
    assert "faster" in format.ratio(tpot)
    assert "slower" in format.ratio(compare.latency_ratio(slow, fast, lambda lvl: lvl.tpot_ms, "tpot_ms"))


def test_equal_work_replays_the_reference_lengths() -> None:
    work = workload.Workload("w", list(PLAN))
    ref = _level(1, [1000, 900, 1100])
    lengths = levels.output_lengths([ref.model_copy(update={"requests": [
        r.model_copy(update={"served_tokens": n}) for r, n in zip(ref.requests, (30, 12, 7))]})])
    fixed = work.with_lengths(lengths)
    assert [r.max_tokens for r in fixed.requests] == [30, 12, 7] and fixed.ignore_eos
    assert [r.messages for r in fixed.requests] == [r.messages for r in work.requests]
    assert work.with_lengths({0: 5}).requests[2].max_tokens == 5  # a prompt the reference never ran: the median


def test_a_ratio_and_its_reciprocal_get_reciprocal_intervals() -> None:
    """Throughput 1.103x and price per token 0.907x from one CI run of a model against its own copy:
    the noise floor made the first span 1 and not the second, so one ratio said 'no difference'
    and the other 'cheaper'."""
    rng = np.random.default_rng(0)
    ratios = np.exp(rng.normal(0.0, 0.01, 1000))
    for point in (1.103, 0.8, 1.5):
        low, high = compare._interval(point, point * ratios, 8)
        r_low, r_high = compare._interval(1 / point, 1 / (point * ratios), 8)
        assert r_low == pytest.approx(1 / high) and r_high == pytest.approx(1 / low)
    low, high = compare._interval(1.103, 1.103 * ratios, 8)
    assert low < 1 < high and compare._interval(1 / 1.103, ratios / 1.103, 8)[1] > 1


def test_what_a_decode_step_reads_and_where_it_is_bound(smol: sources.Model) -> None:
    """SmolLM2 ties its embeddings: a step reads every tensor once (the embedding matrix as the
    lm_head) plus one embedding row; a single sequence is bound by memory, a large batch by compute."""
    folder = Path(smol.path)
    tensors = roofline.tensors(folder)
    sizes = {name: info["data_offsets"][1] - info["data_offsets"][0] for name, info in tensors.items()}
    [embed] = [name for name in tensors if "embed_tokens" in name]
    found = roofline.traffic(folder)
    assert found.weights_bytes == sum(sizes.values()) + sizes[embed] // tensors[embed]["shape"][0]
    assert found.kv_bytes_per_position == 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads of 64, bf16
    assert found.head_macs == 49152 * 576 and found.macs_bf16 > found.head_macs  # the embeddings, as the lm_head
    rates = roofline.Rates(read_gb_s=20.0, bf16_gflop_s=800.0)
    one, limit_one = roofline.bound_tokens_per_s(found, rates, batch=1, context=0)
    assert limit_one == "memory" and one == pytest.approx(20e9 / found.weights_bytes)
    assert roofline.bound_tokens_per_s(found, rates, batch=64, context=0)[1] == "compute"
    # served in float32: every tensor twice its bf16 bytes, but matrices held in bf16 (llmopt's AVX2
    # kernel) stream as stored; the norms and the embedding row looked up are float32 all the same
    wide = roofline.traffic(folder, "float32")
    assert wide.weights_bytes == 2 * found.weights_bytes and wide.kv_bytes_per_position == 2 * found.kv_bytes_per_position
    held = roofline.traffic(folder, "float32", bf16_held=True)
    norms = sum(size for name, size in sizes.items() if "norm" in name)
    assert held.weights_bytes == found.weights_bytes + norms + sizes[embed] // tensors[embed]["shape"][0]
    assert held.macs_bf16 == found.macs_bf16 and held.kv_bytes_per_position == wide.kv_bytes_per_position


def test_a_levels_decode_speed_against_the_bound_by_hand() -> None:
    """Concurrency 2 at TPOT p50 400 ms decodes 5 tokens/s; 1 GB of weights and 8 positions of
    context (7 prompt tokens + half of 1.5 output) at 1 kB each, read at 20 GB/s, allow 40."""
    level = metrics.compute(_run(), TokenCounter(WordTokenizer()), PRICE, GoodputTargets())
    traffic = roofline.Traffic(weights_bytes=10**9, kv_bytes_per_position=1000, macs_int8=0, macs_bf16=0)
    found = benchmark.decode_bound(level, traffic, roofline.Rates(read_gb_s=20.0, bf16_gflop_s=800.0))
    assert found.achieved_tok_s == pytest.approx(5.0) and found.limited_by == "memory"
    assert found.bound_tok_s == pytest.approx(2 / ((10**9 + 2 * 8 * 1000) / 20e9))
    assert found.fraction == pytest.approx(0.125, rel=1e-4)
    assert format.bound(found) == "13% of 40 (memory)"
    assert benchmark.decode_bound(level, roofline.Traffic(0, 0, 0, 0), roofline.Rates(20.0, 800.0)) is None  # weights unknown


def test_a_bound_multiplies_at_the_served_dtypes_rate() -> None:
    """Served in float32 (x86 without AVX-512), a model's float layers multiply at the float32 rate,
    not bf16's (1-10 GFLOP/s there), and its int8 layers at the float rate where no VNNI gave an int8 one."""
    rates = roofline.Rates(read_gb_s=20.0, bf16_gflop_s=1.2, int8_gflop_s=None, fp32_gflop_s=120.0)
    served = roofline.Traffic(weights_bytes=1, kv_bytes_per_position=0, macs_int8=0, macs_bf16=0, dtype="float32")
    assert roofline.matmul_gflop_s(served, rates) == (120.0, 120.0)
    bf16 = roofline.Traffic(weights_bytes=1, kv_bytes_per_position=0, macs_int8=0, macs_bf16=0)
    assert roofline.matmul_gflop_s(bf16, roofline.Rates(20.0, 800.0, int8_gflop_s=1600.0, fp32_gflop_s=300.0)) == (800.0, 1600.0)


def test_a_speculating_levels_bound_counts_the_tokens_a_step_keeps() -> None:
    """Three answers of 30 tokens in all: 27 decoded. 10 steps drafted 30 tokens and 12 were accepted,
    so the 27 took 15 steps (5 drafted nothing, which vLLM's counters leave out): 1.8 tokens and 2
    proposed a step, not the 2.2 the drafting steps alone kept. With n-gram lookup a step still reads
    the target once; a draft model adds its passes."""
    level = metrics.compute(_run(), TokenCounter(WordTokenizer()), PRICE, GoodputTargets())
    assert level.invocations - level.invocation_errors - level.empty_responses == 3
    level.server_counted_tokens.output = 30
    level.speculative = engine_metrics.SpeculationStats(drafts=10, draft_tokens=30, accepted_tokens=12, acceptance_rate=0.4,
                                                        mean_accepted_length=2.2)
    assert benchmark.speculation(level) == roofline.Speculation(proposed=2.0, accepted_length=1.8)
    traffic = roofline.Traffic(weights_bytes=10**9, kv_bytes_per_position=1000, macs_int8=0, macs_bf16=0)
    rates = roofline.Rates(read_gb_s=20.0, bf16_gflop_s=800.0)
    ngram = benchmark.decode_bound(level, traffic, rates)
    assert ngram.bound_tok_s == pytest.approx(2 * 1.8 / ((10**9 + 2 * 8 * 1000) / 20e9)) and ngram.accepted_length == 1.8
    assert format.bound(ngram) == "7% of 72 (memory, 1.8 tokens a step)"
    draft = roofline.Traffic(weights_bytes=10**8, kv_bytes_per_position=100, macs_int8=0, macs_bf16=0)
    drafted = benchmark.decode_bound(level, traffic, rates, draft)
    assert drafted.bound_tok_s == pytest.approx(2 * 1.8 / ((10**9 + 2 * 8 * 1000 + 2.0 * (10**8 + 2 * 8 * 100)) / 20e9))
    assert benchmark.decode_bound(level, traffic, rates, roofline.Traffic(0, 0, 0, 0)) is None  # a draft it cannot read
    level.server_counted_tokens.output = 3 + 12  # counters that cannot be (no step left): no bound, rather than a wrong one
    assert benchmark.decode_bound(level, traffic, rates) is None
    # verifying 4 tokens a step costs 4 tokens' multiply-adds: a batch reaches the compute bound sooner
    heavy = roofline.Traffic(weights_bytes=10**9, kv_bytes_per_position=0, macs_int8=0, macs_bf16=10**9)
    assert roofline.bound_tokens_per_s(heavy, rates, 16, 0)[1] == "memory"
    assert roofline.bound_tokens_per_s(heavy, rates, 16, 0, roofline.Speculation(proposed=3, accepted_length=2.2))[1] == "compute"


def test_the_machines_rates_are_measured_once_and_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path))
    calls = []
    found = roofline.Rates(30.0, 700.0, 1500.0, 33.0, read_median_gb_s=25.0)
    monkeypatch.setattr(roofline, "measure_rates", lambda cores: calls.append(cores) or found)
    cpu = platform.Hardware(device="cpu", cpu_model="AMD EPYC", cores=2, memory_gib=24, cpu_flags=(), gpu=None)
    assert roofline.machine_rates(cpu) == roofline.machine_rates(cpu) == found
    assert calls == [2]
    # a file kept before the bandwidth was read over a window (no median) is measured again, and replaced
    kept = tmp_path / "engine-facts" / f"rates-{cpu.slug}.json"
    kept.write_text(json.dumps({"read_gb_s": 61.5, "bf16_gflop_s": 420.0}))
    assert roofline.machine_rates(cpu) == found and calls == [2, 2]
    assert json.loads(kept.read_text())["read_median_gb_s"] == 25.0
    assert roofline.machine_rates(cpu.model_copy(update={"device": "cuda", "gpu": "L4"})) is None  # the GPU's memory binds there


def test_the_rates_of_this_machine_are_plausible() -> None:
    rates = roofline.measure_rates(1, window_s=1)
    # the dtype served here at a usable rate; bf16 without AVX-512 only for the record: one Zen 3 core
    # did 1-2 GFLOP/s, and 0.5 beside the suite's other worker
    served = rates.fp32_gflop_s if platform.default_dtype(platform.detect()) == "float32" else rates.bf16_gflop_s
    assert 1 < rates.read_gb_s < 1000 and 1 < served < 100_000 and rates.bf16_gflop_s > 0 and rates.copy_gb_s > 1
    assert 1 < rates.read_median_gb_s <= rates.read_gb_s


def test_a_bound_is_left_out_where_it_does_not_apply(smol: sources.Model, tmp_path: Path) -> None:
    """A reading, not the measurement: a draft model or a folder llmopt cannot read, or no rates,
    leave the bound out, and nothing fails."""
    rates = roofline.Rates(read_gb_s=20.0, bf16_gflop_s=800.0)
    unreadable_draft = EngineConfig(speculative=SpeculativeConfig(method="draft_model", model=str(tmp_path), num_speculative_tokens=3))
    (tmp_path / "config.json").write_text("{")
    for weights, engine, given in ((Path(smol.path), unreadable_draft, rates), (tmp_path, None, rates), (Path(smol.path), None, None)):
        level = metrics.compute(_run(), TokenCounter(WordTokenizer()), PRICE, GoodputTargets())
        benchmark.decode_bounds([level], weights, engine, given)
        assert level.decode_bound is None
    benchmark.decode_bounds([level], Path(smol.path), EngineConfig(), rates)
    assert level.decode_bound is not None and level.decode_bound.weights_read_per_token_bytes > 2e8


def test_position_wise_agreement_counts_every_token_after_a_flip_as_lost() -> None:
    """One answer differs in a single inserted token and agrees on 1 of its 4 positions: why jobs
    also record the teacher-forced share (`quality.forced_agreement`, on the engine)."""
    agreed = quality.agreement([[1, 2, 3, 4], [5, 6]], [[1, 9, 2, 3], [5, 6]], forced=0.9)
    assert agreed.token_agreement == pytest.approx(3 / 6) and agreed.identical_outputs == 0.5
    assert agreed.forced_token_agreement == 0.9 and quality.agreement([[1]], [[1]]).forced_token_agreement is None
