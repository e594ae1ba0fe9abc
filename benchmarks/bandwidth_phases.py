"""Does a decode step follow the VM's bandwidth level? Its read bandwidth moves between two levels
every few seconds (on a 2-core Zen 4 EPYC VM: about 31 GB/s most seconds, 48-62 in stretches), so a
roofline fraction depends on which level divides it. This pairs the two in one process, in turn:
the read bandwidth of a 1 GiB tensor (best of three reads, on the engine's two threads), then
decode steps of SmolLM2-135M at batch 1 in vLLM's offline API (llmopt's engine environment, as
`step_profile.py` sets it), then the bandwidth again. Pairs whose two readings agree on the level
are grouped by it, and each group gives its step time and the fraction of the memory bound at its
own bandwidth (the weights a step reads, from the safetensors headers, over that bandwidth).
Writes benchmarks/results/bandwidth_phases[_NAME].json.

    .venv/bin/python benchmarks/bandwidth_phases.py [--model M] [--pairs N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from llmopt import roofline, sources
from llmopt.engine import platform
from step_profile import compilation_config, in_engine_environment

MODEL = "smollm2-135m-instruct"
STEPS = 32  # decode steps a pair: about a third of a second, inside one bandwidth level
RESULTS = Path(__file__).parent / "results" / "bandwidth_phases.json"


def main(model: str, pairs: int, out: Path) -> None:
    import torch
    from vllm import LLM, SamplingParams

    from llmopt.engine import serve

    serve.kernels_from_environment()
    folder = Path(model) if Path(model).is_dir() else Path(sources.resolve(model).path)
    weights = roofline.traffic(folder).weights_bytes
    llm = LLM(str(folder), max_model_len=2048, seed=0, enable_prefix_caching=False, compilation_config=compilation_config())
    prompt = "Write a story about a cat. " * 2

    def generate_s(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0)
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - started

    x = torch.ones(2**28, dtype=torch.float32)

    def read_gb_s() -> float:
        x.sum()
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - started)
        return x.numel() * 4 / best / 1e9

    generate_s(STEPS + 1)
    found = []
    for _ in range(pairs):
        before = read_gb_s()
        # a step's time without the prompt's prefill and first token: the difference of two runs
        step_ms = (generate_s(STEPS + 1) - generate_s(1)) / STEPS * 1e3
        found.append({"before_gb_s": round(before, 1), "step_ms": round(step_ms, 3), "after_gb_s": round(read_gb_s(), 1)})
    readings = sorted(r for pair in found for r in (pair["before_gb_s"], pair["after_gb_s"]))
    split = (readings[len(readings) // 10] + readings[-1 - len(readings) // 10]) / 2  # between the two levels
    levels = {}
    for name, test in (("slow", lambda r: r < split), ("fast", lambda r: r >= split)):
        kept = [p for p in found if test(p["before_gb_s"]) and test(p["after_gb_s"])]
        if not kept:
            continue
        gb_s = statistics.median(r for p in kept for r in (p["before_gb_s"], p["after_gb_s"]))
        step_ms = statistics.median(p["step_ms"] for p in kept)
        bound_ms = weights / (gb_s * 1e9) * 1e3
        levels[name] = {"pairs": len(kept), "read_gb_s": round(gb_s, 1), "step_ms": round(step_ms, 3),
                        "tokens_per_s": round(1e3 / step_ms, 1), "bound_step_ms": round(bound_ms, 3),
                        "fraction": round(bound_ms / step_ms, 3)}
    mixed = pairs - sum(level["pairs"] for level in levels.values())
    hw = platform.detect()
    print(f"{model} on {hw.cpu_label}, {hw.cores} cores: {weights / 1e6:.1f} MB a step; {pairs} pairs of {STEPS} "
          f"batch-1 steps, split at {split:.1f} GB/s ({mixed} pairs changed level and are left out)")
    print(f"{'level':<6} {'pairs':>5} {'GB/s':>6} {'step ms':>8} {'tok/s':>7} {'bound ms':>9} {'of bound':>9}")
    for name, level in levels.items():
        print(f"{name:<6} {level['pairs']:>5} {level['read_gb_s']:>6.1f} {level['step_ms']:>8.2f} {level['tokens_per_s']:>7.1f} "
              f"{level['bound_step_ms']:>9.2f} {level['fraction']:>9.1%}")
    out.write_text(json.dumps({"processor": hw.cpu_label, "cores": hw.cores, "model": model, "weights_read_per_token_bytes": weights,
                               "steps_a_pair": STEPS, "split_gb_s": round(split, 1), "levels": levels, "pairs": found}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, help="a catalogued or imported model, or an artifact's folder")
    parser.add_argument("--pairs", type=int, default=120, help="bandwidth readings and decode runs, in turn")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON to write")
    args = parser.parse_args()
    in_engine_environment(None)
    main(args.model, args.pairs, args.out)
