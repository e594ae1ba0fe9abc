"""Speculative decoding against no speculation, side by side, per concurrency level.

- SmolLM2-135M with n-gram prompt lookup (its recommended method: it has no smaller sibling);
- Qwen2.5-Coder-1.5B with the 0.5B as draft (needs `scripts/install.sh --with-qwen`).
Each pair is deployed in turn with the engine settings llmopt writes into artifacts, and loaded
with the built-in QA workload (answers copy from the documents). Reports the output-throughput
ratio, the acceptance rate, and the first concurrency level where the gain falls below 1.0x.
Writes benchmarks/results/speculative.json.   Usage: python benchmarks/speculative.py [smol] [qwen]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llmopt
from llmopt import sources
from llmopt.engine.config import EngineConfig
from llmopt.recipe import DraftModel, NGram
from llmopt.techniques import speculative

LEVELS = [1, 2, 4, 8]
REQUESTS = 8
CASES = {
    "smol": ("smollm2-135m-instruct", [("ngram k=4", NGram(num_speculative_tokens=4)), ("ngram k=2", NGram(num_speculative_tokens=2))]),
    "qwen": ("qwen2.5-coder-1.5b-instruct", [("draft 0.5B k=3", DraftModel("qwen2.5-coder-0.5b-instruct", num_speculative_tokens=3)),
                                             ("draft 0.5B k=4", DraftModel("qwen2.5-coder-0.5b-instruct", num_speculative_tokens=4))]),
}


def measure(model: str, engine: EngineConfig) -> list[dict]:
    with llmopt.deploy(model, engine=engine) as endpoint:
        result = llmopt.evaluate(endpoint=endpoint.name, dataset="builtin-qa", concurrency=LEVELS, requests=REQUESTS, quality=False)
    return result["targets"][0]["levels"]


def run_case(model: str, variants: list) -> dict:
    target = sources.resolve(model)
    base_engine = EngineConfig(max_model_len=4096, kv_cache_gib=4)
    base = measure(model, base_engine)
    out = {"model": model, "baseline": [_summary(lvl) for lvl in base], "variants": []}
    for label, spec in variants:
        draft = speculative.resolve_draft(spec, target).path if isinstance(spec, DraftModel) else None
        levels = measure(model, base_engine.model_copy(update={"speculative_config": speculative.engine_config(spec, draft)}))
        rows = []
        for b, s in zip(base, levels):
            rows.append({**_summary(s), "speedup": round(s["output_tokens_per_s"] / b["output_tokens_per_s"], 3)})
        crossover = next((r["concurrency"] for r in rows if r["speedup"] < 1.0), None)
        out["variants"].append({"label": label, "levels": rows, "first_level_below_1x": crossover})
    return out


def _summary(level: dict) -> dict:
    spec = level.get("speculative") or {}
    return {"concurrency": level["concurrency"], "output_tokens_per_s": round(level["output_tokens_per_s"], 2),
            "acceptance_rate": round(spec.get("acceptance_rate", 0.0), 3),
            "mean_accepted_length": round(spec.get("mean_accepted_length", 0.0), 2)}


def main() -> None:
    chosen = sys.argv[1:] or list(CASES)
    results_file = Path(__file__).parent / "results" / "speculative.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    for name in chosen:
        model, variants = CASES[name]
        results[name] = run_case(model, variants)
        results_file.write_text(json.dumps(results, indent=2))
    for name in chosen:
        case = results[name]
        print(f"\n{case['model']}: output tokens/s, baseline " + ", ".join(f"c{b['concurrency']}={b['output_tokens_per_s']}" for b in case["baseline"]))
        print(f"{'variant':<18} {'conc':>4} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'mean len':>8}")
        for variant in case["variants"]:
            for row in variant["levels"]:
                print(f"{variant['label']:<18} {row['concurrency']:>4} {row['output_tokens_per_s']:>8} {row['speedup']:>7}x "
                      f"{row['acceptance_rate']:>7} {row['mean_accepted_length']:>8}")
            print(f"{variant['label']:<18} gain falls below 1.0x at concurrency: {variant['first_level_below_1x'] or 'not within ' + str(LEVELS)}")


if __name__ == "__main__":
    main()
