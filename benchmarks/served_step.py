"""Where a decode step goes served, against vLLM's offline API in the same hour: vLLM's phases
(`phase_timer.PHASES`) timed around vLLM's methods inside the engine core, wall time and the
thread's CPU time, for SmolLM2-135M in llmopt's engine settings. Served: an endpoint as llmopt
deploys it, driven by llmopt's load generator at concurrency 1 and 8 (64 tokens in, 128 out,
end-of-sequence ignored, as `engine_cpu_settings.py` measures: a level's warm-up and at least
`levels.MIN_DURATION_S` of requests, so its steps include new prompts' prefills beside the
decodes), the engine core timed through `phase_timer/sitecustomize.py` on the server's
PYTHONPATH. Offline: vLLM's `LLM.generate` in the same engine environment
(`step_profile.in_engine_environment`; prefix caching off, where the server keeps vLLM's default,
on, though every prompt is new to it), 6 requests one at a time and 24 eight at a time, the same
lengths. The two alternate, `--rounds` times each; with `--stream-intervals 1,8` each round serves
once per interval (`EngineConfig.stream_interval`: the front end's work a token, against what it
costs the steps). `--model` takes an artifact's folder too (the offline side loads it as
`step_profile.py` does, in the dtype llmopt serves here), `--workload` any of `evaluate`'s
workloads (offline, its prompts with 128 tokens out each), `--graph whole|piecewise` what Inductor
compiles, on both sides (unset: llmopt's choice). Writes results/served_step.json (or `--out`).

    .venv/bin/python benchmarks/served_step.py [--rounds N] [--stream-intervals 1,8] [--model M] [--workload W] [--graph G] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pydantic import ValidationError

import results_file
from engine_cpu_settings import LEVELS, LLMOPT, WORKLOAD, deploy_and_measure
from llmopt.engine.config import CompilationConfig, EngineConfig
from phase_timer import phase_timer

MODEL = "smollm2-135m-instruct"
TIMER_DIR = Path(__file__).parent / "phase_timer"
SHOWN = ("EngineCore.step", "GPUModelRunner._prepare_inputs", "BlockTable.compute_slot_mapping",
         "GPUModelRunner._build_attention_metadata", "GPUModelRunner._model_forward", "LogitsProcessor.forward",
         "GPUModelRunner.sample_tokens", "Scheduler.schedule", "Scheduler.update_from_output")


def _flushed(times: Path, engine_core: int) -> dict[str, dict[str, float]]:
    """The phases the served engine core (pid `engine_core`) timed since the last flush."""
    flush = times.with_name(times.name + phase_timer.FLUSH)
    flush.touch()
    deadline = time.monotonic() + 30
    while flush.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine core did not write its phases to {times}")
        time.sleep(0.05)
    return [found for found in map(json.loads, times.read_text().splitlines()) if found["pid"] == engine_core][-1]["phases"]


def served_mode(interval: int) -> str:
    return "served" if interval == 1 else f"served, interval {interval}"


def intervals(text: str) -> list[int]:
    """`--stream-intervals`, distinct, each checked by `EngineConfig` before the first round's minutes."""
    try:
        found = list(dict.fromkeys(int(n) for n in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of whole numbers") from None
    for interval in found:
        try:
            EngineConfig(stream_interval=interval)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(f"stream interval {interval}: {exc.errors()[0]['msg']}") from None
    return found


def served(times: Path, interval: int, model: str, dataset: str, graph: str | None) -> list[dict]:
    """A deployment measured as `engine_cpu_settings.py` measures one, its engine core's phases by level."""
    from decode_profile import server_pids

    engine_core: list[int] = []

    def ready(pid: int) -> None:
        engine_core.append(server_pids(pid)["engine core"])
        _flushed(times, engine_core[0])  # the start's warm-up runs

    # an artifact is served with the engine settings its job wrote (`interval` 1, checked in `main`)
    engine = None if Path(model).is_dir() else LLMOPT.model_copy(
        update={"stream_interval": interval, "compilation": CompilationConfig(graph=graph)})
    row = deploy_and_measure(served_mode(interval), engine,
                             {"PYTHONPATH": str(TIMER_DIR), phase_timer.ENV: str(times)}, ready, model,
                             after_level=lambda level: {f"phases_c{level}": _flushed(times, engine_core[0])}, workload=dataset)
    return [{"mode": served_mode(interval), "batch": level, "phases": row[f"phases_c{level}"], "out_tok_s": row[f"out_tok_s_c{level}"]}
            for level in LEVELS]


def offline(out: Path, model: str, dataset: str, graph: str | None) -> None:
    """In the engine environment (this script run again with --offline OUT): the same lengths in
    vLLM's offline API, `LEVELS` requests a batch size; the rows into `out`."""
    from step_profile import compilation_config, in_engine_environment

    in_engine_environment(None, None, graph)
    from vllm import LLM, SamplingParams

    from llmopt import sources
    from llmopt.engine import platform, serve
    from llmopt.evaluation import workload

    serve.kernels_from_environment()
    serve.compiled_graph_from_environment()
    timer = phase_timer.Timer()
    timer.install(import_modules=True)
    folder = model if Path(model).is_dir() else sources.resolve(model).path
    llm = LLM(str(folder), max_model_len=2048, seed=0, enable_prefix_caching=False,
              compilation_config=compilation_config(None, graph), dtype=platform.default_dtype(platform.detect()))
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(list(r.messages), tokenize=False, add_generation_prompt=True)
               for r in workload.load(dataset, tokenizer=tokenizer).take(max(LEVELS.values()))]
    params = SamplingParams(max_tokens=128, min_tokens=128, ignore_eos=True, temperature=0)
    llm.generate(prompts[:1], params, use_tqdm=False)
    timer.take()
    rows = []
    for batch, count in LEVELS.items():
        started = time.perf_counter()
        for first in range(0, count, batch):
            llm.generate(prompts[first:first + batch], params, use_tqdm=False)
        rows.append({"mode": "offline", "batch": batch, "phases": timer.take(),
                     "out_tok_s": round(count * 128 / (time.perf_counter() - started), 1)})
    out.write_text(json.dumps(rows))


def main(rounds: int, intervals: list[int], model: str, dataset: str, graph: str | None, out: Path) -> None:
    from llmopt.engine import platform

    times = Path(f"/tmp/llmopt-served-step-{os.getpid()}.jsonl")
    rows = []
    for r in range(rounds):
        subprocess.run([sys.executable, __file__, "--offline", str(times.with_suffix(".offline")), "--model", model,
                        "--workload", dataset, *(["--graph", graph] if graph else [])], check=True)
        rows += [row | {"round": r} for row in json.loads(times.with_suffix(".offline").read_text())]
        for interval in intervals:
            rows += [row | {"round": r} for row in served(times, interval, model, dataset, graph)]
    times.unlink(missing_ok=True)
    times.with_suffix(".offline").unlink(missing_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")  # kept should the summary fail
    modes = ["offline", *map(served_mode, intervals)]
    median = {(mode, batch): {name: {k: statistics.median(row["phases"][name][k] for row in rows
                                                          if (row["mode"], row["batch"]) == (mode, batch))
                                     for k in ("wall_ms", "cpu_ms")} for name in SHOWN}
              for mode in modes for batch in LEVELS}
    columns = [(mode, batch) for batch in LEVELS for mode in modes]
    print(f"median of {rounds} rounds, ms a call, wall (CPU):")
    print(f"{'phase':<42}" + "".join(f"{f'{mode} b{batch}':>24}" for mode, batch in columns))
    for name in SHOWN:
        print(f"{name:<42}" + "".join(f"{median[c][name]['wall_ms']:>15.3f} ({median[c][name]['cpu_ms']:.3f})" for c in columns))
    print(f"{'output tokens/s':<42}" + "".join(
        f"{statistics.median(row['out_tok_s'] for row in rows if (row['mode'], row['batch']) == c):>24.1f}" for c in columns))
    out.write_text(json.dumps({"processor": platform.detect().cpu_label, "model": model, "workload": dataset, "graph": graph,
                               "levels": LEVELS, "stream_intervals": intervals, "rows": rows,
                               "medians": {f"{mode} b{batch}": phases for (mode, batch), phases in median.items()}},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="offline and served runs in turn, this many of each")
    results_file.add_out(parser, "served_step.json")
    parser.add_argument("--stream-intervals", default="1", type=intervals,
                        help="served once a round at each (comma-separated, 1 to 4096)")
    parser.add_argument("--model", default=MODEL, help="a catalogued or imported model, or an artifact's folder")
    parser.add_argument("--workload", default=WORKLOAD, help="the requests, as `evaluate --dataset` takes them")
    parser.add_argument("--graph", choices=("whole", "piecewise"), help="what Inductor compiles (unset: llmopt's choice here)")
    parser.add_argument("--offline", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if Path(args.model).is_dir() and args.stream_intervals != [1]:
        parser.error("an artifact is served with its own engine settings: --stream-intervals takes only 1 with it")
    if Path(args.model).is_dir() and args.graph:
        parser.error("an artifact is served with its own engine settings: --graph is for a model")
    if args.offline:
        offline(args.offline, args.model, args.workload, args.graph)
    else:
        main(args.rounds, args.stream_intervals, args.model, args.workload, args.graph, args.out)
