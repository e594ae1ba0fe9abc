"""The effect of the CPU engine settings llmopt chooses, measured side by side in one run.

Deployments of SmolLM2-135M on this machine: vLLM's defaults (one core reserved for the front
end, nothing preloaded, the model in a worker process of its own), no core reserved, tcmalloc and
Intel OpenMP preloaded too, llmopt's choice (all of that, with the model run inside the
engine-core process instead of a worker process that busy-waits against it, and vLLM's packed-weight
linear kernels on processors without AMX, with llmopt's small-batch kernel), llmopt's choice with
vLLM's own linear kernels (oneDNN there) or with vLLM's packed kernels alone, and llmopt's choice with
one model thread instead of two. Then thread placement on llmopt's choice: vLLM's own
pinning (`KMP_AFFINITY` as its CPU worker sets it) given to the whole server, and the same with
every thread but the model's main one set back to every core once the server is ready; and
OpenMP's spin before sleeping (`KMP_BLOCKTIME`) at 0 and 200 ms against vLLM's 5; and streaming
4, 8 or 32 tokens a chunk (`stream_interval`) instead of every token; and the engine core spawned
as vLLM does it rather than forked from the API server; and torch's gloo threads, which poll every
10 ms, in Linux's idle scheduling class. Each row
records which cores each server thread may run on. Decode speed at batch 1 and 8 with fixed
lengths (64 in, 128 out, end-of-sequence ignored). Writes benchmarks/results/engine_cpu_settings.json;
given row labels and --repeat N, takes those rows in turn N times and reports medians
(results/engine_cpu_settings_repeat.json, or --out), for differences within the noise between deployments.
`--kernel PATH` adds a row with another build of llmopt's small-batch kernel (a copy of the library
kept from before a change to its source), served against the current one; with `--own-settings`,
that row and llmopt's take the model's own engine settings (an artifact's: its speculative decoding).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import psutil

import llmopt
import results_file
from decode_profile import server_pids
from llmopt import EngineConfig
from llmopt.engine import kernels, platform, vllm
from llmopt.engine.config import CompilationConfig
from llmopt.engine.platform import SPAWNED_CORE_ENV, VLLM_ATTENTION_CALLS_ENV

LLMOPT = EngineConfig(max_model_len=2048, reserved_cpus=0, preload=True, executor="uni")  # packed linear kernels, dtype as chosen
PYTHON_WRAPPER = CompilationConfig(wrapper="python")  # how stock vLLM runs its compiled graph
STOCK_GRAPH = CompilationConfig(wrapper="python", graph="whole")  # and what it compiles on a CPU
CORES = sorted(os.sched_getaffinity(0))
# what vLLM's OMP process manager sets for its CPU worker (vllm/utils/ompmultiprocessing.py)
PINNED = {"KMP_AFFINITY": f"granularity=fine,explicit,proclist=[{','.join(map(str, CORES))}]", "KMP_TPAUSE": "0"}
LLMOPT_ROW = "llmopt (0 reserved, preload, no worker)"
ROWS: dict[str, tuple[EngineConfig | None, dict[str, str], Callable[[int], None] | None]] = {  # label -> settings, environment, what to do once ready
    "vllm default (1 reserved, no preload)": (EngineConfig(max_model_len=2048, reserved_cpus=1, preload=False, executor="mp", linear_kernels="vllm", attention_kernel="vllm", compilation=STOCK_GRAPH, dtype="bfloat16"), {}, None),
    "0 reserved, no preload": (EngineConfig(max_model_len=2048, reserved_cpus=0, preload=False, executor="mp", linear_kernels="vllm", attention_kernel="vllm", compilation=STOCK_GRAPH, dtype="bfloat16"), {}, None),
    "0 reserved, preload": (EngineConfig(max_model_len=2048, reserved_cpus=0, preload=True, executor="mp", linear_kernels="vllm", attention_kernel="vllm", compilation=STOCK_GRAPH, dtype="bfloat16"), {}, None),
    LLMOPT_ROW: (LLMOPT, {}, None),
    # vLLM's choice of linear kernels (oneDNN on AVX-512 without AMX) instead of its packed-weight ones
    "llmopt, vLLM's linear kernels": (LLMOPT.model_copy(update={"linear_kernels": "vllm"}), {}, None),
    # vLLM's packed-weight kernels alone, without llmopt's small-batch kernel for 1 to 64 rows
    "llmopt, vLLM's packed kernels alone": (LLMOPT.model_copy(update={"linear_kernels": "packed"}), {}, None),
    "llmopt, vLLM's attention": (LLMOPT.model_copy(update={"attention_kernel": "vllm"}), {}, None),
    # the compiled graph run by vLLM's default Python wrapper, not Inductor's C++ one
    "llmopt, Inductor's Python wrapper": (LLMOPT.model_copy(update={"compilation": PYTHON_WRAPPER}), {}, None),
    # and Inductor's C++ wrapper where llmopt's choice is the Python one (x86 without AVX-512)
    "llmopt, Inductor's C++ wrapper": (LLMOPT.model_copy(update={"compilation": CompilationConfig(wrapper="cpp")}), {}, None),
    # activations and unquantized weights in bf16 or in float32, whichever the processor's default is not
    "llmopt, bfloat16": (LLMOPT.model_copy(update={"dtype": "bfloat16"}), {}, None),
    "llmopt, float32": (LLMOPT.model_copy(update={"dtype": "float32"}), {}, None),
    # vLLM's CPU attention backend's own methods around its kernels, not llmopt's lean ones (attention_calls)
    "llmopt, vLLM's attention calls": (LLMOPT, {VLLM_ATTENTION_CALLS_ENV: "1"}, None),
    # the model's graph compiled whole or piecewise, whichever llmopt does not choose here
    "llmopt, whole graph": (LLMOPT.model_copy(update={"compilation": CompilationConfig(graph="whole")}), {}, None),
    "llmopt, piecewise graph": (LLMOPT.model_copy(update={"compilation": CompilationConfig(graph="piecewise")}), {}, None),
    # one OpenMP thread: the model's threads no longer wait at each parallel loop's barrier for a
    # thread the front end has taken the other core from
    "one model thread (1 reserved, preload, no worker)": (LLMOPT.model_copy(update={"reserved_cpus": 1}), {}, None),
    "llmopt, vLLM's pinning for the whole server": (LLMOPT, PINNED, None),
    "llmopt, vLLM's pinning, then all but the model's main thread freed": (LLMOPT, PINNED, lambda pid: free_threads(pid, True)),
    # how long OpenMP's idle threads spin before they sleep: vLLM's 5 ms, none, Intel's default
    "llmopt, KMP_BLOCKTIME=0": (LLMOPT, {"KMP_BLOCKTIME": "0"}, None),
    "llmopt, KMP_BLOCKTIME=200": (LLMOPT, {"KMP_BLOCKTIME": "200"}, None),
    # fewer, larger stream chunks: less serializing and sending per token on the cores the model shares
    "llmopt, stream interval 4": (LLMOPT.model_copy(update={"stream_interval": 4}), {}, None),
    "llmopt, stream interval 8": (LLMOPT.model_copy(update={"stream_interval": 8}), {}, None),
    "llmopt, stream interval 32": (LLMOPT.model_copy(update={"stream_interval": 32}), {}, None),
    # the front end yields to the model: the API server's threads at a lower priority, so the
    # model's second OpenMP thread is not preempted by it while a step runs
    "llmopt, API server at nice 10": (LLMOPT, {}, lambda pid: renice_api_server(pid, 10)),
    "llmopt, API server at nice 19": (LLMOPT, {}, lambda pid: renice_api_server(pid, 19)),
    # the engine core spawned as vLLM does it, instead of forked from the API server (llmopt.engine.serve)
    "llmopt, engine core spawned": (LLMOPT, {SPAWNED_CORE_ENV: "1"}, None),
    "llmopt, every thread freed once ready": (LLMOPT, {}, lambda pid: free_threads(pid, False)),
    # torch's gloo process groups (13 for one device) each poll their sockets every 10 ms from a
    # thread of their own, and every wake-up takes a core from one of the model's two threads
    "llmopt, gloo's polling threads idle-class": (LLMOPT, {}, lambda pid: idle_threads(pid, "gloo_tcp_loop")),
}
LEVELS = {1: 6, 8: 24}  # concurrency -> requests
WORKLOAD = "synthetic:64,128"  # decode alone; `--workload builtin-qa` mixes prompts of 60-250 tokens into decode steps
OTHER_KERNEL = "llmopt, another small-batch kernel build (--kernel)"


def _cores(tid: int) -> str:
    return ",".join(map(str, sorted(os.sched_getaffinity(tid))))


def _server(pid: int) -> list[psutil.Process]:
    server = psutil.Process(pid)
    return [server, *server.children(recursive=True)]


def _label(process: psutil.Process, pid: int) -> str:
    """A server process's name in a row: the API server, or the start of its command line."""
    return "api server" if process.pid == pid else " ".join(process.cmdline())[:40]


