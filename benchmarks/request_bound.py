"""How far `recommend`'s ratios can go on this machine: the bound the built-in QA workload sets on
each candidate, from the machine's rates, and the measured rows as fractions of it.

A request's time is at least its prefill plus its decoding. Its prefill does the multiply-adds of
the prompt tokens the prefix cache does not hold (vLLM's 128-token blocks, simulated over the prompts
the levels measured, in the order a pass sends them) at the machine's matmul rate:
int8 for an INT8 artifact's linear layers (the float rate where none was measured: no VNNI), the
served float dtype's (bf16, or float32 on x86 without AVX-512) for the rest and for attention; the `lm_head` for
the last position only. Each output token then takes a decode step at its bound: the weights and
the KV cache read once at the machine's read bandwidth (`llmopt.roofline`). Speculation is not in
the bound: at best it makes decoding free, which the "prefill alone" column gives.

Inputs: the machine's rates (`roofline.machine_rates`: kept per machine, measured the first time),
each candidate's artifact (its safetensors headers, and its manifest's engine settings: the dtype
it is served in here), the workload's prompts as the model's chat
template renders them, and a `recommend` run's rows and output lengths
(`results/recommend-<model>-<machine>/recommendation.json`, this kind of machine's run, where its
shipped configurations came from; the artifacts must be on this machine). Prints a table and
writes results/request_bound.json (or --out).

    .venv/bin/python benchmarks/request_bound.py [MODEL] [--out NAME.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import results_file
from llmopt import artifact, roofline, sources
from llmopt.engine import platform, vllm
from llmopt.errors import LlmoptError
from llmopt.evaluation.levels import Plan
from llmopt.evaluation.tokens import TokenCounter

BLOCK = 128  # vLLM's CPU KV-cache block: the prefix cache matches whole blocks
BATCH = 8


def uncached(prompts: list[list[int]]) -> list[int]:
    """Each prompt's tokens the prefix cache does not hold, sent in order after the others: whole
    blocks of an identical prefix are reused, up to the last full block before the prompt's last
    token (vLLM always computes that token, and the block it falls in)."""
    seen: set[tuple[int, ...]] = set()
    left = []
    for ids in prompts:
        hit = 0
        for end in range(BLOCK, len(ids), BLOCK):
            if tuple(ids[:end]) not in seen:
                break
            hit = end
        left.append(len(ids) - hit)
        seen.update(tuple(ids[:end]) for end in range(BLOCK, len(ids) + 1, BLOCK))
    return left


@dataclass(frozen=True)
class Model:
    """What a candidate's prefill and decode steps cost, from its folder."""

    traffic: roofline.Traffic
    layers: int
    attention_width: int  # query heads times head size
    head_int8: bool
    bf16_held: bool  # unquantized matrices streamed as their stored bf16 (llmopt's AVX2 float32 kernel)

    @classmethod
    def of(cls, folder: Path, hw: platform.Hardware) -> "Model":
        """As the artifact is served here (float32 on x86 without AVX-512)."""
        config = json.loads((folder / "config.json").read_text())
        heads = config["num_attention_heads"]
        head = roofline.tensors(folder).get("lm_head.weight")
        settings = artifact.load(folder).engine.settings
        return cls(roofline.served_traffic(folder, settings, hw), config["num_hidden_layers"],
                   heads * (config.get("head_dim") or config["hidden_size"] // heads), head is not None and head["dtype"] == "I8",
                   vllm.holds_bf16_weights(settings, hw))


def prefill_seconds(model: Model, rates: roofline.Rates, tokens: int, context: int) -> float:
    """`tokens` new positions after `context` cached ones: their linear layers (the `lm_head` for
    the last one only), and causal attention (QK and PV) over every position before each, in the
    served float dtype."""
    t = model.traffic
    float_rate, int8_rate = (1e9 * rate for rate in roofline.matmul_gflop_s(t, rates))
    head_rate = int8_rate if model.head_int8 else float_rate
    body = ((t.macs_int8 - t.head_macs * model.head_int8) / int8_rate
            + (t.macs_bf16 - t.head_macs * (not model.head_int8)) / float_rate)
    attended = tokens * context + tokens * (tokens + 1) / 2
    return 2 * tokens * body + 2 * t.head_macs / head_rate + 2 * 2 * attended * model.attention_width * model.layers / float_rate


def bound(folder: Path, hw: platform.Hardware, rates: roofline.Rates, prompts: list[list[int]],
          outputs: list[int]) -> dict[str, float]:
    """Per request: its prefill, which yields the first token, then a decode step at the bound for
    each further one. At c=8 every prefill in turn and the answers decoded eight at a time: an
    estimate rather than a strict bound, since vLLM may fold prefill chunks into decode steps."""
    model = Model.of(folder, hw)
    prefill = [prefill_seconds(model, rates, new, len(ids) - new) for ids, new in zip(prompts, uncached(prompts))]
    step = [1 / roofline.bound_tokens_per_s(model.traffic, rates, 1, len(ids) + out // 2)[0] for ids, out in zip(prompts, outputs)]
    context = round(statistics.mean(len(ids) + out // 2 for ids, out in zip(prompts, outputs)))
    batch_step = BATCH / roofline.bound_tokens_per_s(model.traffic, rates, BATCH, context)[0]
    return {
        "dtype": model.traffic.dtype, "bf16_held": model.bf16_held,
        "prefill_ms": 1e3 * statistics.median(prefill), "decode_ms": 1e3 * statistics.median(step),
        # llmopt's tokens/s per user: each request's output tokens over its latency, averaged
        "per_user_c1": statistics.mean(out / (p + (out - 1) * s) for out, p, s in zip(outputs, prefill, step)),
        "prefill_alone_per_user_c1": statistics.mean(out / p for out, p in zip(outputs, prefill)),
        "total_c8": sum(outputs) / (sum(prefill) + (sum(outputs) - len(outputs)) / BATCH * batch_step),
    }


def main(model: str, out: Path) -> None:
    hw = platform.detect()
    rec = json.loads((results_file.RESULTS / f"recommend-{model}-{hw.slug}" / "recommendation.json").read_text())
    rates = roofline.machine_rates(hw)
    spec = rec["spec"]
    # the prompts the levels measured: past the warm-ups, which go out under a cache salt of their own
    plan = Plan(dataset=spec["dataset"], concurrency=spec["concurrency"], requests=spec["requests"], min_duration_s=spec["min_duration_s"])
    first, count = plan.first_request() or 0, plan.requests_at(max(plan.concurrency)) or 0
    asked = plan.workload(None).requests[first:first + count]
    lengths = {int(k): v for k, v in rec["lengths"].items()}
    counter = TokenCounter.from_path(sources.resolve(model).path)
    prompts = [counter.prompt_ids(r.messages) for r in asked]
    outputs = [lengths[first + i] for i in range(len(asked))]
    rows = {(r["candidate"], r["concurrency"]): r for r in rec["rows"]}
    bf16_c1, bf16_c8 = rows[("bf16", 1)], rows[("bf16", 8)]
    found = {}
    for candidate in rec["candidates"]:
        folder = Path(candidate.get("artifact") or "")
        c1, c8 = rows.get((candidate["name"], 1)), rows.get((candidate["name"], 8))
        if candidate["status"] != "done" or not (folder / "config.json").is_file() or not (c1 and c8):
            continue
        try:
            b = bound(folder, hw, rates, prompts, outputs)
        except LlmoptError as exc:  # an artifact this llmopt cannot read (another schema, damaged): the others still count
            print(f"{candidate['name']}: left out, {exc.one_line()}")
            continue
        found[candidate["name"]] = b | {
            "measured_ttft_p50_ms": c1["ttft_p50_ms"], "measured_tpot_p50_ms": c1["tpot_p50_ms"],
            "measured_per_user_c1": c1["tokens_per_s_per_user"], "measured_total_c8": c8["total_tokens_per_s"],
            "bound_per_user_c1_vs_bf16_measured": b["per_user_c1"] / bf16_c1["tokens_per_s_per_user"],
            "prefill_alone_vs_bf16_measured": b["prefill_alone_per_user_c1"] / bf16_c1["tokens_per_s_per_user"],
            "bound_total_c8_vs_bf16_measured": b["total_c8"] / bf16_c8["total_tokens_per_s"],
        }
    cached = sum(map(len, prompts)) - sum(uncached(prompts))
    print(f"{model} on {hw.cpu_label}, {hw.cores} cores; rates: read {rates.read_gb_s} GB/s, bf16 {rates.bf16_gflop_s} GFLOP/s, "
          f"fp32 {rates.fp32_gflop_s}, "
          f"int8 {rates.int8_gflop_s}; {len(prompts)} QA prompts measured, median {statistics.median(map(len, prompts)):.0f} tokens, "
          f"{cached} of {sum(map(len, prompts))} held by the prefix cache; "
          f"median answer {statistics.median(outputs)} tokens")
    print(f"{'candidate':<28} {'TTFT bound/meas ms':>19} {'TPOT bound/meas ms':>19} {'per user c1 bound/meas':>23} "
          f"{'bound/bf16':>10} {'prefill alone/bf16':>18} {'total c8 bound/meas':>20} {'bound/bf16':>10}")
    for name, r in found.items():
        print(f"{name:<28} {r['prefill_ms']:>8.0f} /{r['measured_ttft_p50_ms']:>6.0f} ({r['prefill_ms'] / r['measured_ttft_p50_ms']:>3.0%})"
              f" {r['decode_ms']:>6.2f} /{r['measured_tpot_p50_ms']:>5.2f} ({r['decode_ms'] / r['measured_tpot_p50_ms']:>3.0%})"
              f" {r['per_user_c1']:>9.1f} /{r['measured_per_user_c1']:>5.1f} ({r['measured_per_user_c1'] / r['per_user_c1']:>3.0%})"
              f" {r['bound_per_user_c1_vs_bf16_measured']:>9.2f}x {r['prefill_alone_vs_bf16_measured']:>17.2f}x"
              f" {r['total_c8']:>9.1f} /{r['measured_total_c8']:>5.1f} ({r['measured_total_c8'] / r['total_c8']:>3.0%})"
              f" {r['bound_total_c8_vs_bf16_measured']:>9.2f}x")
    out.write_text(json.dumps({"model": model, "processor": hw.cpu_label, "cores": hw.cores, "rates": asdict(rates),
                               "recommendation": rec["id"], "prompts": len(prompts), "candidates": found}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    results_file.add_out(parser, "request_bound.json")
    args = parser.parse_args()
    main(args.model, args.out)
