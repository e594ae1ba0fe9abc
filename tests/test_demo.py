"""The README's main job, `llmopt demo`, on the real engine and the packaged model: optimize with what
pays on this processor, then load the original and the artifact side by side, on equal work."""

from __future__ import annotations

from pathlib import Path

import pytest

import llmopt
from llmopt import endpoints, procs, recipe
from llmopt.presentation import format

from conftest import INT8_FAST, SUITE_SMOOTHQUANT, run_cli


@pytest.mark.engine
def test_demo_optimizes_and_compares_on_the_real_engine(smol, smoothquant, tmp_path: Path) -> None:
    """(`smoothquant`: the session's job of the same recipe has ended, so the demo reuses its artifact.)"""
    before = {e.name for e in endpoints.list_endpoints()}
    chosen = llmopt.demo_recipe(smol.id)
    # SmoothQuant where VNNI sums its int8 products (AVX-512 VNNI and AMX alike) or, on AVX2 alone,
    # llmopt's AVX2 W8A8 kernel does; elsewhere (AVX-512 without VNNI) oneDNN's saturate
    assert chosen.techniques() == ["quantization.smoothquant", "speculative.ngram"][0 if INT8_FAST else 1:]
    # The same path, minutes less: the suite's SmoothQuant recipe (its artifact is shared), not the
    # default's n-gram sweep; where SmoothQuant does not pay, the n-gram speculation the demo picks
    # there, unswept (test_speculative sweeps) and off above one user, which shares the plain model's
    # compiled code (and is not recommend's n-gram candidate, which its test builds).
    chosen_here = SUITE_SMOOTHQUANT if INT8_FAST else {"name": "ngram", "speculative": {"method": "ngram", "disable_above_batch": 1}}
    recipe_file = tmp_path / "recipe.yaml"
    recipe.save(recipe.parse(chosen_here), recipe_file)
    # at 1 and 2 users, not the README's 1 and 4: a level sends 4 requests per user of the highest, so
    # half as many; short synthetic requests, not the QA set's ~610-token prompts (which a float32
    # prefill takes a second or more over, where llmopt serves float32)
    result = run_cli("demo", "--recipe", str(recipe_file), "--concurrency", "1,2", "--requests", "4", "--min-duration", "0",
                     "--dataset", "synthetic:128,16", "--output", str(tmp_path / "demo"), timeout=2400)
    assert result.returncode == 0, result.stderr[-3000:]
    name = chosen_here["name"]
    assert f"recipe {name}: {recipe.parse(chosen_here).techniques()[0]}" in result.stdout
    job = next(j for j in llmopt.list_jobs() if j.recipe.get("name") == name and j.status == "COMPLETED")
    assert f"artifact at {job.artifact}" in result.stdout
    results = llmopt.load_results(tmp_path / "demo")
    assert results.workload.name == "synthetic:128,16"
    base, optimized = results.targets
    assert base.label == smol.id and optimized.label == Path(job.artifact).name
    for target in (base, optimized):
        assert [lvl.concurrency for lvl in target.levels] == [1, 2]
        assert all(lvl.invocations == 8 and lvl.invocation_errors == 0 and lvl.output_tokens_per_s > 0
                   for lvl in target.levels)  # 4 per user of the highest level, at every level
        low, high = ({r.prompt for r in lvl.requests} for lvl in target.levels)
        assert low == high  # the same prompts at both levels: levels compare on equal work
        assert [lvl.concurrency for lvl in target.equal_work] == [1, 2]
    row = results.comparison.targets[0]
    first = row.levels[0].requests_per_s
    assert first.leg == "equal work"
    assert first.value == optimized.equal_work[0].request_throughput_per_s / base.equal_work[0].request_throughput_per_s
    # the verdict states the measured numbers, each with its leg and interval, not a canned claim
    stdout = " ".join(result.stdout.split())
    assert f"requests/s on equal work {format.ratio(first, 'more', 'fewer')} at concurrency 1" in stdout
    assert f"time per output token {format.ratio(row.levels[0].tpot_p50)} at concurrency 1 (natural outputs)" in stdout
    assert f"price per token on equal work {format.ratio(row.levels[-1].blended_price, 'cheaper', 'dearer')}" in stdout
    assert f"perplexity {100 * (row.perplexity_ratio - 1):+.1f}%" in stdout
    forced = row.greedy_agreement.forced_token_agreement
    assert f"{forced:.0%} of the reference's greedy tokens ranked first too" in stdout and forced > 0.75
    assert (tmp_path / "demo" / "report.html").is_file()
    # the original and the artifact were deployed in turn, and both are stopped
    deployed = [e for e in endpoints.list_endpoints() if e.name not in before]
    assert sorted(e.model for e in deployed) == sorted([smol.id, Path(job.artifact).name])
    assert all(e.status == endpoints.STOPPED and not procs.is_alive(e.pid, e.pid_create_time) for e in deployed)
