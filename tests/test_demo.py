"""The README's main job, `llmopt demo`, on the real engine and the packaged model: optimize with
SmoothQuant, then load the original and the artifact side by side."""

from __future__ import annotations

from pathlib import Path

import pytest

import llmopt
from llmopt import endpoints, procs

from conftest import run_cli


@pytest.mark.engine
def test_demo_optimizes_and_compares_on_the_real_engine(smol, tmp_path: Path) -> None:
    before = {e.name for e in endpoints.list_endpoints()}
    result = run_cli("demo", "--requests", "4", "--output", str(tmp_path / "demo"))
    assert result.returncode == 0, result.stderr[-3000:]
    job = next(j for j in llmopt.list_jobs() if j.recipe.get("name") == "smoothquant" and j.status == "COMPLETED")
    assert f"artifact at {job.artifact}" in result.stdout
    results = llmopt.load_results(tmp_path / "demo")
    base, optimized = results.targets
    assert base.label == smol.id and optimized.label == Path(job.artifact).name
    for target in (base, optimized):
        assert [lvl.concurrency for lvl in target.levels] == [1, 4]
        assert all(lvl.invocations == 4 and lvl.invocation_errors == 0 and lvl.output_tokens_per_s > 0 for lvl in target.levels)
    row = results.comparison.targets[0]
    first = row.levels[0].output_tokens_per_s
    assert first == optimized.levels[0].output_tokens_per_s / base.levels[0].output_tokens_per_s
    # the verdict line states the measured numbers, not a canned claim
    assert f"{first:.2f}x output tokens/s at concurrency 1" in result.stdout
    assert f"perplexity {100 * (row.perplexity_ratio - 1):+.1f}%" in result.stdout
    assert (tmp_path / "demo" / "report.html").is_file()
    # the original and the artifact were deployed in turn, and both are stopped
    deployed = [e for e in endpoints.list_endpoints() if e.name not in before]
    assert sorted(e.model for e in deployed) == sorted([smol.id, Path(job.artifact).name])
    assert all(e.status == endpoints.STOPPED and not procs.is_alive(e.pid, e.pid_create_time) for e in deployed)