def placement(pid: int) -> dict[str, dict[str, int]]:
    """Each server process's threads, counted by the cores they may run on."""
    return {_label(p, pid): dict(collections.Counter(_cores(t.id) for t in p.threads())) for p in _server(pid)}


def memory(pid: int) -> dict[str, float]:
    """Each server process's resident memory once ready, in MiB: where a setting keeps weights twice, it shows."""
    return {_label(p, pid): round(p.memory_info().rss / 2**20, 1) for p in _server(pid)}


def free_threads(pid: int, pin_model_main: bool) -> None:
    """Every server thread may run on every core again, except, if asked, the engine core's main
    thread (the model's first OpenMP thread), kept on the first core. Pinning cannot do more here:
    with KMP_AFFINITY set, the API server's import of torch pins its main thread to the first core,
    and the engine core process it starts inherits that one-core mask, so OpenMP there binds every
    thread, its second model thread included, to the same core. Without pinning, a forked engine
    core still has OpenMP's second thread bound to one core (its first is given all back at the fork)."""
    engine_core = server_pids(pid)["engine core"]
    for process in _server(pid):
        for thread in process.threads():
            try:
                os.sched_setaffinity(thread.id, CORES[:1] if pin_model_main and thread.id == engine_core else CORES)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue


def idle_threads(pid: int, name: str) -> None:
    """The engine core's threads of this name in Linux's idle scheduling class: they run only on a
    core nothing else wants."""
    core = server_pids(pid)["engine core"]
    for task in Path(f"/proc/{core}/task").iterdir():
        if (task / "comm").read_text().strip() == name:
            os.sched_setscheduler(int(task.name), os.SCHED_IDLE, os.sched_param(0))


