"""How long the studio takes to render its two busiest pages, the jobs and the evaluations, with
1,000 records of each in the home (target: under 200 ms each), and what one poll of a live list
page costs (the feed behind it reads the records once a second, however many tabs watch).

Records are inserted straight into their tables (no job or evaluation runs) in a temporary home;
pages are rendered through the studio's own app, in process, as a browser would request them.
Writes benchmarks/results/studio_render.json.
Usage: python benchmarks/studio_render.py [records] [repeats]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ["LLMOPT_HOME"] = tempfile.mkdtemp(prefix="llmopt-studio-render-")  # before llmopt is imported

from fastapi.testclient import TestClient  # noqa: E402

from llmopt import procs, sdk  # noqa: E402
from llmopt.evaluation import pricing, runs  # noqa: E402
from llmopt.engine import platform  # noqa: E402
from llmopt.evaluation.levels import Plan  # noqa: E402
from llmopt.jobs import store  # noqa: E402
from llmopt.studio.app import create_app  # noqa: E402

TARGET_MS = 200.0
TOKEN = "benchmark"
JOB_STATUSES = (store.COMPLETED, store.COMPLETED, store.FAILED, store.STOPPED, store.INPROGRESS)
STEPS = ("quantize", "speculative_sweep", "measure")


def insert(count: int) -> None:
    """`count` jobs (one in five running, owned by this process so it stays running) and `count`
    evaluations, in one transaction per table."""
    now, me = time.time(), os.getpid()
    created = procs.create_time(me)
    price = pricing.REFERENCE["r7i.large"].model_dump(mode="json")
    plan = Plan().model_dump(mode="json")
    with store.JOBS.transaction() as conn:
        for i in range(count):
            status = JOB_STATUSES[i % len(JOB_STATUSES)]
            active = status in store.ACTIVE
            progress = {step: store.StepProgress(status="running" if active and n == 1 else "done" if not active or n == 0 else "pending",
                                                 fraction=1.0 if not active or n == 0 else 0.3 if n == 1 else 0.0, seconds=12.5)
                        for n, step in enumerate(STEPS)}
            store.JOBS.insert(store.JobRecord(
                name=f"job-{i:05d}", source="smollm2-135m-instruct", recipe={"name": "smoothquant", "quantization": {"method": "smoothquant"}},
                status=status, log_path=f"/tmp/job-{i}.log", output_dir=f"/tmp/artifacts/job-{i:05d}",
                artifact=f"/tmp/artifacts/job-{i:05d}" if status == store.COMPLETED else None,
                failure_reason="the quality budget was exceeded" if status == store.FAILED else None, progress=progress,
                pid=me if active else None, pid_create_time=created if active else None,
                created_at=now - count + i, started_at=now - count + i, ended_at=None if active else now - count + i + 300), conn)
    with runs.EVALUATIONS.transaction() as conn:
        for i in range(count):
            runs.EVALUATIONS.insert(runs.EvaluationRecord(
                name=f"eval-{i:05d}", status=runs.COMPLETED, output_dir=f"/tmp/evaluations/eval-{i:05d}", log_path=f"/tmp/eval-{i}.log",
                arguments={"targets": [["smollm2-135m-instruct", "model"], [f"/tmp/artifacts/job-{i:05d}", "model"]], "plan": plan,
                           "price": price, "quality": True, "tokenizer": None, "api_key": None},
                progress=runs.Progress(stage="done"), created_at=now - count + i, started_at=now - count + i,
                ended_at=now - count + i + 600), conn)


def timed(call: Callable[[], object], repeats: int) -> list[float]:
    call()  # warm: templates compiled, tables checked
    found = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        found.append((time.perf_counter() - start) * 1000)
    return found


def main(count: int, repeats: int) -> None:
    insert(count)
    client = TestClient(create_app(TOKEN), headers={"Authorization": f"Bearer {TOKEN}"})

    def page(path: str) -> Callable[[], object]:
        def get() -> object:
            response = client.get(path)
            assert response.status_code == 200, (path, response.status_code)
            return response
        return get

    cases = [
        ("jobs page (newest 100 of them)", "/jobs", page("/jobs")),
        ("jobs page, every job on one page", "/jobs?limit=100000", page("/jobs?limit=100000")),
        ("evaluations page (newest 100 of them)", "/evaluations", page("/evaluations")),
        ("evaluations page, every evaluation on one page", "/evaluations?limit=100000", page("/evaluations?limit=100000")),
        ("a live jobs page's poll (sdk.list_jobs)", None, sdk.list_jobs),
        ("a live evaluations page's poll (sdk.list_evaluations)", None, sdk.list_evaluations),
    ]
    rows = []
    for label, path, call in cases:
        samples = timed(call, repeats)
        size = len(call().content) if path else None  # type: ignore[attr-defined]
        rows.append({"what": label, "path": path, "median_ms": round(statistics.median(samples), 1),
                     "max_ms": round(max(samples), 1), "bytes": size})
    print(f"{count} jobs and {count} evaluations, {repeats} renders each (median and slowest):\n")
    print(f"{'what':<56} {'median ms':>10} {'max ms':>8} {'KB':>7}")
    for row in rows:
        kb = f"{row['bytes'] / 1000:.0f}" if row["bytes"] else ""
        print(f"{row['what']:<56} {row['median_ms']:>10.1f} {row['max_ms']:>8.1f} {kb:>7}")
    default_pages = [r for r in rows if r["path"] in ("/jobs", "/evaluations")]
    met = all(r["median_ms"] < TARGET_MS for r in default_pages)
    print(f"\ntarget: each page under {TARGET_MS:.0f} ms: {'met' if met else 'NOT met'}")
    out = Path(__file__).parent / "results" / "studio_render.json"
    out.write_text(json.dumps({"records": count, "repeats": repeats, "target_ms": TARGET_MS, "cores": os.cpu_count(),
                               "processor": platform.detect().cpu_label,
                               "rows": rows, "met": met}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000, int(sys.argv[2]) if len(sys.argv) > 2 else 15)
