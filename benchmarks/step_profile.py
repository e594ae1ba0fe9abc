"""Where a decode step's time goes inside the engine, by operator: torch's profiler over decode
steps of SmolLM2-135M in vLLM's offline API (`LLM.generate`, no HTTP front end), in the engine
environment llmopt chooses here (its OpenMP threads, preloads, linear kernels, attention kernel
and the compiled graph's wrapper), at batch 1 and 8, and one prefill of the built-in QA
workload's first prompt (884 tokens in SmolLM2's template). And by vLLM's own phases (`PHASES`:
the scheduler, input preparation, attention metadata, the model's forward, the `lm_head`,
sampling, output processing), each timed around vLLM's method in the same steps: what a step
spends outside the model, which an operator profile does not see.

Also times plain steps without the profiler (best of three generate calls of 128 tokens) and,
for the linear layers, the weight bytes they stream per second and the multiply-adds they do per
second: at batch 1 they are bound by memory, at batch 8 by the kernel's arithmetic, in a prefill
by the matmul rate. Writes benchmarks/results/step_profile.json; with `--kernels packed|llmopt|vllm`
(unset: llmopt's choice here), that linear-kernel choice (`EngineConfig.linear_kernels`) into
step_profile_<kernels>.json; `--model` takes an artifact's folder (a quantized one) too.

    .venv/bin/python benchmarks/step_profile.py [--model M] [--kernels K] [--wrapper cpp|python] [--graph whole|piecewise] [--out NAME]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import results_file
from llmopt import EngineConfig, roofline, sources
from llmopt.engine.config import CompilationConfig
from llmopt.engine import (avx2_bf16_linear, avx2_int8_linear, compile_cache, kernels, platform, prefill_attention,
                           small_batch_linear, vllm, weight_only_int8_linear)
from phase_timer.phase_timer import PHASES, Timer

MODEL = "smollm2-135m-instruct"
BATCHES = (1, 8)
DECODE_STEPS = 128
PREFILL_REPEATS = 4
# vLLM's and llmopt's linear kernels, and torch's matmuls, which a float32 model's layers run on AVX2
LINEAR_OPS = ("_C::weight_packed_linear", "_C::onednn_mm", "_C::int8_scaled_mm_with_quant", "llmopt::small_batch_linear",
              "llmopt::avx2_int8_linear", "llmopt::avx2_bf16_linear",
              "aten::mm", "aten::addmm")


def phases(timer: Timer, run: Callable[[], None], steps: int) -> dict[str, float]:
    """Median milliseconds a step in each of `PHASES`, over one `run` of `steps` steps, each timed
    around vLLM's method by `timer`, installed for the whole script (a timer costs about a
    microsecond, a few tens a step)."""
    timer.take()
    run()
    found = timer.take()
    assert all(found.get(name, {}).get("calls", 0) >= steps for _, name in PHASES), found
    return {name: found[name]["wall_ms"] for _, name in PHASES}


def main(model: str, kernels: str | None, wrapper: str | None, graph: str | None, out: Path) -> None:
    import torch
    from vllm import LLM, SamplingParams

    from llmopt.engine import serve
    from llmopt.evaluation import workload
    from llmopt.evaluation.tokens import TokenCounter

    serve.kernels_from_environment()
    serve.compiled_graph_from_environment()
    folder = Path(model) if Path(model).is_dir() else Path(sources.resolve(model).path)
    served = EngineConfig(linear_kernels=kernels)
    traffic = roofline.served_traffic(folder, served, None)
    timer = Timer()
    timer.install(import_modules=True)
    # no prefix caching: the prefill profile sends one prompt again and again
    # in the dtype llmopt serves here (float32 on x86 without AVX-512, where vLLM's bf16 matmul crawls)
    llm = LLM(str(folder), max_model_len=2048, seed=0, enable_prefix_caching=False, compilation_config=compilation_config(wrapper, graph),
              dtype=platform.default_dtype(platform.detect()))
    short = "Write a story about a cat. " * 2
    # the built-in QA workload's first request, as the chat template renders it: a real prefill
    asked = list(workload.builtin_qa(0, 1).requests[0].messages)
    long = llm.get_tokenizer().apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
    long_tokens = TokenCounter(llm.get_tokenizer()).prompt_tokens(asked)

    def generate(prompts: list[str], tokens: int) -> None:
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0)
        llm.generate(prompts, params, use_tqdm=False)

    def profiled(run, repeats: int, steps: int, rows: int, head_rows: int) -> dict:
        """Plain time of a step (best of three), then torch's profiler over `repeats` runs, per step.
        `rows` go through the linear layers a step, `head_rows` of them through the `lm_head`."""
        plain = []
        for _ in range(3):
            started = time.perf_counter()
            run()
            plain.append((time.perf_counter() - started) / steps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                run()
        per = repeats * steps
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ops) / per / 1e3  # ms a step
        ops_rows = [{"op": e.key, "ms_a_step": round(e.self_cpu_time_total / per / 1e3, 3),
                     "calls_a_step": round(e.count / per, 1), "share": round(e.self_cpu_time_total / 1e3 / per / total, 4)}
                    for e in ops[:20]]
        linear_ms = sum(r["ms_a_step"] for r in ops_rows if r["op"] in LINEAR_OPS)
        macs = (traffic.macs_bf16 + traffic.macs_int8 - traffic.head_macs) * rows + traffic.head_macs * head_rows
        decoding = rows == head_rows  # a prefill reads each weight once for many rows: its bytes say nothing
        return {"step_ms": round(min(plain) * 1e3, 2), "profiled_step_ms": round(total, 2), "linear_ms": round(linear_ms, 2),
                "linear_gb_s": round(traffic.weights_bytes / (linear_ms / 1e3) / 1e9, 1) if linear_ms and decoding else None,
                "linear_gflop_s": round(2 * macs / (linear_ms / 1e3) / 1e9, 1) if linear_ms else None, "ops": ops_rows}

    generate([short], 8)
    found = {}
    for batch in BATCHES:
        decode = functools.partial(generate, [short] * batch, DECODE_STEPS)
        found[f"batch {batch}"] = profiled(decode, 1, DECODE_STEPS, batch, batch) | {"phases_ms": phases(timer, decode, DECODE_STEPS)}
    # one output token: the run is the prompt's prefill (vLLM's budget takes it in one step) and a sample
    found[f"prefill {long_tokens}"] = profiled(lambda: generate([long], 1), PREFILL_REPEATS, 1, long_tokens, 1)
    for name, phase in found.items():
        print(f"\n{name}: {phase['step_ms']} ms a step ({phase['profiled_step_ms']:.2f} profiled); linear layers "
              f"{phase['linear_ms']:.2f} ms ({phase['linear_gb_s']} GB/s, {phase['linear_gflop_s']} GFLOP/s)")
        for r in phase["ops"]:
            print(f"  {r['op'][:46]:<46} {r['ms_a_step']:>7.3f} ms {r['calls_a_step']:>7.1f} calls {r['share']:>6.1%}")
        if "phases_ms" in phase:
            print("  by vLLM's phases, median ms a step:")
            for name, ms in phase["phases_ms"].items():
                print(f"    {name:<46} {ms:>7.3f} ms")
    hw = platform.detect()
    out.write_text(json.dumps({"processor": hw.cpu_label, "cores": hw.cores, "model": model,
                               "linear_kernels": vllm.linear_kernels(EngineConfig(linear_kernels=kernels), hw),
                               "weights_read_per_token_bytes": traffic.weights_bytes, "profiles": found}, indent=2) + "\n")
    print(f"\nwrote {out}")


def compilation_config(wrapper: str | None = None, graph: str | None = None) -> dict[str, object] | None:
    """vLLM's compilation config as llmopt renders it here with the graph's `wrapper` and what is
    compiled, the `graph` or its pieces (None: llmopt's choices), which the environment
    `in_engine_environment` sets goes with: they are chosen together."""
    return vllm.engine_kwargs(_settings(None, wrapper, graph), platform.detect()).get("compilation_config")


def _settings(chosen: str | None, wrapper: str | None, graph: str | None = None) -> EngineConfig:
    return EngineConfig(max_model_len=2048, linear_kernels=chosen, compilation=CompilationConfig(wrapper=wrapper, graph=graph))


def in_engine_environment(chosen: str | None, wrapper: str | None = None, graph: str | None = None) -> None:
    """Runs this script again, unless it already runs so, in the environment llmopt gives the engine
    here with the linear kernels `chosen` and the graph's `wrapper` (None: llmopt's choices), with
    compiled code of its own for each kernel choice, kernel build and wrapper: the kernels are ops in
    the graph, and vLLM's key for its saved model does not know them (llmopt's compile cache does,
    `compile_cache.linear_build`)."""
    settings, hw = _settings(chosen, wrapper, graph), platform.detect()
    engine_env = vllm.environment(settings, hw)
    unset = [name for name in (platform.PACKED_LINEAR_ENV, small_batch_linear.ENV, prefill_attention.ENV, kernels.LIBRARY_ENV,
                               avx2_int8_linear.ENV, avx2_bf16_linear.ENV, weight_only_int8_linear.ENV,
                               platform.PIECEWISE_GRAPH_ENV) if name not in engine_env]
    if any(os.environ.get(name) != value for name, value in engine_env.items()) or any(n in os.environ for n in unset):
        clean = {k: v for k, v in os.environ.items() if k not in unset}
        build = f"{compile_cache.linear_build(settings, hw)} {vllm.graph_wrapper(settings, hw)} {vllm.compiled_graph(settings, hw)}"
        cache = Path.home() / ".cache" / "llmopt-step-profile" / build.replace(" ", "-")
        os.execve(sys.executable, [sys.executable, *sys.argv], clean | engine_env | {
            "TQDM_DISABLE": "1", "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, help="a catalogued or imported model, or an artifact's folder")
    parser.add_argument("--kernels", choices=("packed", "llmopt", "vllm"), help="the linear kernels (unset: llmopt's choice here)")
    parser.add_argument("--wrapper", choices=("cpp", "python"), help="Inductor's wrapper of the graph (unset: llmopt's choice here)")
    parser.add_argument("--graph", choices=("whole", "piecewise"), help="the graph compiled whole or in pieces (unset: llmopt's choice here)")
    results_file.add_out(parser, None, "step_profile.json, step_profile_KERNELS.json with --kernels")
    args = parser.parse_args()
    in_engine_environment(args.kernels, args.wrapper, args.graph)
    main(args.model, args.kernels, args.wrapper, args.graph, args.out or results_file.RESULTS / (f"step_profile_{args.kernels}.json" if args.kernels else "step_profile.json"))
