"""llmopt's prefill attention kernel served, against vLLM's CPU attention, on the built-in QA
workload: each target deployed with one kernel and then the other (in ABBA order with `--repeat
2`, so that a drift between deployments falls on both alike), load-tested at concurrency 1 and 8
with its quality measured, and the figures recommend ranks by side by side: TTFT, TPOT, output
tokens/s per user at c=1 and in total at c=8, perplexity, and how many greedy answers the two
kernels give token for token alike.

    .venv/bin/python -u benchmarks/prefill_attention.py [--target T ...] [--repeat N] [--out NAME]

Targets are catalogued models or artifact folders (default: SmolLM2-135M in bf16). Writes
benchmarks/results/prefill_attention.json, or `--out`. On AVX2 processors the kernels are float32
(llmopt serves float32 there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import llmopt
import results_file
from llmopt import serving
from llmopt.engine import platform
from llmopt.evaluation.results import EvaluationResults

KERNELS = ("vllm", "llmopt")
LEVELS = (1, 8)
REQUESTS = 32


def measure(target: str, kernel: str) -> dict:
    spec = serving.for_target(target)
    spec = dataclasses.replace(spec, engine=spec.engine.model_copy(update={"attention_kernel": kernel}))
    with serving.deploy(spec, temporary=True) as endpoint:
        results: EvaluationResults = llmopt.evaluate(endpoint=endpoint.name, concurrency=list(LEVELS), requests=REQUESTS)
    (measured,) = results.targets
    by_level = {level.concurrency: level for level in measured.levels}
    one, eight = by_level[1], by_level[8]
    quality = measured.quality
    row = {"target": target, "attention_kernel": kernel, "seconds_to_ready": measured.seconds_to_ready,
           "ttft_p50_ms_c1": one.ttft_ms.p50, "tpot_p50_ms_c1": one.tpot_ms.p50,
           "tokens_per_s_per_user_c1": one.per_request.output_tokens_per_s.mean,
           "ttft_p50_ms_c8": eight.ttft_ms.p50, "total_tokens_per_s_c8": eight.output_tokens_per_s,
           "perplexity": quality.perplexity.perplexity if quality and quality.perplexity else None,
           "greedy_tokens": quality.greedy_tokens if quality else None}
    print(f"  {kernel:<7} TTFT p50 {row['ttft_p50_ms_c1']:7.1f} ms, TPOT p50 {row['tpot_p50_ms_c1']:5.2f} ms, "
          f"{row['tokens_per_s_per_user_c1']:6.1f} tok/s per user at c=1; TTFT p50 {row['ttft_p50_ms_c8']:7.1f} ms, "
          f"{row['total_tokens_per_s_c8']:6.1f} tok/s in total at c=8; perplexity {row['perplexity']}", flush=True)
    return row


def summary(rows: list[dict]) -> dict:
    """Medians per kernel, llmopt's over vLLM's, and the greedy answers the two give alike."""
    medians = {kernel: {key: statistics.median(r[key] for r in rows if r["attention_kernel"] == kernel)
                        for key in ("ttft_p50_ms_c1", "tpot_p50_ms_c1", "tokens_per_s_per_user_c1", "ttft_p50_ms_c8",
                                    "total_tokens_per_s_c8")} for kernel in KERNELS}
    first = {kernel: next(r for r in rows if r["attention_kernel"] == kernel) for kernel in KERNELS}
    theirs, ours = first["vllm"]["greedy_tokens"] or [], first["llmopt"]["greedy_tokens"] or []
    return {"medians": medians,
            "llmopt_over_vllm": {key: round(medians["llmopt"][key] / medians["vllm"][key], 3) for key in medians["vllm"]},
            "greedy_answers_alike": f"{sum(a == b for a, b in zip(theirs, ours))} of {min(len(theirs), len(ours))}",
            "perplexity": {kernel: first[kernel]["perplexity"] for kernel in KERNELS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", help="a catalogued model or an artifact folder (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="deployments of each kernel per target, in ABBA order")
    results_file.add_out(parser, "prefill_attention.json")
    args = parser.parse_args()
    hw = platform.detect()
    if not platform.prefill_attention_applies(hw):
        raise SystemExit(f"{hw.cpu_model}: llmopt's prefill attention is for AVX-512 BF16 without AMX, or AVX2 without AVX-512 and VNNI")
    found = {}
    for target in args.target or ["smollm2-135m-instruct"]:
        print(f"{target}:", flush=True)
        order = [KERNELS[(i // 2 + i) % 2] for i in range(2 * args.repeat)]  # vllm, llmopt, llmopt, vllm, ...
        rows = [measure(target, kernel) for kernel in order]
        found[target] = {"summary": summary(rows), "rows": [{k: v for k, v in r.items() if k != "greedy_tokens"} for r in rows]}
        print(f"  llmopt / vllm: {found[target]['summary']['llmopt_over_vllm']}; greedy answers alike: "
              f"{found[target]['summary']['greedy_answers_alike']}", flush=True)
    args.out.write_text(json.dumps({"processor": hw.cpu_label, "cores": hw.cores, "requests": REQUESTS, "levels": LEVELS,
                                    "targets": found}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
