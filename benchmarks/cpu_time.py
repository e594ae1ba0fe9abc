"""Where the machine's cores go while an endpoint decodes: CPU time per output token by process
and thread (the API server, the engine core's model threads and I/O threads, the load generator),
and how long each thread waited runnable for a core (Linux's schedstat), at batch 1 and 8.

On two cores the model's two OpenMP threads share the machine with the front end: a decode step
served takes about 15 ms against 10 ms in vLLM's offline API. This says how much CPU the front end
spends per token and which model thread loses the core to it. Fixed lengths (16 in, 128 out,
end-of-sequence ignored), SmolLM2-135M as llmopt deploys it, or with the settings a row names.
Writes benchmarks/results/cpu_time.json (or --out).

    .venv/bin/python benchmarks/cpu_time.py [ROW ...] [--repeat N] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import llmopt
import results_file
from decode_profile import server_pids
from engine_cpu_settings import LLMOPT, LLMOPT_ROW, ROWS, environment_over

MODEL = "smollm2-135m-instruct"
LEVELS = {1: 8, 8: 32}  # concurrency -> requests
PROMPT_TOKENS, OUTPUT_TOKENS = 16, 128
TICKS = os.sysconf("SC_CLK_TCK")


def _thread_times(pid: int) -> dict[int, tuple[str, float, float, float, int]]:
    """Each thread of a process: its name, CPU seconds (user + system), seconds run, seconds
    waited runnable for a core and times it was given one (schedstat)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
            cpu = (int(fields[11]) + int(fields[12])) / TICKS
            ran, waited, slices = ((task / "schedstat").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
        found[int(task.name)] = (name, cpu, int(ran) / 1e9, int(waited) / 1e9, int(slices))
    return found


def _snapshot(pids: dict[str, int]) -> dict[str, dict[int, tuple[str, float, float, float, int]]]:
    return {process: _thread_times(pid) for process, pid in pids.items()}


def _role(process: str, pid: int, tid: int, name: str) -> str:
    if process == "load generator":
        return "load generator (every thread)"
    if tid == pid:
        return f"{process}: main thread"
    return f"{process}: {name}"


def _delta(before: dict, after: dict, pids: dict[str, int], tokens: int) -> dict[str, dict[str, float]]:
    """Per role, per output token: milliseconds of CPU, run and waited runnable, and times run."""
    rows: dict[str, dict[str, float]] = {}
    for process, threads in after.items():
        for tid, (name, cpu, ran, waited, slices) in threads.items():
            _, cpu0, ran0, waited0, slices0 = before[process].get(tid, (name, 0.0, 0.0, 0.0, 0))
            role = _role(process, pids[process], tid, name)
            row = rows.setdefault(role, {"threads": 0, "cpu_ms": 0.0, "run_ms": 0.0, "waited_ms": 0.0, "runs": 0.0})
            row["threads"] += 1
            row["cpu_ms"] += (cpu - cpu0) * 1000 / tokens
            row["run_ms"] += (ran - ran0) * 1000 / tokens
            row["waited_ms"] += (waited - waited0) * 1000 / tokens
            row["runs"] += (slices - slices0) / tokens
    return {role: {k: round(v, 3) for k, v in row.items()} for role, row in rows.items() if row["run_ms"] > 0.005}


def measure(label: str) -> dict:
    engine, env, once_ready = ROWS[label] if label in ROWS else (LLMOPT, {}, None)
    with environment_over(env):
        with llmopt.deploy(MODEL, engine=engine) as endpoint:
            if once_ready:
                once_ready(endpoint.pid)
            llmopt.evaluate(endpoint=endpoint.name, dataset=f"synthetic:{PROMPT_TOKENS},8", concurrency=[1], requests=2,
                            min_duration_s=0, quality=False)  # warm the path
            pids = server_pids(endpoint.pid) | {"load generator": os.getpid()}
            row: dict = {"config": label}
            for level, count in LEVELS.items():
                before, wall0 = _snapshot(pids), time.perf_counter()
                result = llmopt.evaluate(endpoint=endpoint.name, dataset=f"synthetic:{PROMPT_TOKENS},{OUTPUT_TOKENS}",
                                         concurrency=[level], requests=count, min_duration_s=0, quality=False)
                after, wall = _snapshot(pids), time.perf_counter() - wall0
                lvl = result.targets[0].levels[0]
                tokens = lvl.server_counted_tokens.output
                roles = _delta(before, after, pids, tokens)
                busy = sum(r["cpu_ms"] for r in roles.values())
                row[f"c{level}"] = {"out_tok_s": round(lvl.output_tokens_per_s, 1), "itl_p50_ms": round(lvl.itl_ms.p50, 2),
                                    "ttft_p50_ms": round(lvl.ttft_ms.p50, 1), "wall_ms_per_token": round(wall * 1000 / tokens, 3),
                                    "cores_ms_per_token": round(wall * 1000 / tokens * len(os.sched_getaffinity(0)), 3),
                                    "busy_ms_per_token": round(busy, 3), "roles": roles}
            return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="*", help="labels of engine_cpu_settings.py's rows (default: llmopt's choice)")
    parser.add_argument("--repeat", type=int, default=1, help="take the rows in turn this many times")
    results_file.add_out(parser, "cpu_time.json")
    args = parser.parse_args()
    labels = args.rows or [LLMOPT_ROW]
    rows = [measure(label) for _ in range(args.repeat) for label in labels]
    for row in rows:
        for level in LEVELS:
            found = row[f"c{level}"]
            print(f"\n{row['config']}, batch {level}: {found['out_tok_s']} tok/s (ITL p50 {found['itl_p50_ms']} ms, TTFT p50 "
                  f"{found['ttft_p50_ms']} ms), {found['wall_ms_per_token']} ms wall a token "
                  f"({found['cores_ms_per_token']} core-ms, {found['busy_ms_per_token']} busy)")
            print(f"  {'thread':<58} {'n':>3} {'cpu ms':>8} {'ran ms':>8} {'waited ms':>10} {'runs':>6}")
            for role, r in sorted(found["roles"].items(), key=lambda kv: -kv[1]["run_ms"]):
                print(f"  {role[:58]:<58} {r['threads']:>3} {r['cpu_ms']:>8.3f} {r['run_ms']:>8.3f} {r['waited_ms']:>10.3f} {r['runs']:>6.2f}")
    medians = {label: {f"c{level}": statistics.median(r[f"c{level}"]["out_tok_s"] for r in rows if r["config"] == label)
                       for level in LEVELS} for label in labels}
    args.out.write_text(json.dumps({"model": MODEL, "workload": f"synthetic:{PROMPT_TOKENS},{OUTPUT_TOKENS}",
                               "cores": sorted(os.sched_getaffinity(0)), "rows": rows, "medians": medians}, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()
