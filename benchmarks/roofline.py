"""How close each artifact kind decodes to what this machine allows: a roofline table.

For each artifact of SmolLM2-135M (bf16, SmoothQuant W8A8, AWQ W4A16, block FP8 where the matrix
allows it), built by a real job with the built-in recipe (or reused by key):
- bytes streamed per generated token: every weight a decode step reads, from the safetensors
  headers (the `lm_head` in full, the tied embedding matrix read as the `lm_head`, one embedding
  row), plus the KV cache read at the context's length;
- the memory bound: this machine's read bandwidth, measured here first (no engine running; over
  1 GiB, `llmopt.roofline.measure_rates`), over those bytes. The bandwidth is the best of a
  20-second window, in which this VM kind moves between two levels; the fraction is also given
  against the window's median (`typical`);
- at batch 16, the compute bound too, from this machine's measured bf16 (and int8) matmul rate;
- with speculation, the bound of a step's bytes over the tokens it kept (the tokens decoded over
  the decode steps, counted from vLLM's counters on the same requests: every step, also those that
  drafted nothing), the verifying pass computing every proposed token;
- what the deployed artifact achieves, from the time per output token (p50) of fixed-length
  requests (end-of-sequence ignored) at batch 1 with a short prompt and with ~1,000 tokens of
  prompt, and at batch 16; and the fraction of the bound.
With --rounds N every artifact is deployed and measured N times, the artifacts in turn within a
round and the machine's rates measured again before each round, and the table gives the medians:
this VM's speed drifts 10-20% an hour, so a row measured once, minutes from another, is no
comparison. Writes benchmarks/results/roofline.json (or --out), every row or those named.

    .venv/bin/python benchmarks/roofline.py [KIND ...] [--rounds N] [--out NAME.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path

import llmopt
import results_file
from llmopt import artifact
from llmopt.engine import platform
from llmopt.errors import LlmoptError
from llmopt.evaluation import benchmark
from llmopt.roofline import Rates, Speculation, bound_tokens_per_s, measure_rates, served_traffic

MODEL = "smollm2-135m-instruct"
KINDS = {"bf16": "baseline", "SmoothQuant W8A8": "smoothquant",
         # the lm_head too (INT8 per channel, untied from the embeddings): 28M of the model's 135M parameters
         "SmoothQuant + lm_head": {"quantization": {"method": "smoothquant", "ignore": []}},
         "AWQ W4A16": "awq", "block FP8": "fp8-block",
         # with speculation: n-gram prompt lookup (SmolLM2's recommended drafting), whose bound is a
         # step's bytes over the tokens it keeps, measured on the same requests
         "bf16 + n-gram": "ngram", "SmoothQuant + n-gram": {"quantization": {"method": "smoothquant"}, "speculative": {"method": "ngram"}}}
OUTPUT_TOKENS = 128
CASES = {  # name: (prompt tokens, concurrency, requests)
    "b1 short": (16, 1, 6),
    "b1 ctx1000": (1000, 1, 6),
    "b16 short": (16, 16, 32),
}


def achieved(folder: Path) -> dict[str, tuple[float, Speculation | None]]:
    """Decode tokens/s per case, from the median time per output token of fixed-length requests, and
    what speculation proposed and kept per step there (None where it did not speculate)."""
    speeds = {}
    with llmopt.deploy(str(folder)) as endpoint:
        for case, (prompt, concurrency, requests) in CASES.items():
            results = llmopt.evaluate(endpoint=endpoint.name, dataset=f"synthetic:{prompt},{OUTPUT_TOKENS}",
                                      concurrency=[concurrency], requests=requests, min_duration_s=0, quality=False)
            level = results.targets[0].levels[0]
            speculating = benchmark.speculation(level)
            speeds[case] = (level.decode_tokens_per_s or 0.0, speculating)
            kept = f", {speculating.accepted_length:.2f} tokens a step" if speculating else ""
            print(f"  {case}: {speeds[case][0]:.1f} tokens/s (TPOT p50 {level.tpot_ms.p50 if level.tpot_ms else 0:.2f} ms{kept})",
                  flush=True)
    return speeds


def _median_rates(measured: list[Rates]) -> Rates:
    def median(values: list[float | None]) -> float | None:
        found = [v for v in values if v is not None]
        return round(statistics.median(found), 1) if found else None

    return Rates(**{name: median([getattr(r, name) for r in measured]) for name in asdict(measured[0])})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", help=f"the rows to run (default: every one): {', '.join(KINDS)}")
    parser.add_argument("--rounds", type=int, default=1, help="deploy and measure every artifact this many times, in turn")
    results_file.add_out(parser, "roofline.json")
    args = parser.parse_args()
    if unknown := [kind for kind in args.kinds if kind not in KINDS]:
        parser.error(f"no row named {', '.join(unknown)}")
    hardware = platform.detect()
    rows, built = [], {}
    for kind in args.kinds or KINDS:
        try:
            job = llmopt.optimize(MODEL, KINDS[kind])
        except LlmoptError as exc:
            rows.append({"kind": kind, "refused": exc.one_line()})
            print(f"{kind}: refused here: {exc.one_line()}", flush=True)
            continue
        if job.artifact is None:
            raise SystemExit(f"{kind}: job {job.name} ended {job.status}: {job.record.failure_reason}")
        built[kind] = Path(job.artifact)
    # read from the headers once, in the dtype each is served in here (float32 on x86 without AVX-512,
    # bf16 matrices held as stored under llmopt's AVX2 kernel)
    manifests = {kind: artifact.load(folder) for kind, folder in built.items()}
    streamed = {kind: served_traffic(folder, manifests[kind].engine.settings, hardware) for kind, folder in built.items()}
    measured: list[Rates] = []
    speeds: dict[str, list[dict[str, tuple[float, Speculation | None]]]] = {kind: [] for kind in built}
    for round_ in range(1, args.rounds + 1):
        measured.append(measure_rates(hardware.cores))
        rates = measured[-1]
        print(f"round {round_}: {hardware.cpu_label}, {hardware.cores} cores: read {rates.read_gb_s} GB/s (typical "
              f"{rates.read_median_gb_s}), copy "
              f"{rates.copy_gb_s} GB/s, bf16 matmul {rates.bf16_gflop_s} GFLOP/s, int8 {rates.int8_gflop_s} GFLOP/s", flush=True)
        for kind, folder in built.items():
            print(f"{kind}: {streamed[kind].weights_bytes / 1e6:.1f} MB per token", flush=True)
            speeds[kind].append(achieved(folder))
    rates = _median_rates(measured)
    typical = replace(rates, read_gb_s=rates.read_median_gb_s or rates.read_gb_s)
    for kind, folder in built.items():
        found = streamed[kind]
        metrics = manifests[kind].metrics
        row = {"kind": kind, "artifact": folder.name, "mb_per_token": round(found.weights_bytes / 1e6, 1),
               "perplexity": round(metrics.perplexity.perplexity, 3), "perplexity_increase": metrics.perplexity_increase, "cases": {}}
        for case, (prompt, concurrency, _) in CASES.items():
            runs = [measured_round[case] for measured_round in speeds[kind]]
            speed = statistics.median(s for s, _ in runs)
            speculation = min(runs, key=lambda run: abs(run[0] - speed))[1]  # the median round's, or the nearest
            bound, limit = bound_tokens_per_s(found, rates, concurrency, prompt + OUTPUT_TOKENS // 2, speculation)
            typical_bound, _ = bound_tokens_per_s(found, typical, concurrency, prompt + OUTPUT_TOKENS // 2, speculation)
            row["cases"][case] = {"achieved_tok_s": round(speed, 1), "rounds_tok_s": [round(s, 1) for s, _ in runs],
                                  "bound_tok_s": round(bound, 1), "limited_by": limit, "fraction": round(speed / bound, 3),
                                  "typical_bound_tok_s": round(typical_bound, 1), "typical_fraction": round(speed / typical_bound, 3),
                                  "accepted_length": round(speculation.accepted_length, 2) if speculation else None,
                                  "proposed": round(speculation.proposed, 2) if speculation else None}
        rows.append(row)
    args.out.write_text(json.dumps({"model": MODEL, "processor": hardware.cpu_label, "cores": hardware.cores,
                                    "cpu_flags_amx": hardware.has_amx, "rounds": args.rounds,
                                    "machine": asdict(rates), "machine_rounds": [asdict(r) for r in measured],
                                    "output_tokens": OUTPUT_TOKENS, "rows": rows}, indent=2) + "\n")
    print(f"\n{'kind':<22} {'MB/token':>8} {'ppl +':>6} " + " ".join(f"{c + ' tok/s (bound, %, typical %)':>40}" for c in CASES))
    for row in rows:
        if "refused" in row:
            print(f"{row['kind']:<22} refused here")
            continue
        cells = [f"{c['achieved_tok_s']:>8.1f} ({c['bound_tok_s']:>7.1f} {c['limited_by'][:3]}, {c['fraction']:>5.1%}, {c['typical_fraction']:>5.1%})"
                 + (f" x{c['accepted_length']}" if c["accepted_length"] else "") for c in row["cases"].values()]
        increase = f"{row['perplexity_increase']:.1%}" if row["perplexity_increase"] is not None else "-"
        print(f"{row['kind']:<22} {row['mb_per_token']:>8} {increase:>6} " + " ".join(f"{c:>40}" for c in cells))
    print(f"wrote {args.out} (medians of {args.rounds} round{'s' if args.rounds > 1 else ''})")


if __name__ == "__main__":
    main()
