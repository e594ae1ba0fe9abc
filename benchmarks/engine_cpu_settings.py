"""The effect of the CPU engine settings llmopt chooses, measured side by side in one run.

Five deployments of SmolLM2-135M on this machine: vLLM's defaults (one core reserved for the
front end, nothing preloaded, the model in a worker process of its own), no core reserved,
tcmalloc and Intel OpenMP preloaded too, llmopt's choice (all of that, with the model run
inside the engine-core process instead of a worker process that busy-waits against it), and
llmopt's choice with one model thread instead of two. Decode
speed at batch 1 and 8 with fixed lengths (64 in, 128 out, end-of-sequence ignored). Writes benchmarks/results/engine_cpu_settings.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import llmopt
from llmopt import EngineConfig

CONFIGS = {
    "vllm default (1 reserved, no preload)": EngineConfig(max_model_len=2048, reserved_cpus=1, preload=False, executor="mp"),
    "0 reserved, no preload": EngineConfig(max_model_len=2048, reserved_cpus=0, preload=False, executor="mp"),
    "0 reserved, preload": EngineConfig(max_model_len=2048, reserved_cpus=0, preload=True, executor="mp"),
    "llmopt (0 reserved, preload, no worker)": EngineConfig(max_model_len=2048, reserved_cpus=0, preload=True, executor="uni"),
    # one OpenMP thread: the model's threads no longer wait at each parallel loop's barrier for a
    # thread the front end has taken the other core from
    "one model thread (1 reserved, preload, no worker)": EngineConfig(max_model_len=2048, reserved_cpus=1, preload=True,
                                                                       executor="uni"),
}
LEVELS = {1: 6, 8: 24}  # concurrency -> requests


def main() -> None:
    rows = []
    for label, engine in CONFIGS.items():
        with llmopt.deploy("smollm2-135m-instruct", engine=engine) as endpoint:
            row = {"config": label, "env": endpoint.environment, "ready_s": round(endpoint.seconds_to_ready, 1)}
            for level, count in LEVELS.items():
                result = llmopt.evaluate(endpoint=endpoint.name, dataset="synthetic:64,128", concurrency=[level],
                                         requests=count, quality=False)
                lvl = result.targets[0].levels[0]
                row[f"out_tok_s_c{level}"] = round(lvl.output_tokens_per_s, 1)
                row[f"itl_p50_ms_c{level}"] = round(lvl.itl_ms.p50, 2)
            rows.append(row)
    base = rows[0]
    print(f"{'config':<40} {'ready s':>8} {'tok/s b1':>9} {'x':>6} {'tok/s b8':>9} {'x':>6}")
    for row in rows:
        for level in LEVELS:
            row[f"speedup_c{level}"] = round(row[f"out_tok_s_c{level}"] / base[f"out_tok_s_c{level}"], 3)
        print(f"{row['config']:<40} {row['ready_s']:>8} {row['out_tok_s_c1']:>9} {row['speedup_c1']:>6} "
              f"{row['out_tok_s_c8']:>9} {row['speedup_c8']:>6}")
    out = Path(__file__).parent / "results" / "engine_cpu_settings.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": "smollm2-135m-instruct", "workload": "synthetic:64,128", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
