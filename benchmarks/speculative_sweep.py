"""A job's speculation sweep against a direct comparison of the same two configurations.

Runs `llmopt optimize -m qwen2.5-coder-1.5b-instruct --speculative draft` (the catalogue's
recommended draft, the 0.5B quantized to INT8; the sweep on the catalogue's workload for the model,
coding prompts) on the processor at hand, then measures the same thing outside the job: the source
model deployed as `llmopt deploy` serves it (with the artifact's engine settings, speculation
left out) and the artifact deployed as it was built, each loaded with the sweep's own plan (the
same prompts, the same output lengths, the same requests per level). Per level it prints the
sweep's output tokens/s ratio beside the direct one, each with its interval, and whether the two
intervals overlap: the sweep decides where speculation is switched off, so it must measure what a
deployment then delivers. Needs `scripts/install.sh --with-qwen`. About 40 minutes on 2 cores.

    .venv/bin/python benchmarks/speculative_sweep.py [MODEL]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import llmopt
from llmopt import DraftModel, Recipe, artifact, sources
from llmopt.engine import platform
from llmopt.evaluation import levels
from llmopt.evaluation.results import Level
from llmopt.jobs import store
from llmopt.techniques import speculative

MODEL = "qwen2.5-coder-1.5b-instruct"
RESULTS = Path(__file__).parent / "results" / "speculative_sweep.json"


def _measure(target: str, tokenizer: str, plan: levels.Plan, lengths: dict[int, int] | None,
             **deploy: object) -> tuple[list[Level], dict[int, int] | None]:
    """The plan's levels on one deployment; where the sweep ran at natural lengths and none are
    given yet, this deployment measures them first (as the sweep's engine without speculation did)."""
    with llmopt.deploy(target, **deploy) as endpoint:  # type: ignore[arg-type]
        if lengths is None and plan.output_tokens is None:
            lengths = levels.natural_lengths(endpoint.url, endpoint.served_name, tokenizer, plan)
        return levels.measure(endpoint.url, endpoint.served_name, tokenizer, plan, lengths=lengths), lengths


def _row(row: speculative.SweepRow) -> dict:
    return {"concurrency": row.concurrency, "speedup": row.speedup.value, "low": row.speedup.low, "high": row.speedup.high,
            "output_tokens_per_s": row.output_tokens_per_s, "output_tokens_per_s_without": row.output_tokens_per_s_without,
            "decode_speedup": row.decode_speedup, "ttft_cost_ms": row.ttft_cost_ms, "acceptance_rate": row.acceptance_rate}


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else MODEL
    started = time.monotonic()
    job = llmopt.optimize(model, Recipe(speculative=DraftModel()), force=True)
    if job.status != store.COMPLETED:
        raise SystemExit(f"the job {job.name} ended {job.status}: {job.record.failure_reason}")
    job_s = time.monotonic() - started
    manifest = artifact.load(job.artifact)
    sweep = manifest.metrics.speculative.sweep
    plan = levels.Plan(dataset=sweep.dataset, concurrency=tuple(r.concurrency for r in sweep.levels),
                       requests=sweep.requests_per_level, min_duration_s=0, output_tokens=sweep.output_tokens,
                       equal_levels=False)  # as the job's sweep: each level its own prompts
    source = sources.resolve(model)
    engine = manifest.located_engine(Path(job.artifact)).model_copy(update={"speculative": None})
    without, lengths = _measure(source.id, source.path, plan, None, engine=engine)
    with_, _ = _measure(str(job.artifact), str(job.artifact), plan, lengths)
    direct = [speculative.sweep_row(b, s) for b, s in zip(without, with_)]
    limit = sweep.disable_above_batch
    rows = []
    for in_job, outside in zip(sweep.levels, direct):
        speculating = limit is None or in_job.concurrency <= limit  # above it the artifact serves without drafts
        rows.append({"concurrency": in_job.concurrency, "sweep": _row(in_job), "direct": _row(outside),
                     "artifact_speculates": speculating,
                     "agree": in_job.speedup.low <= outside.speedup.high and outside.speedup.low <= in_job.speedup.high})
    hardware = platform.detect()
    out = {"model": model, "processor": hardware.cpu_label, "cores": hardware.cores, "job_seconds": round(job_s),
           "dataset": Path(sweep.dataset).name, "output_tokens": sweep.output_tokens, "requests_per_level": sweep.requests_per_level,
           "disable_above_batch": limit, "levels": rows}
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{model} --speculative draft on {hardware.cpu_label} ({hardware.cores} cores); job {job_s / 60:.1f} min; "
          f"{out['dataset']}, {sweep.output_tokens or 'natural'} tokens per request; switched off above: {limit or 'nothing'}")
    print("conc | sweep: speed-up [interval] decode TTFT accept | direct: speed-up [interval] decode TTFT accept | agree")
    for row in rows:
        cells = [f"{r['speedup']:.2f}x [{r['low']:.2f}-{r['high']:.2f}] {r['decode_speedup']}x {r['ttft_cost_ms']:+.0f} ms "
                 f"{r['acceptance_rate']:.2f}" for r in (row["sweep"], row["direct"])]
        print(f"{row['concurrency']:>4} | {cells[0]} | {cells[1]} | {'yes' if row['agree'] else 'NO'}"
              + ("" if row["artifact_speculates"] else " (the artifact does not speculate here)"))


if __name__ == "__main__":
    main()
