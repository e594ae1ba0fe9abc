"""Where a decode step's time goes: py-spy samples the server of a deployed artifact (vLLM's API
server and its engine core, Python and native frames) while fixed-length requests decode, at
batch 1 and batch 16, for bf16 and SmoothQuant W8A8 on SmolLM2-135M.

Each sample of a process's main thread (the engine-core loop; the API server's event loop) goes
to one bucket, by the first rule of `BUCKETS` its stack matches, or counts as waiting; the shares
are of the main thread's busy samples, so of its CPU time. Where the model's forward runs as
Inductor's compiled code, the native frame names the kernel (oneDNN's matmuls, vLLM's CPU
attention, Inductor's fused element-wise loops). py-spy samples the threads Python knows; OpenMP's
worker threads are not among them, but the engine's main thread takes its share of every
parallel loop, so the split within the forward holds.

Needs py-spy on PATH or in the environment (`pip install py-spy`): it is a profiler, not a
dependency of llmopt. Writes benchmarks/results/decode_profile.json.

    .venv/bin/python benchmarks/decode_profile.py
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

import llmopt
from llmopt import artifact
from llmopt.engine import platform

MODEL = "smollm2-135m-instruct"
ARTIFACTS = {"bf16": "baseline", "SmoothQuant W8A8": "smoothquant"}
CASES = {"batch 1": (1, 8), "batch 16": (16, 48)}  # concurrency, requests
OUTPUT_TOKENS, PROMPT_TOKENS, RATE, SETTLE_S = 128, 16, 100, 3.0
# A sample is the main thread's when its stack holds these: vLLM's engine-core loop, or the API
# server's event loop. Other threads (ZeroMQ's, the engine core's I/O threads) are counted apart.
MAIN_THREAD = {"engine core": re.compile(r"run_busy_loop|run_engine_core"), "API server": re.compile(r"uv_run|run_forever|uvloop")}
WAITING = re.compile(r"(?:epoll_pwait|poll|select|PyThread_acquire_lock_timed|pthread_cond_timedwait|zmq_poll)\b[^;]*(?:;[^;]*){0,3}$")
# (bucket, pattern over the whole stack, outermost frame first); the first that matches wins
BUCKETS = (
    ("OpenMP barrier: waiting for the other model thread", re.compile(r"__kmp_hyper_barrier|__kmp_join_barrier|__kmp_barrier|kmp_flag")),
    ("sampler", re.compile(r"[Ss]ampler|sample_tokens")),
    ("lm_head / logits", re.compile(r"compute_logits|LogitsProcessor")),
    ("attention", re.compile(r"cpu_attention|cpu_attn|[Aa]ttention|reshape_and_cache|kv_cache_update")),
    ("linear kernels (oneDNN matmuls, JIT code)", re.compile(r"dnnl|onednn|brgemm|gemm|scaled_mm|\(\?\)")),
    ("other model ops (Inductor's fused loops, torch dispatch)", re.compile(r"LlamaModel|AOTCompiledFunction|Runner\.call|cpp_fused|_ops\.py")),
    ("model input preparation", re.compile(r"_prepare_inputs|_update_states|execute_model|_build_attention_metadata")),
    ("scheduler", re.compile(r"[Ss]chedul")),
    ("detokenizing", re.compile(r"[Dd]etokeniz|decode_token|convert_ids_to_tokens")),
    ("HTTP, JSON and streaming", re.compile(r"uvicorn|starlette|fastapi|h11|httptools|sse|json|serving|protocol|UVStream|write\(")),
    ("metrics", re.compile(r"prometheus|metrics\.py|StatLogger")),
    ("outputs and IPC", re.compile(r"output_processor|OutputProcessor|async_llm|core_client|zmq|msgpack|serial_utils|EngineCoreOutputs")),
)
MODEL_BUCKETS = 6  # the first six are the model's
RESULTS = Path(__file__).parent / "results" / "decode_profile.json"


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        sys.exit("py-spy is not installed: pip install py-spy")
    return found


def server_pids(root_pid: int) -> dict[str, int]:
    """The API server and the engine core it spawned, among the endpoint's processes."""
    root = psutil.Process(root_pid)
    found = {}
    for proc in [root, *root.children(recursive=True)]:
        cmdline = " ".join(proc.cmdline())
        if "EngineCore" in cmdline or "spawn_main" in cmdline:
            found["engine core"] = proc.pid
        elif "llmopt.engine.serve" in cmdline:
            found["API server"] = proc.pid
    return found


