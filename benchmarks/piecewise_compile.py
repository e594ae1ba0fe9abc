"""vLLM's piecewise compilation on a CPU against the whole-graph trace it uses there: cold start and
decode speed, side by side.

vLLM's CPU platform turns `VLLM_COMPILE` (piecewise: the graph split at the attention ops, each
piece compiled by Inductor, identical layers' pieces served from Inductor's cache) into
`DYNAMO_TRACE_ONCE` (the whole 30-layer graph traced and compiled at once), and a cold compile of
SmolLM2 takes 80-140 s on two cores. This script starts vLLM's offline engine in a process per
mode, each with empty caches, plain vLLM (none of llmopt's kernels or settings), and times the
engine's construction, then decodes 128 tokens at batch 1 and 8 in alternating rounds. Piecewise
needs three changes on a CPU, made only in its own process: the mode set back after the platform's
choice, `compile_sizes` set (the piecewise backend looks a shape up in them), and vLLM's
fix-functionalization pass skipped (it names CUDA-only fused ops; Inductor's own decomposition
takes its place).

    .venv/bin/python benchmarks/piecewise_compile.py --model FOLDER [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from results_file import add_out

MODES = ("whole graph (vLLM's CPU default)", "piecewise")


def run_mode(mode: str, model: str, rounds: int) -> None:
    """In a process of its own: build the engine in `mode`, decode, print one JSON line."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, where the patches are
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if mode == "piecewise":
        from llmopt.engine import piecewise

        piecewise.use()
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model, max_model_len=2048, max_num_seqs=8, dtype="float32")
    ready_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    speeds: dict[int, list[float]] = {1: [], 8: []}
    for _ in range(rounds):
        for batch in speeds:
            started = time.perf_counter()
            out = llm.generate(["The keeper of the lighthouse"] * batch, params, use_tqdm=False)
            speeds[batch].append(round(batch * 128 / (time.perf_counter() - started), 1))
    print(json.dumps({"ready_s": round(ready_s, 1), "tokens_per_s": speeds, "text": out[0].outputs[0].text}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder (an imported model's, say)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    add_out(parser, "piecewise_compile.json")
    args = parser.parse_args()
    if args.mode:
        return run_mode(args.mode, args.model, args.rounds)
    from llmopt.engine import platform

    rows = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory(prefix="piecewise-") as caches:
            env = {**os.environ, "VLLM_CACHE_ROOT": f"{caches}/vllm", "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor"}
            done = subprocess.run([sys.executable, __file__, "--model", args.model, "--rounds", str(args.rounds), "--mode", mode],
                                  env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{mode} failed: {done.stderr.strip()[-600:]}")
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    texts = {row["text"] for row in rows.values()}
    hardware = platform.detect()
    out = {"model": args.model, "rounds": args.rounds, "processor": hardware.cpu_label, "cores": hardware.cores,
           "same_text": len(texts) == 1, "modes": rows}
    args.out.write_text(json.dumps(out, indent=2))
    print(f"{args.model}, plain vLLM in float32, {args.rounds} rounds on {hardware.cpu_label}; same text: {len(texts) == 1}")
    print("mode | cold start to ready | batch 1 tokens/s (by round) | median | batch 8 (by round) | median")
    for mode, row in rows.items():
        one, eight = row["tokens_per_s"]["1"], row["tokens_per_s"]["8"]
        print(f"{mode} | {row['ready_s']} s | {', '.join(map(str, one))} | {statistics.median(one)} | "
              f"{', '.join(map(str, eight))} | {statistics.median(eight)}")


if __name__ == "__main__":
    main()
