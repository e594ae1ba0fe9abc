"""Where a decode step's time goes inside the engine, by operator: torch's profiler over decode
steps of SmolLM2-135M in vLLM's offline API (`LLM.generate`, no HTTP front end), in the engine
environment llmopt chooses here (its OpenMP threads, preloads and linear kernels), at batch 1 and 8.

Also times plain steps without the profiler (best of three generate calls of 128 tokens) and,
for the linear layers, the weight bytes they stream per second and the multiply-adds they do per
second: at batch 1 they are bound by memory, at batch 8 by the kernel's arithmetic. Writes
benchmarks/results/step_profile.json; with `--kernels packed|llmopt|vllm` (unset: llmopt's choice
here), that linear-kernel choice (`EngineConfig.linear_kernels`) into step_profile_<kernels>.json.

    .venv/bin/python benchmarks/step_profile.py [--kernels K]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from llmopt import EngineConfig, roofline, sources
from llmopt.engine import platform, small_batch_linear, vllm

MODEL = "smollm2-135m-instruct"
BATCHES = (1, 8)
PROFILED_STEPS = 32
RESULTS = Path(__file__).parent / "results" / "step_profile.json"
LINEAR_OPS = ("_C::weight_packed_linear", "_C::onednn_mm", "_C::int8_scaled_mm_with_quant", "llmopt::small_batch_linear")


def main(kernels: str | None) -> None:
    import torch
    from vllm import LLM, SamplingParams

    from llmopt.engine import serve

    serve.linear_kernels_from_environment()
    folder = Path(sources.resolve(MODEL).path)
    traffic = roofline.traffic(folder)
    llm = LLM(str(folder), max_model_len=2048, seed=0)
    prompt = "Write a story about a cat. " * 2

    def generate(batch: int, tokens: int) -> None:
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0)
        llm.generate([prompt] * batch, params, use_tqdm=False)

    generate(1, 8)
    found = {}
    for batch in BATCHES:
        plain = []
        for _ in range(3):
            started = time.perf_counter()
            generate(batch, 128)
            plain.append((time.perf_counter() - started) / 128)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            generate(batch, PROFILED_STEPS)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ops) / PROFILED_STEPS / 1e3  # ms a step
        rows = [{"op": e.key, "ms_a_step": round(e.self_cpu_time_total / PROFILED_STEPS / 1e3, 3),
                 "calls_a_step": round(e.count / PROFILED_STEPS, 1), "share": round(e.self_cpu_time_total / 1e3 / PROFILED_STEPS / total, 4)}
                for e in ops[:20]]
        linear_ms = sum(r["ms_a_step"] for r in rows if r["op"] in LINEAR_OPS)
        macs = traffic.macs_bf16 + traffic.macs_int8
        found[f"batch {batch}"] = {
            "step_ms": round(min(plain) * 1e3, 2), "profiled_step_ms": round(total, 2), "linear_ms": round(linear_ms, 2),
            "linear_gb_s": round(traffic.weights_bytes / (linear_ms / 1e3) / 1e9, 1) if linear_ms else None,
            "linear_gflop_s": round(2 * macs * batch / (linear_ms / 1e3) / 1e9, 1) if linear_ms else None, "ops": rows}
        print(f"\nbatch {batch}: {found[f'batch {batch}']['step_ms']} ms a step ({total:.2f} profiled); linear layers "
              f"{linear_ms:.2f} ms ({found[f'batch {batch}']['linear_gb_s']} GB/s, {found[f'batch {batch}']['linear_gflop_s']} GFLOP/s)")
        for r in rows:
            print(f"  {r['op'][:46]:<46} {r['ms_a_step']:>7.3f} ms {r['calls_a_step']:>7.1f} calls {r['share']:>6.1%}")
    hw = platform.detect()
    out = RESULTS.with_name(f"step_profile_{kernels}.json") if kernels else RESULTS
    out.write_text(json.dumps({"processor": hw.cpu_label, "cores": hw.cores, "model": MODEL,
                               "linear_kernels": vllm.linear_kernels(EngineConfig(linear_kernels=kernels), hw),
                               "weights_read_per_token_bytes": traffic.weights_bytes, "profiles": found}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    chosen = sys.argv[sys.argv.index("--kernels") + 1] if "--kernels" in sys.argv else None
    engine_env = vllm.environment(EngineConfig(max_model_len=2048, linear_kernels=chosen), platform.detect())
    unset = [name for name in (platform.PACKED_LINEAR_ENV, small_batch_linear.LIBRARY_ENV) if name not in engine_env]
    if any(os.environ.get(name) != value for name, value in engine_env.items()) or any(n in os.environ for n in unset):
        clean = {k: v for k, v in os.environ.items() if k not in unset}
        # compiled code of its own for each choice: the kernels are ops in the graph, and vLLM's key for
        # its saved model does not know them (llmopt's compile cache does, `compile_cache.components`)
        cache = Path.home() / ".cache" / "llmopt-step-profile" / vllm.linear_kernels(EngineConfig(linear_kernels=chosen), platform.detect())
        os.execve(sys.executable, [sys.executable, *sys.argv], clean | engine_env | {
            "TQDM_DISABLE": "1", "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")})
    main(chosen)
