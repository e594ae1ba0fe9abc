"""Does a decode step follow the VM's bandwidth level? Its read bandwidth moves between two levels
every few seconds (on a 2-core Zen 4 EPYC VM: about 31 GB/s most seconds, 48-62 in stretches), so a
roofline fraction depends on which level divides it. This pairs the two in one process, in turn:
the read bandwidth of a 1 GiB tensor (best of three reads, on the engine's two threads), then
decode steps of SmolLM2-135M at batch 1 in vLLM's offline API (llmopt's engine environment, as
`step_profile.py` sets it), then the bandwidth again. The two levels are told apart by a
one-dimensional two-means of the readings (one level where the two means lie close); pairs whose two readings agree
on the level are grouped by it, and each group gives its step time and the fraction of the memory
bound at its own bandwidth (the weights a step reads, from the safetensors headers, over that
bandwidth). Writes benchmarks/results/bandwidth_phases.json (or --out).

    .venv/bin/python benchmarks/bandwidth_phases.py [--model M] [--pairs N] [--out NAME.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import results_file
from llmopt import roofline, sources
from llmopt.engine import platform
from step_profile import compilation_config, in_engine_environment

MODEL = "smollm2-135m-instruct"
STEPS = 32  # decode steps a pair: about a third of a second, inside one bandwidth level
LEVELS_APART = 0.15  # two levels' means at least this share of the readings' median apart, or one level


def split_between_levels(readings: list[float]) -> float | None:
    """Where two levels part: the cut of the sorted readings into two groups with the least spread
    within each (squared deviations from their means, a one-dimensional two-means), midway between
    the groups' nearest readings; None where the two means lie too close to call them two levels
    (readings between the levels, taken as a level changes, fall to whichever side is nearer)."""
    ordered = sorted(readings)

    def spread(group: list[float]) -> float:
        mean = statistics.fmean(group)
        return sum((r - mean) ** 2 for r in group)

    if len(ordered) < 2:
        return None
    cut = min(range(1, len(ordered)), key=lambda i: spread(ordered[:i]) + spread(ordered[i:]))
    low, high = statistics.fmean(ordered[:cut]), statistics.fmean(ordered[cut:])
    if high - low < LEVELS_APART * statistics.median(ordered):
        return None
    return (ordered[cut - 1] + ordered[cut]) / 2


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
        return x.numel() * 4 / roofline.best_seconds(lambda: x.sum(), 3) / 1e9

    generate_s(STEPS + 1)
    found = []
    for _ in range(pairs):
        before = read_gb_s()
        # a step's time without the prompt's prefill and first token: the difference of two runs
        step_ms = (generate_s(STEPS + 1) - generate_s(1)) / STEPS * 1e3
        found.append({"before_gb_s": round(before, 1), "step_ms": round(step_ms, 3), "after_gb_s": round(read_gb_s(), 1)})
    split = split_between_levels([r for pair in found for r in (pair["before_gb_s"], pair["after_gb_s"])])
    tests = {"slow": lambda r: r < split, "fast": lambda r: r >= split} if split is not None else {"one": lambda r: True}
    levels: dict[str, dict[str, float]] = {}
    for name, test in tests.items():
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
          f"batch-1 steps, " + (f"split at {split:.1f} GB/s ({mixed} pairs changed level and are left out)" if split is not None else "one level"))
    print(f"{'level':<6} {'pairs':>5} {'GB/s':>6} {'step ms':>8} {'tok/s':>7} {'bound ms':>9} {'of bound':>9}")
    for name, level in levels.items():
        print(f"{name:<6} {level['pairs']:>5} {level['read_gb_s']:>6.1f} {level['step_ms']:>8.2f} {level['tokens_per_s']:>7.1f} "
              f"{level['bound_step_ms']:>9.2f} {level['fraction']:>9.1%}")
    out.write_text(json.dumps({"processor": hw.cpu_label, "cores": hw.cores, "model": model, "weights_read_per_token_bytes": weights,
                               "steps_a_pair": STEPS, "split_gb_s": round(split, 1) if split is not None else None, "levels": levels, "pairs": found}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, help="a catalogued or imported model, or an artifact's folder")
    parser.add_argument("--pairs", type=int, default=120, help="bandwidth readings and decode runs, in turn")
    results_file.add_out(parser, "bandwidth_phases.json")
    args = parser.parse_args()
    if args.pairs < 2:
        parser.error("--pairs takes at least 2")
    in_engine_environment(None)
    main(args.model, args.pairs, args.out)