def renice_api_server(pid: int, niceness: int) -> None:
    """Every thread of the API server at a lower priority (Linux's niceness is per thread)."""
    for thread in psutil.Process(server_pids(pid)["API server"]).threads():
        try:
            os.setpriority(os.PRIO_PROCESS, thread.id, niceness)
        except ProcessLookupError:
            continue


@contextlib.contextmanager
def environment_over(env: dict[str, str]) -> Iterator[None]:
    """Deployments started inside get `env` on top of the environment llmopt sets for vLLM."""
    chosen = vllm.environment
    with mock.patch.object(vllm, "environment", lambda *args: chosen(*args) | env):
        yield


def deploy_and_measure(label: str, engine: EngineConfig | None, env: dict[str, str], once_ready: Callable[[int], None] | None,
                       model: str = "smollm2-135m-instruct", after_level: Callable[[int], dict] | None = None,
                       workload: str = WORKLOAD) -> dict:
    """One deployment's row (`engine` None: an artifact's own settings): each of `LEVELS` in turn, and what
    `after_level` adds after each."""
    with environment_over(env):
        with llmopt.deploy(model, engine=engine) as endpoint:
            if once_ready:
                once_ready(endpoint.pid)
            row = {"config": label, "env": endpoint.environment, "ready_s": round(endpoint.seconds_to_ready, 1),
                   "threads_by_cores": placement(endpoint.pid), "memory_mib": memory(endpoint.pid)}
            for level, count in LEVELS.items():
                result = llmopt.evaluate(endpoint=endpoint.name, dataset=workload, concurrency=[level],
                                         requests=count, quality=False)
                lvl = result.targets[0].levels[0]
                row[f"out_tok_s_c{level}"] = round(lvl.output_tokens_per_s, 1)
                row[f"itl_p50_ms_c{level}"] = round(lvl.itl_ms.p50, 2)
                if after_level:
                    row |= after_level(level)
            return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="*", help="labels of the rows to run (default: every row once)")
    parser.add_argument("--repeat", type=int, default=1, help="take the rows in turn this many times (medians reported)")
    results_file.add_out(parser, None, "engine_cpu_settings.json for every row once, engine_cpu_settings_repeat.json otherwise")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="an imported model or catalogue id")
    parser.add_argument("--kernel", metavar="PATH", help=f"adds the row '{OTHER_KERNEL}': llmopt's choice with the kernel "
                                                         "library at PATH (another build of `engine.kernels`, both kernels in it, kept before a change)")
    parser.add_argument("--own-settings", action="store_true",
                        help=f"the rows '{LLMOPT_ROW}' and '{OTHER_KERNEL}' with the model's own engine settings (an "
                             "artifact's: its speculative decoding) in place of llmopt's choice for it")
    parser.add_argument("--workload", default=WORKLOAD, help="the requests, as `evaluate --dataset` takes them")
    args = parser.parse_args()
    engine = None if args.own_settings else LLMOPT
    ROWS[LLMOPT_ROW] = (engine, {}, None)
    if args.kernel:
        ROWS[OTHER_KERNEL] = (engine, {kernels.LIBRARY_ENV: str(Path(args.kernel).resolve())}, None)
    labels = args.rows or list(ROWS)
    rows = [deploy_and_measure(label, *ROWS[label], model=args.model, workload=args.workload)
            for _ in range(args.repeat) for label in labels]
    base = rows[0]
    print(f"{'config':<50} {'ready s':>8} {'tok/s b1':>9} {'x':>6} {'tok/s b8':>9} {'x':>6}")
    for row in rows:
        for level in LEVELS:
            row[f"speedup_c{level}"] = round(row[f"out_tok_s_c{level}"] / base[f"out_tok_s_c{level}"], 3)
        print(f"{row['config']:<50} {row['ready_s']:>8} {row['out_tok_s_c1']:>9} {row['speedup_c1']:>6} "
              f"{row['out_tok_s_c8']:>9} {row['speedup_c8']:>6}")
        for process, counts in row["threads_by_cores"].items():
            print(f"    {process[-40:]:<40} threads by allowed cores: {counts}, {row['memory_mib'][process]} MiB resident")
    medians = {label: {f"out_tok_s_c{level}": statistics.median(r[f"out_tok_s_c{level}"] for r in rows if r["config"] == label)
                       for level in LEVELS} for label in labels}
    if args.repeat > 1:
        for label, median in medians.items():
            print(f"median of {args.repeat}: {label:<40} " + "  ".join(f"{k} {v}" for k, v in median.items()))
    out = args.out or results_file.RESULTS / ("engine_cpu_settings.json" if not args.rows and args.repeat == 1
                                              else "engine_cpu_settings_repeat.json")
    out.write_text(json.dumps({"processor": platform.detect().cpu_label, "model": args.model, "workload": args.workload,
                               "own_settings": args.own_settings, "cores": CORES, "rows": rows,
                               "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
