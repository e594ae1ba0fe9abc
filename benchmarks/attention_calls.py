"""vLLM's CPU attention layer calls with vLLM's backend methods against llmopt's lean ones
(`engine/attention_calls.py`), side by side in one engine: SmolLM2-135M in vLLM's offline API in the
engine environment llmopt chooses here (`step_profile.in_engine_environment`). The compiled graph
is the same for both: only the Python its attention ops call changes, so the two alternate in one
process.

First one layer's two calls as the compiled graph makes them (`torch.ops.vllm.unified_kv_cache_update`
and `unified_attention_with_output`), with the attention metadata of a real batch-1 decode step,
against the kernels called alone; then decode steps (128-token requests, end-of-sequence ignored)
at batch 1 and 8, the two methods in turn, `--rounds` rounds, each the best of two generate calls.
Also checks that both give the same tokens. Writes results/attention_calls.json (or `--out`).

    .venv/bin/python benchmarks/attention_calls.py [--rounds N] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import results_file
from step_profile import compilation_config, in_engine_environment

MODEL = "smollm2-135m-instruct"
CALLS = 20_000
STEPS = 128
BATCHES = (1, 8)


def main(rounds: int, out: Path) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm import forward_context
    from vllm.model_executor.layers.attention import attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from llmopt import sources
    from llmopt.engine import platform, serve

    serve.kernels_from_environment()
    if not hasattr(Impl, "llmopt_vllm_methods"):
        raise SystemExit(f"the lean attention calls were not installed here: unset {platform.VLLM_ATTENTION_CALLS_ENV}")
    lean = (Impl.forward, Impl.do_kv_cache_update)
    methods = {"vLLM's methods": Impl.llmopt_vllm_methods, "llmopt's lean methods": lean}
    caught: dict[str, object] = {}
    model_forward = GPUModelRunner._model_forward

    def catching(self, input_ids=None, *args, **kwargs):  # a decode step's forward context, for the calls alone
        context = forward_context.get_forward_context()
        if "context" not in caught and context.attn_metadata is not None and input_ids is not None and input_ids.shape[0] == 1:
            caught["context"] = context
        return model_forward(self, input_ids, *args, **kwargs)

    GPUModelRunner._model_forward = catching
    llm = LLM(sources.resolve(MODEL).path, max_model_len=2048, seed=0, enable_prefix_caching=False,
              compilation_config=compilation_config())
    prompt = "Write a story about a cat. " * 2

    def generate(batch: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True, temperature=0)
        return [list(o.outputs[0].token_ids) for o in llm.generate([prompt] * batch, params, use_tqdm=False)]

    generate(1)
    GPUModelRunner._model_forward = model_forward
    context = caught["context"]
    name = next(n for n, layer in context.no_compile_layers.items() if isinstance(getattr(layer, "impl", None), Impl))
    layer = context.no_compile_layers[name]
    heads, kv_heads, size = layer.impl.num_heads, layer.impl.num_kv_heads, layer.impl.head_size
    query, output = torch.randn(1, heads, size, dtype=torch.bfloat16), torch.empty(1, heads, size, dtype=torch.bfloat16)
    key, value = torch.randn(1, kv_heads, size, dtype=torch.bfloat16), torch.randn(1, kv_heads, size, dtype=torch.bfloat16)
    named = attention._encode_layer_name(name) if hasattr(attention, "_encode_layer_name") else name
    metadata, slots = context.attn_metadata[name], context.slot_mapping[name]
    blocks, _, block_size, _ = layer.kv_cache.size()
    key_cache, value_cache = layer.kv_cache.view(blocks, kv_heads, block_size * 2, -1).chunk(2, dim=2)

    def per_call(call) -> float:
        for _ in range(200):
            call()
        started = time.perf_counter()
        for _ in range(CALLS):
            call()
        return (time.perf_counter() - started) / CALLS * 1e6

    calls: dict[str, dict[str, float]] = {}
    with forward_context.override_forward_context(context):
        for label, (forward, update) in methods.items():
            Impl.forward, Impl.do_kv_cache_update = forward, update
            dependency = torch.ops.vllm.unified_kv_cache_update(key, value, named)
            calls[label] = {
                "kv_cache_update_us": per_call(lambda: torch.ops.vllm.unified_kv_cache_update(key, value, named)),
                "attention_us": per_call(lambda: torch.ops.vllm.unified_attention_with_output(
                    query, key, value, output, named, None, None, dependency)),
            }
        calls["the kernels alone"] = {
            "kv_cache_update_us": per_call(lambda: torch.ops._C.cpu_attn_reshape_and_cache.default(
                key, value, key_cache, value_cache, slots, layer.isa, 1.0, 1.0, "auto")),
            "attention_us": per_call(lambda: torch.ops._C.cpu_attention_with_kv_cache.default(
                query, key_cache, value_cache, output, metadata.query_start_loc, metadata.seq_lens, layer.impl.scale,
                metadata.causal, None, -1, metadata.block_table, 0.0, metadata.scheduler_metadata, None,
                metadata.dynamic_causal, 1.0, 1.0, "auto")),
        }
    print(f"one layer's calls, {name}, batch 1 (us a call):")
    for label, found in calls.items():
        print(f"  {label:<24} KV-cache write {found['kv_cache_update_us']:6.2f}   attention {found['attention_us']:6.2f}")

    steps: dict[str, dict[str, list[float]]] = {label: {f"batch {b}": [] for b in BATCHES} for label in methods}
    tokens: dict[str, dict[int, list[list[int]]]] = {label: {} for label in methods}
    for round_ in range(rounds):
        for label, (forward, update) in methods.items():
            Impl.forward, Impl.do_kv_cache_update = forward, update
            for batch in BATCHES:
                best = float("inf")
                for _ in range(2):
                    started = time.perf_counter()
                    tokens[label][batch] = generate(batch)
                    best = min(best, (time.perf_counter() - started) / STEPS * 1e3)
                steps[label][f"batch {batch}"].append(round(best, 3))
            print(f"round {round_ + 1}, {label}: " + ", ".join(f"{b} {v[-1]:.2f} ms" for b, v in steps[label].items()))
    Impl.forward, Impl.do_kv_cache_update = lean
    same = all(tokens["vLLM's methods"][b] == tokens["llmopt's lean methods"][b] for b in BATCHES)
    medians = {label: {b: statistics.median(v) for b, v in found.items()} for label, found in steps.items()}
    print("\nmedian ms a step:")
    for batch in BATCHES:
        theirs, ours = medians["vLLM's methods"][f"batch {batch}"], medians["llmopt's lean methods"][f"batch {batch}"]
        print(f"  batch {batch}: vLLM's methods {theirs:.2f}, lean {ours:.2f} ({ours / theirs:.3f}x the time)")
    print(f"same tokens: {same}")
    hw = platform.detect()
    out.write_text(json.dumps({"processor": hw.cpu_label, "cores": hw.cores, "model": MODEL, "layer": name,
                               "calls_us": calls, "steps_ms": steps, "medians_ms": medians, "same_tokens": same},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    results_file.add_out(parser, "attention_calls.json")
    args = parser.parse_args()
    in_engine_environment(None)
    main(args.rounds, args.out)
