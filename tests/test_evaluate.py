"""Evaluate end to end: a sweep against the real engine, a comparison of two deployments, the HTML
report in headless Chromium, and the failure paths (bad data, unreachable or dying servers)."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from rich.console import Console

import llmopt
from llmopt.engine.vllm import free_port
from llmopt.errors import LlmoptError
from llmopt.evaluation import loadgen, workload
from llmopt.evaluation.results import Comparison, LevelRatios, Ratio, TargetComparison
from llmopt.evaluation import stub as stub_server
from llmopt.presentation import terminal

from conftest import assert_one_line_error, run_cli

SCREENSHOTS = Path(__file__).parent / "screenshots"


@pytest.mark.engine
def test_sweep_against_the_real_engine(endpoint, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    result = run_cli("evaluate", "--endpoint", endpoint.name, "--concurrency", "1,2", "--requests", "8", "--min-duration", "0",
                     "--output", str(out), "--price-per-hour", "1.0", "--discount", "0.2", "--ttft-target", "5000")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TTFT" in result.stdout and "results:" in result.stdout
    data = llmopt.load_results(out)
    assert json.loads((out / "results.json").read_text())["schema_version"] == data.schema_version == 2
    assert data.workload.name == "builtin-qa" and data.workload.seed == 0 and data.workload.temperature == 0
    assert data.price.effective_price_per_hour == pytest.approx(0.8)
    (target,) = data.targets
    assert [lvl.concurrency for lvl in target.levels] == [1, 2]
    for lvl in target.levels:
        assert lvl.invocations == 8 and lvl.invocation_errors == 0 and lvl.tokenizer_failures == 0
        assert len(lvl.requests) == 8 and all(0 < r.ttft_ms < r.latency_ms for r in lvl.requests)
        assert sorted(r.prompt for r in lvl.requests) == list(range(2, 10))  # every level's: past c=2's warm-up
        assert 0 < lvl.ttft_ms.p50 <= lvl.latency_ms.p50
        assert lvl.itl_ms.p50 > 0 and lvl.tpot_ms.p90 > 0
        assert lvl.output_tokens_per_s > 0 and lvl.input_tokens_per_s > lvl.output_tokens_per_s
        assert 500 <= lvl.per_request.input_tokens.min and lvl.per_request.input_tokens.max <= 1000
        # the tokenizer's prompt counts agree with the server's own
        assert lvl.server_counted_tokens.input == round(lvl.per_request.input_tokens.mean * 8)
        blended = 0.8 / ((lvl.input_tokens_per_s + lvl.output_tokens_per_s) * 3600 / 1e6) / 4
        assert lvl.price.blended_per_million_tokens == pytest.approx(blended)
        assert lvl.accuracy.answered == 8
        assert lvl.speculative is None
        # the engine's prefix-cache counters cover exactly the level's prompts, each looked up once
        assert lvl.prefix_cache.queried_tokens == lvl.server_counted_tokens.input
        assert 0 <= lvl.prefix_cache.hit_tokens < lvl.prefix_cache.queried_tokens
        # how close decoding came to this machine's bound, from the served weights and measured bandwidth
        bound = lvl.decode_bound
        assert bound is not None and bound.weights_read_per_token_bytes > 2e8 and bound.read_gb_s > 1
        assert 0.05 < bound.fraction < 1.2, bound  # a bound is not beaten, beyond the noise of measuring it
    assert target.levels[0].decode_bound.limited_by == "memory"
    assert 5 < target.quality.perplexity.perplexity < 100
    assert len(target.quality.greedy_tokens) == 4
    html = (out / "report.html").read_text()
    assert "<svg" in html and "Time to first token" in html and "GB/s measured read bandwidth" in html
    assert "decode vs bound" in result.stdout and "prefix cached" in result.stdout and "prefix-cached" in html
    assert "<script" not in html and "<link" not in html and "src=" not in html  # reads offline
    _screenshot(out / "report.html", "single")


@pytest.mark.slow  # CI's budget (over 3 min on a Zen 3 EPYC): a statistical check; comparing on equal work runs in CI in the demo's test
@pytest.mark.engine
def test_a_target_against_its_own_copy_is_no_measurable_difference(smol, baseline, tmp_path: Path) -> None:
    """The baseline artifact holds the source's weights bit for bit: every throughput ratio on equal
    work has an interval that spans 1, shown as no measurable difference. The intervals' floor is
    the spread between deployments measured on these machines (95% of pairs within 15-23%), so a
    pair of deployments lands outside it now and then (once in CI: the source 1.40x slower than
    its copy, passing alone right after); a difference between identical weights must then show
    again in a second comparison to fail (a bias that crosses the floor every time still fails; the
    first reading is kept as a warning, so a flake stays visible)."""
    out = tmp_path / "compare"

    def compared() -> tuple[llmopt.EvaluationResults, list[Ratio]]:
        results = llmopt.evaluate(compare=[smol.id, str(baseline.artifact)], concurrency=[1], requests=8, min_duration_s=0,
                                  output=out)
        (level,) = results.comparison.targets[0].levels
        ratios = [level.requests_per_s, level.output_tokens_per_s, level.total_tokens_per_s, level.blended_price]
        return results, ratios

    results, ratios = compared()
    if any(ratio.measurable for ratio in ratios):
        warnings.warn(f"identical weights compared measurably different, compared again: {ratios}")
        results, ratios = compared()
    assert [t.kind for t in results.targets] == ["deployed", "deployed"]
    reference, copy = results.targets
    lengths = {s.prompt: s.served_tokens for s in reference.equal_work[0].requests}
    assert all(s.served_tokens == lengths[s.prompt] for s in copy.equal_work[0].requests)  # equal work, request by request
    row = results.comparison.targets[0]
    assert row.reference == smol.id and row.label == baseline.artifact.name
    for ratio in ratios:
        assert ratio.leg == "equal work" and not ratio.measurable, ratio
    for target in results.targets:  # each leg prefills from a cold prefix cache (a cached one took a sixth of the time)
        assert target.equal_work[0].ttft_ms.p50 > 0.6 * target.levels[0].ttft_ms.p50, target.label
    assert row.perplexity_ratio == pytest.approx(1.0, abs=0.01)  # same weights, same engine
    assert row.greedy_agreement.token_agreement > 0.9 and row.greedy_agreement.forced_token_agreement > 0.95
    assert "no measurable difference" in (out / "report.html").read_text()
    _screenshot(out / "report.html", "compare")


@pytest.mark.engine
@pytest.mark.slow  # four deploys for a statistical check; the equal-work leg itself runs in CI (the demo's test)
def test_equal_work_ratio_matches_the_decode_speed_ratio(baseline, smoothquant, tmp_path: Path) -> None:
    """Outputs of different lengths (INT8 rounds differently): the equal-work ratio of output tokens/s
    agrees with the ratio of fixed-length decode speeds within what each measured, their confidence
    intervals overlapping. A 10% tolerance was the measured noise at concurrency 1 and failed in CI."""
    stories = tmp_path / "sentences.jsonl"
    stories.write_text("".join(json.dumps({"prompt": f"Write two sentences about {topic}.", "max_tokens": 120}) + "\n"
                               for topic in ("a lighthouse", "a lost key", "a river in spring", "a winter market",
                                             "a clockmaker", "a walled garden", "a night train", "a red kite")))
    targets = [str(baseline.artifact), str(smoothquant.artifact)]
    natural = llmopt.evaluate(compare=targets, dataset=str(stories), concurrency=[1], requests=16, min_duration_s=0, quality=False)
    median = sorted(s.served_tokens for s in natural.targets[0].levels[0].requests)[8]
    fixed = llmopt.evaluate(compare=targets, dataset=f"synthetic:24,{median}", concurrency=[1], requests=16, min_duration_s=0,
                            quality=False)
    lengths = [sorted(s.served_tokens for s in t.levels[0].requests) for t in natural.targets]
    assert lengths[0] != lengths[1], "the two targets must answer at different lengths for this test to mean anything"
    equal_work = natural.comparison.targets[0].levels[0].output_tokens_per_s
    decode = fixed.comparison.targets[0].levels[0].output_tokens_per_s
    assert equal_work.leg == "equal work" and decode.leg == "equal work"
    assert equal_work.low <= decode.high and decode.low <= equal_work.high, (equal_work, decode)
    assert equal_work.high - equal_work.low < 0.5 * equal_work.value, equal_work  # an interval narrow enough to mean it


@pytest.mark.engine
def test_jsonl_with_malformed_lines(endpoint, tmp_path: Path) -> None:
    data = tmp_path / "mine.jsonl"
    data.write_text("\n".join([
        json.dumps({"prompt": "What is the capital of France?", "max_tokens": 8, "expected": "Paris"}),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}),
        json.dumps({"nothing": 1}),
    ]))
    results = llmopt.evaluate(endpoint=endpoint.name, dataset=str(data), concurrency=[1], requests=2, min_duration_s=0,
                              quality=False)
    assert results.workload.skipped_lines.model_dump() == {"count": 2, "line_numbers": [2, 4]}
    assert results.targets[0].levels[0].invocation_errors == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{broken\n[]\n")
    assert_one_line_error(run_cli("evaluate", "--endpoint", endpoint.name, "--dataset", str(bad)), "no valid line")


def test_unreachable_endpoint_is_a_clear_error() -> None:
    assert_one_line_error(run_cli("evaluate", "--url", f"http://127.0.0.1:{free_port()}"), "cannot reach")


async def _salts_sent(version: str | None, levels: list[tuple[int, loadgen.RunSettings]]) -> list[list[str | None]]:
    """The `cache_salt` of every request a stub server got, level by level, in order; the stub
    answers /version as the given vLLM release would (or not at all)."""
    work = workload.Workload("w", [workload.Request(({"role": "user", "content": f"q{i}"},), 2) for i in range(8)])
    seen: list[str | None] = []

    @web.middleware
    async def record(request: web.Request, handler):
        if request.method == "POST":
            seen.append((await request.json()).get("cache_salt"))
        return await handler(request)

    app = stub_server.make_app(2, 0.0)
    app.middlewares.append(record)
    async def answer_version(request: web.Request) -> web.Response:
        return web.json_response({"version": version})

    if version:
        app.router.add_get("/version", answer_version)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    found = []
    try:
        for concurrency, settings in levels:
            seen.clear()
            run = await loadgen.run_level(f"http://127.0.0.1:{port}", "stub", work, concurrency, settings, {})
            assert not any(r.error for r in run.records)
            found.append(list(seen))
    finally:
        await runner.cleanup()
    return found


def test_every_pass_gets_its_own_prefix_cache_salt_and_only_vllm_gets_one() -> None:
    """A level's warm-up, and each pass over its prompts (and over the workload's, when a pass sends
    more than the workload has), get a salt of their own, and the next level (or leg) others, so no
    request reuses a prompt cached before it; a server that is not vLLM, or a vLLM too old to take
    the field, is sent none."""
    four = loadgen.RunSettings(requests_per_level=4)
    first, second = asyncio.run(_salts_sent("0.32.0", [(1, four), (2, four)]))
    assert len(first) == 5 and first[0].startswith("llmopt-") and first[0].endswith("-warmup")  # one warm-up, four measured
    assert len(set(first[1:])) == 1 and first[1] != first[0]  # four requests of four prompts: one pass
    assert len(second) == 6 and len(set(second[2:])) == 1 and not set(second) & set(first)
    assert asyncio.run(_salts_sent(None, [(1, four)])) == asyncio.run(_salts_sent("0.10.1", [(1, four)])) == [[None] * 5]
    (passes,) = asyncio.run(_salts_sent("0.32.0", [(1, loadgen.RunSettings(requests_per_level=4, warmup_requests=0,
                                                                               min_duration_s=0.3))]))
    assert len(passes) > 8 and len(passes) % 4 == 0  # past the level's time in whole passes: every level's work is alike
    assert all(passes[k] == passes[k - k % 4] for k in range(len(passes)))  # one salt a pass of four
    assert len(set(passes)) == (len(passes) + 3) // 4, passes  # and a new one for every pass
    (longer,) = asyncio.run(_salts_sent("0.32.0", [(1, loadgen.RunSettings(requests_per_level=12, warmup_requests=0))]))
    assert longer[:8] == [longer[0]] * 8 and longer[8:] == [longer[8]] * 4 and longer[8] != longer[0]  # 8 prompts, then again


def test_natural_lengths_cover_every_prompt_and_replay_exactly(smol, tmp_path: Path) -> None:
    """The sweep's equal work at natural lengths: one pass over every prompt the levels send (the
    stub answers each with its max_tokens, so those are the natural lengths), then every level
    generates exactly those, end-of-sequence ignored."""
    from llmopt.evaluation import levels

    jsonl = tmp_path / "lengths.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": n}) + "\n" for i, n in enumerate((3, 5, 7, 9))))
    url, proc = stub_server.start()
    try:
        plan = levels.Plan(dataset=str(jsonl), concurrency=(1, 2), requests=4, min_duration_s=0)
        lengths = levels.natural_lengths(url, "stub", smol.path, plan)
        assert lengths == {0: 3, 1: 5, 2: 7, 3: 9}
        found = levels.measure(url, "stub", smol.path, plan, lengths={0: 2, 1: 4, 2: 6, 3: 8})
        found += levels.measure(url, "stub", smol.path, plan, lengths={0: 2, 1: 4, 2: 6, 3: 8}, only=2)
    finally:
        proc.kill()
        proc.wait()
    assert [lvl.concurrency for lvl in found] == [1, 2, 2]
    for level in found:
        assert level.requests and all(r.served_tokens == 2 * (r.prompt + 1) for r in level.requests)


def test_every_level_sends_the_same_prompts(smol, tmp_path: Path) -> None:
    """Levels compare on equal work: each sends the same prompts, as many as the highest level needs
    (4 per user), from past the largest warm-up. A speculation sweep, which compares within a level
    only, can ask each level for just its own."""
    from llmopt.evaluation import levels

    jsonl = tmp_path / "many.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 1 + i % 5}) + "\n" for i in range(40)))
    url, proc = stub_server.start()
    try:
        plan = levels.Plan(dataset=str(jsonl), concurrency=(1, 4), requests=4, min_duration_s=0)
        equal = levels.measure(url, "stub", smol.path, plan)
        alone = levels.measure(url, "stub", smol.path, plan, only=1)
        own = levels.measure(url, "stub", smol.path, plan.model_copy(update={"equal_levels": False}))
        lengths = levels.natural_lengths(url, "stub", smol.path, plan)
    finally:
        proc.kill()
        proc.wait()
    low, high = (sorted(r.prompt for r in level.requests) for level in equal)
    assert low == high == list(range(4, 20))  # 4 per user of c=4, past c=4's warm-up, at c=1 too
    assert [sorted(r.prompt for r in level.requests) for level in alone] == [low]  # one level alone: the plan's prompts
    assert sorted(lengths) == list(range(20))  # the natural lengths of what the levels send, not of all 40
    assert sum(r.output_tokens for r in equal[0].requests) == sum(r.output_tokens for r in equal[1].requests)
    assert [sorted(r.prompt for r in level.requests) for level in own] == [list(range(1, 5)), list(range(4, 20))]


def test_the_prompts_a_plan_sends() -> None:
    """Warm-ups and measured prompts, at most what the workload has; a timed level may cycle
    through all of them."""
    from llmopt.evaluation import levels

    plan = levels.Plan(concurrency=(1, 4), requests=4)
    assert plan.prompts_sent(40) == 4 + 16 and plan.prompts_sent(10) == 10
    assert plan.model_copy(update={"equal_levels": False}).prompts_sent(40) == 4 + 16  # c=4's own warm-up and 16
    assert plan.model_copy(update={"equal_levels": False, "concurrency": (1, 2)}).prompts_sent(40) == 2 + 8
    assert plan.model_copy(update={"warmup_requests": 0, "requests": 30}).prompts_sent(40) == 30
    assert plan.model_copy(update={"duration_s": 5.0}).prompts_sent(40) == 40


@pytest.fixture()
def stub():
    """A real HTTP server that streams slowly (10 tokens/s), so it can die or time out mid-run."""
    url, proc = stub_server.start(delay_s=0.1)
    yield url, proc
    proc.kill()
    proc.wait()


def test_endpoint_dying_mid_run_saves_partial_results(stub, tmp_path: Path) -> None:
    url, proc = stub
    jsonl = tmp_path / "long.jsonl"
    jsonl.write_text(json.dumps({"prompt": "go", "max_tokens": 30}) + "\n")
    out = tmp_path / "partial"
    cli = subprocess.Popen([sys.executable, "-c", "from llmopt.cli import main; main()", "evaluate", "--url", url,
                            "--dataset", str(jsonl), "--concurrency", "2", "--requests", "40", "--min-duration", "0",
                            "--output", str(out), "--no-quality"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # 3 s answers, two at a time: the warm-up's (3 s) and then measured ones, however slow the machine is to start the CLI
    while httpx.get(f"{url}/stats").json()["answered"] < 6 and time.monotonic() < deadline:
        time.sleep(0.5)
    proc.kill()
    stdout, stderr = cli.communicate(timeout=120)
    assert cli.returncode == 1
    assert "stopped answering" in stderr and "partial results were saved" in stderr
    level = llmopt.load_results(out).targets[0].levels[0]
    assert level.aborted and level.invocation_errors >= 1 and level.invocations < 40
    assert level.invocations - level.invocation_errors >= 1  # what finished before the death is kept


def test_requests_that_time_out_are_errors(stub, tmp_path: Path) -> None:
    url, _ = stub
    jsonl = tmp_path / "slow.jsonl"
    jsonl.write_text(json.dumps({"prompt": "go", "max_tokens": 50}) + "\n")  # 5 s at 10 tokens/s
    results = llmopt.evaluate(url=url, dataset=str(jsonl), concurrency=[2], requests=2, timeout_s=1, min_duration_s=0,
                              quality=False)
    level = results.targets[0].levels[0]
    assert level.invocations == 8  # at least 4 requests per concurrent user
    assert level.invocation_errors == 8 and level.errors == {"timeout after 1 s": 8}


@pytest.mark.engine
def test_bad_arguments_are_refused(endpoint) -> None:
    assert_one_line_error(run_cli("evaluate", "--endpoint", endpoint.name, "--concurrency", "1,x"), "bad --concurrency")
    assert_one_line_error(run_cli("evaluate", "--endpoint", endpoint.name, "--hardware", "nope"), "unknown hardware profile")
    assert_one_line_error(run_cli("evaluate", "--endpoint", endpoint.name, "--dataset", "nope"), "unknown dataset")
    assert_one_line_error(run_cli("evaluate"), "name what to evaluate")
    with pytest.raises(LlmoptError, match="outside"):
        llmopt.evaluate(endpoint=endpoint.name, discount=1.5)


def _screenshot(html: Path, name: str) -> None:
    """Render the report in headless Chromium; the PNG is kept for a person to look at."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (scripts/install.sh --with-test-tools installs it)")
    SCREENSHOTS.mkdir(exist_ok=True)
    png = SCREENSHOTS / f"report-{name}.png"
    png.unlink(missing_ok=True)
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={html.parent / 'chromium-profile'}", "--window-size=1400,2000",
                    f"--screenshot={png}", html.as_uri()], capture_output=True, timeout=120)
    assert png.exists() and png.stat().st_size > 20_000, "Chromium did not render the report"


def test_a_comparison_too_wide_for_the_terminal_names_the_level_in_every_table() -> None:
    """A comparison row is a target at a level; where the columns go on in further tables, each is
    led by both, so no row reads as a repeat of the one above it."""
    def level(concurrency: int) -> LevelRatios:
        r = Ratio(value=1.2, low=1.1, high=1.3, leg="equal work", better="higher")
        return LevelRatios(concurrency=concurrency, output_tokens_per_s=r, requests_per_s=r, total_tokens_per_s=r,
                           blended_price=r, ttft_p50=r, tpot_p50=r, latency_p50=r)

    compared = Comparison(reference="base", targets=[TargetComparison(label="optimized", reference="base",
                                                                      levels=[level(1), level(4)], perplexity_ratio=1.01)])
    out = io.StringIO()
    terminal.comparison_listing(compared, Console(file=out, width=120))
    tables = [t for t in out.getvalue().split("┏") if "┃" in t]
    assert len(tables) > 1, "the columns do not fit 120 characters: more than one table"
    for table in tables:
        assert "┃ concurrency" in table
        body = [line for line in table.splitlines() if line.startswith("│ optimized")]
        assert [line.split("│")[2].strip() for line in body] == ["1", "4"], table
