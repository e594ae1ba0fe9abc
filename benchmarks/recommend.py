"""`llmopt recommend` on the catalogued models, on this machine: the shipped deployment
configurations (src/llmopt/catalog/configs/<model>.json) are written from these runs, never by hand.

For each catalogued model that is installed: a full recommendation (every candidate the matrix
allows here, concurrency 1, 2, 4 and 8, the built-in QA workload), timed; then the same command
again, which must reuse everything. Recorded beside the configurations: the latency pick's tokens/s
per user at concurrency 1 and the throughput pick's total tokens/s, each over
bf16's (targets: 2.5x and 2x on SmolLM2-135M), and the picks' quality cost. Each kind of machine
has its own results (results/recommend_<machine>.json, reports in results/recommend-<model>-<machine>/)
and its own shipped configurations beside the other kinds'.

    .venv/bin/python benchmarks/recommend.py [MODEL ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import llmopt
from llmopt.engine import platform
from llmopt.errors import LlmoptError
from llmopt.recommendation import configs, ranking, search

RESULTS = Path(__file__).parent / "results"
LEVELS = (1, 2, 4, 8)


def measure(model: str, machine: str) -> dict:
    started = time.monotonic()
    rec = llmopt.recommend(model, goal="balanced", concurrency=LEVELS, output=RESULTS / f"recommend-{model}-{machine}")
    first = time.monotonic() - started
    started = time.monotonic()
    llmopt.recommend(model, goal="balanced", concurrency=LEVELS)
    second = time.monotonic() - started
    shipped = [c.model_copy(update={"source": "shipped"}) for c in search.deployment_configs(rec)]
    configs.save(model, shipped, configs.SHIPPED / f"{model}.json")
    bf16 = {r.concurrency: r for r in rec.rows if r.candidate == "bf16"}
    latency, throughput = rec.picks.get("latency"), rec.picks.get("throughput")
    return {
        "model": model, "candidates": [c.model_dump(include={"name", "status", "reason", "estimate_s", "seconds"}) for c in rec.candidates],
        "left_out": [e.model_dump() for e in rec.excluded], "levels": list(LEVELS),
        "first_run_minutes": round(first / 60, 1), "second_run_seconds": round(second, 1),
        "latency_pick": latency.candidate if latency else None,
        "latency_pick_vs_bf16_per_user_c1": round(latency.tokens_per_s_per_user / bf16[1].tokens_per_s_per_user, 2)
        if latency and latency.concurrency == 1 else None,
        "latency_pick_perplexity_increase": latency.perplexity_increase if latency else None,
        "throughput_pick": throughput.candidate if throughput else None,
        "throughput_pick_concurrency": throughput.concurrency if throughput else None,
        **throughput_ratios(rec.rows, throughput),
        "throughput_pick_perplexity_increase": throughput.perplexity_increase if throughput else None,
        "rows": [r.model_dump() for r in rec.rows],
    }


def throughput_ratios(rows: list[ranking.Row], pick: ranking.Row | None) -> dict[str, float | None]:
    """The throughput pick's total tokens/s over bf16's at the pick's own level, and the best total
    at c=8 over bf16's there: the pick may sit at a lower level than 8 (the best total is not always
    at the highest), and over bf16 at c=8 it would take credit for bf16's own fall from c=4 to c=8."""
    bf16 = {r.concurrency: r.total_tokens_per_s for r in rows if r.candidate == "bf16"}
    best_c8 = max((r.total_tokens_per_s for r in rows if r.concurrency == 8), default=None)
    return {
        "throughput_pick_vs_bf16_same_level": round(pick.total_tokens_per_s / bf16[pick.concurrency], 2)
        if pick and pick.concurrency in bf16 else None,
        "throughput_pick_vs_bf16_best_level": round(pick.total_tokens_per_s / max(bf16.values()), 2) if pick and bf16 else None,
        "best_total_c8_vs_bf16_c8": round(best_c8 / bf16[8], 2) if best_c8 and 8 in bf16 else None,
    }


def main() -> None:
    models = sys.argv[1:] or [c.id for c in llmopt.catalog_models()]
    hardware = platform.detect()
    results = RESULTS / f"recommend_{hardware.slug}.json"
    found = json.loads(results.read_text())["models"] if results.exists() else {}
    for model in models:
        try:
            found[model] = measure(model, hardware.slug)
        except LlmoptError as exc:  # a catalogued model whose packages are not installed here
            print(f"{model}: skipped ({exc.one_line()})")
    results.write_text(json.dumps({"processor": hardware.cpu_label, "cores": hardware.cores, "models": found}, indent=2))
    for model, result in found.items():
        print(f"\n{model}: first run {result['first_run_minutes']} min, again {result['second_run_seconds']} s")
        print(f"  latency pick {result['latency_pick']}: {result['latency_pick_vs_bf16_per_user_c1']}x bf16 tokens/s per user at c=1")
        print(f"  throughput pick {result['throughput_pick']}@{result['throughput_pick_concurrency']}: "
              f"{result['throughput_pick_vs_bf16_same_level']}x bf16's total tokens/s at its level, "
              f"{result['throughput_pick_vs_bf16_best_level']}x bf16's best; best at c=8 {result['best_total_c8_vs_bf16_c8']}x bf16's")
        for candidate in result["candidates"]:
            print(f"  {candidate['name']:<24} {candidate['status']:<8} estimate {candidate['estimate_s'] / 60:5.1f} min, "
                  f"took {(candidate['seconds'] or 0) / 60:5.1f} min {candidate['reason'] or ''}")


if __name__ == "__main__":
    main()