def record(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    return subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--native", "--rate", str(RATE), "--duration",
                             str(int(seconds)), "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def buckets(raw: Path, process: str) -> dict[str, float]:
    """Share of the main thread's busy samples by bucket; its waiting and the other threads' busy
    samples as shares of all samples."""
    counts: collections.Counter[str] = collections.Counter()
    main = MAIN_THREAD[process]
    first = 0 if process == "engine core" else MODEL_BUCKETS  # the API server runs no model
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        if WAITING.search(stack):
            counts["(waiting: idle)" if main.search(stack) else "(other threads, waiting)"] += int(n)
        elif not main.search(stack):
            counts["(other threads, busy)"] += int(n)
        else:
            counts[next((name for name, pattern in BUCKETS[first:] if pattern.search(stack)), "other")] += int(n)
    busy = sum(n for name, n in counts.items() if not name.startswith("(")) or 1
    total = sum(counts.values()) or 1
    shares = {name: round(n / busy, 3) for name, n in counts.most_common() if not name.startswith("(")}
    return shares | {name: round(n / total, 3) for name, n in counts.items() if name.startswith("(")} | {"samples": total}


def profile(folder: Path, concurrency: int, requests: int, scratch: Path) -> dict[str, dict[str, float]]:
    with llmopt.deploy(str(folder)) as endpoint:
        llmopt.evaluate(endpoint=endpoint.name, dataset=f"synthetic:{PROMPT_TOKENS},8", concurrency=[1], requests=2,
                        min_duration_s=0, quality=False)  # warm the path before sampling it
        pids = server_pids(endpoint.pid)

        def load() -> None:
            llmopt.evaluate(endpoint=endpoint.name, dataset=f"synthetic:{PROMPT_TOKENS},{OUTPUT_TOKENS}",
                            concurrency=[concurrency], requests=requests, min_duration_s=0, quality=False)

        loader = threading.Thread(target=load)
        loader.start()
        time.sleep(SETTLE_S)  # past the load generator's own start (it tokenizes its prompts through the server)
        outs = {name: scratch / f"{name.replace(' ', '-')}-{concurrency}.raw" for name in pids}
        spies = [record(pid, 12, outs[name]) for name, pid in pids.items()]
        for spy in spies:
            spy.wait()
        loader.join()
        return {name: buckets(out, name) for name, out in outs.items() if out.exists()}


def main() -> None:
    hardware = platform.detect()
    found: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for kind, recipe in ARTIFACTS.items():
            job = llmopt.optimize(MODEL, recipe)  # reused by key when built before
            folder = artifact.verify(job.artifact) and job.artifact
            for case, (concurrency, requests) in CASES.items():
                found[f"{kind}, {case}"] = shares = profile(folder, concurrency, requests, Path(scratch))
                print(f"\n{kind}, {case}", flush=True)
                for process, rows in shares.items():
                    print(f"  {process} ({rows['samples']} samples)")
                    for name, share in rows.items():
                        if name != "samples":
                            print(f"    {name:<52} {share:6.1%}")
    RESULTS.write_text(json.dumps({"processor": hardware.cpu_label, "cores": hardware.cores, "model": MODEL,
                                   "output_tokens": OUTPUT_TOKENS, "profiles": found}, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()
