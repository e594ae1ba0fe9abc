"""Speculative decoding against no speculation, side by side, per concurrency level.

- SmolLM2-135M with n-gram prompt lookup (its recommended method: it has no smaller sibling), on
  the built-in QA workload (answers copy from the documents);
- Qwen2.5-Coder-1.5B with the 0.5B as draft (needs `scripts/install.sh --with-qwen`), on coding
  prompts (benchmarks/data/coding.jsonl, 128 new tokens), the workload the hand measurement used:
  the draft in bf16, and quantized as the catalogue recommends (INT8 SmoothQuant, quantized here
  by the same function a job's speculative step uses).
Each pair is deployed in turn with the engine settings llmopt writes into artifacts. Reports the
output-throughput ratio, TTFT and time per output token (prefill is not sped up, decode is), the
acceptance rate, and the first concurrency level where the gain falls below 1.0x.
Writes benchmarks/results/speculative.json.   Usage: python benchmarks/speculative.py [smol] [qwen]
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

import llmopt
from llmopt import DraftModel, EngineConfig, NGram, sources
from llmopt.evaluation.results import Level
from llmopt.techniques import quantization, speculative

LEVELS = [1, 2, 4, 8]
REQUESTS = 8
CODING = str(Path(__file__).parent / "data" / "coding.jsonl")
QWEN_DRAFT = "qwen2.5-coder-0.5b-instruct"
CASES = {  # model, workload, variants, rounds
    "smol": ("smollm2-135m-instruct", "builtin-qa",
             [(f"ngram k={k}", NGram(num_speculative_tokens=k)) for k in (2, 3, 4)], 2),
    "qwen": ("qwen2.5-coder-1.5b-instruct", CODING,
             [(f"draft 0.5B k={k}", DraftModel(QWEN_DRAFT, num_speculative_tokens=k)) for k in (2, 3)]
             + [(f"draft 0.5B int8 k={k}", DraftModel(num_speculative_tokens=k)) for k in (2, 3, 4)], 1),
}


def measure(model: str, dataset: str, engine: EngineConfig) -> list[Level]:
    with llmopt.deploy(model, engine=engine) as endpoint:
        result = llmopt.evaluate(endpoint=endpoint.name, dataset=dataset, concurrency=LEVELS, requests=REQUESTS, quality=False)
    return result.targets[0].levels


def draft_folder(draft: speculative.Draft, workdir: Path) -> str:
    """The draft as it drafts: its own folder, or quantized once per run into `workdir`."""
    if draft.quantization is None:
        return draft.model.path
    dest = workdir / f"{draft.model.id}-{draft.quantization.method}"
    if not dest.exists():
        dest.mkdir()
        quantization.quantize_model(draft.quantization, draft.model, dest, 1, logging.getLogger("draft"), lambda _: None)
    return str(dest)


def run_case(model: str, dataset: str, variants: list, rounds: int, workdir: Path) -> dict:
    """Every configuration once per round, in turn, so a slow spell of this noisy machine hits all of
    them; each level's figures are the medians over rounds."""
    target = sources.resolve(model)
    base_engine = EngineConfig(max_model_len=4096, kv_cache_gib=4)
    engines = {"none": base_engine}
    for label, spec in variants:
        engine = speculative.TECHNIQUE.configure(spec, base_engine)
        if isinstance(spec, DraftModel):  # the draft's own folder, not the artifact's ./draft
            draft = draft_folder(speculative.resolve_draft(spec, target), workdir)
            engine = engine.model_copy(update={"speculative": engine.speculative.model_copy(update={"model": draft})})
        engines[label] = engine
    runs: dict[str, list[list[dict]]] = {label: [] for label in engines}
    for _ in range(rounds):
        for label, engine in engines.items():
            runs[label].append([_summary(lvl) for lvl in measure(model, dataset, engine)])
    medians = {label: [_median(per_level) for per_level in zip(*measured)] for label, measured in runs.items()}
    out = {"model": model, "dataset": Path(dataset).name, "rounds": rounds, "baseline": medians["none"], "variants": []}
    for label, _ in variants:
        rows = [{**s, "speedup": round(s["output_tokens_per_s"] / b["output_tokens_per_s"], 3)}
                for b, s in zip(medians["none"], medians[label])]
        crossover = next((r["concurrency"] for r in rows if r["speedup"] < 1.0), None)
        out["variants"].append({"label": label, "levels": rows, "first_level_below_1x": crossover,
                                "output_tokens_per_s_by_round": [[lvl["output_tokens_per_s"] for lvl in r] for r in runs[label]]})
    out["baseline_output_tokens_per_s_by_round"] = [[lvl["output_tokens_per_s"] for lvl in r] for r in runs["none"]]
    return out


def _median(rounds: tuple[dict, ...]) -> dict:
    return {key: rounds[0][key] if key == "concurrency" else round(statistics.median(r[key] for r in rounds), 3)
            for key in rounds[0]}


def _summary(level: Level) -> dict:
    spec = level.speculative
    return {"concurrency": level.concurrency, "output_tokens_per_s": round(level.output_tokens_per_s, 2),
            # where the time goes: prefill (TTFT) is not sped up, decode (TPOT) is
            "ttft_ms": round(level.ttft_ms.mean, 1), "tpot_ms": round(level.tpot_ms.mean, 2),
            "output_tokens": round(level.per_request.output_tokens.mean, 1),
            "acceptance_rate": round(spec.acceptance_rate if spec else 0.0, 3),
            "mean_accepted_length": round(spec.mean_accepted_length if spec else 0.0, 2)}


def main() -> None:
    chosen = sys.argv[1:] or list(CASES)
    results_file = Path(__file__).parent / "results" / "speculative.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    for name in chosen:
        with tempfile.TemporaryDirectory(prefix="llmopt-drafts-") as workdir:
            results[name] = run_case(*CASES[name], Path(workdir))
        results_file.write_text(json.dumps(results, indent=2))
    for name in chosen:
        case = results[name]
        print(f"\n{case['model']} on {case['dataset']}: output tokens/s, baseline " + ", ".join(f"c{b['concurrency']}={b['output_tokens_per_s']}" for b in case["baseline"]))
        print(f"{'variant':<22} {'conc':>4} {'tok/s':>8} {'speedup':>8} {'TTFT ms':>8} {'TPOT ms':>8} {'accept':>7} {'mean len':>8}")
        for variant in [{"label": "none", "levels": case["baseline"]}, *case["variants"]]:
            for row in variant["levels"]:
                print(f"{variant['label']:<22} {row['concurrency']:>4} {row['output_tokens_per_s']:>8} {row.get('speedup', 1.0):>7}x "
                      f"{row['ttft_ms']:>8} {row['tpot_ms']:>8} {row['acceptance_rate']:>7} {row['mean_accepted_length']:>8}")
            if variant["label"] != "none":
                print(f"{variant['label']:<22} gain falls below 1.0x at concurrency: {variant['first_level_below_1x'] or 'not within ' + str(LEVELS)}")


if __name__ == "__main__":
    main()
