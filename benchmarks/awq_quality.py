"""What it takes for AWQ W4A16 to stay within 12% perplexity of bf16 on SmolLM2-135M.

Each variant is a real optimization job (llm-compressor, then vLLM serves the artifact and
measures perplexity on llmopt's held-out passages); the bf16 baseline job runs in the same session.
Varies the calibration data and size, symmetric against asymmetric, group size, and which layers
stay in bf16. Writes benchmarks/results/awq_quality.json.   Usage: python benchmarks/awq_quality.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import llmopt
from llmopt import AWQ, Calibration, Recipe, artifact

MODEL = "smollm2-135m-instruct"
NO_BUDGET = 10.0  # measure every variant; the job's budget check would fail the ones over 12%
VARIANTS: dict[str, dict] = {
    "asym g64, builtin": {},
    "sym g64, builtin": {"symmetric": True},
    "asym g64, sharegpt 64x384": {"calibration": Calibration(dataset="sharegpt")},
    "asym g64, sharegpt 128x512": {"calibration": Calibration(dataset="sharegpt", samples=128, sequence_length=512)},
    "asym g64, builtin, down_proj bf16": {"ignore": ["lm_head", "re:.*down_proj"]},
    "asym g64, builtin, first+last layer bf16": {"ignore": ["lm_head", "re:.*layers\\.0\\..*", "re:.*layers\\.29\\..*"]},
    "asym g32, builtin, down_proj bf16": {"group_size": 32, "ignore": ["lm_head", "re:.*down_proj"]},
    "asym g32, builtin": {"group_size": 32},
}


def run(name: str, recipe: Recipe) -> Any:
    """The job's manifest metrics, or its failure reason."""
    job = llmopt.optimize(MODEL, recipe, name=f"awqq-{name}-{int(time.time())}", force=True)
    if job.artifact is None:
        return job.record.failure_reason or job.status
    return artifact.load(job.artifact).metrics


def main(selected: list[str]) -> None:
    base = run("base", Recipe()).perplexity.perplexity
    rows = []
    for i, (label, knobs) in enumerate(VARIANTS.items()):
        if selected and str(i) not in selected:
            continue
        metrics = run(f"v{i}", Recipe(quantization=AWQ(max_perplexity_increase=NO_BUDGET, **knobs)))
        if isinstance(metrics, str):
            rows.append({"variant": label, "failed": metrics})
            print(f"{label:45s} FAILED: {metrics[:150]}", flush=True)
            continue
        q = metrics.quantization
        ppl = metrics.perplexity.perplexity
        rows.append({"variant": label, "perplexity": round(ppl, 3), "increase": round(ppl / base - 1, 4),
                     "group_size": q.group_size, "calibration": q.calibration.model_dump() if q.calibration else None,
                     "weights_mb": round(q.size_bytes / 1e6, 1), "quantize_seconds": q.seconds})
        print(f"{label:45s} ppl {ppl:7.3f}  {100 * (ppl / base - 1):+6.2f}%  {q.size_bytes / 1e6:6.1f} MB  {q.seconds:6.1f} s", flush=True)
    path = Path(__file__).parent / "results" / "awq_quality.json"
    earlier = json.loads(path.read_text())["variants"] if path.exists() else []
    rows += [r for r in earlier if r["variant"] not in {row["variant"] for row in rows}]  # runs of other variants
    out = {"model": MODEL, "baseline_perplexity": round(base, 3), "variants": rows}
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"bf16 baseline perplexity {base:.3f}; wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
