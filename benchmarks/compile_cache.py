"""Engine starts side by side: cold, cold with Inductor's C++ kernels kept from an earlier compile
(another entry's, as a second recipe's first start has them), precompiled as llmopt starts it, and
precompiled the ways llmopt did before (its server spawned and importing for itself rather than
forked from the home's zygote; its engine core spawned, as vLLM's CPU platform does, rather than forked; and
vLLM's own server with its saved compiled model off, Inductor's caches only).
Process start to ready, same model, same flags, same machine, with each start's phases from the
engine's log (`vllm.start_phases`).

Each round deletes the compile-cache entry for the configuration and the kept kernels, deploys (a
cold start: vLLM compiles and saves the compiled model into llmopt's compile cache), stops, deletes
the entry again and deploys (cold, the kernels kept by the first start copied in), deploys again (a
precompiled start: the saved model is loaded, nothing is traced or compiled), deploys once more with
the server spawned (`zygote.OFF_ENV`) and once with the engine core spawned (`platform.SPAWNED_CORE_ENV`), then starts vLLM's
plain server against a scratch Inductor cache filled by a cold start of its own. Every other start of llmopt's server is forked from the home's zygote a first,
unmeasured start leaves, as the later starts of any process of the home are. Each round begins with
two one-off `llmopt deploy` commands of the default engine, each in a process of its own, timed from
the command to its return (ready and verified) as a user sees it: the first after the home's
zygote is stopped (it starts one, and pays the imports), the second with that zygote up. Reports the
medians and ratios. Writes benchmarks/results/compile_cache.json, or the file named.
Usage: python benchmarks/compile_cache.py [rounds] [results file name]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llmopt
from llmopt import EngineConfig, endpoints, sources
from llmopt.engine import compile_cache, platform, vllm, zygote

MODEL = "smollm2-135m-instruct"
ENGINE = EngineConfig(max_model_len=4096, max_num_seqs=16)


def start(switch: str | None = None) -> compile_cache.Start:
    """A deploy's start, with the switch named (if any) set in the environment the server inherits."""
    if switch:
        os.environ[switch] = "1"
    try:
        with llmopt.deploy(MODEL, engine=ENGINE) as endpoint:
            return endpoint.start
    finally:
        if switch:
            os.environ.pop(switch)


def command_deploy(name: str) -> float:
    """Seconds a one-off `llmopt deploy` of the default engine takes, from the command to its return;
    its endpoint is stopped after."""
    command = [str(Path(sys.executable).parent / "llmopt"), "deploy", MODEL, "--name", name]
    started = time.monotonic()
    subprocess.run(command, check=True, capture_output=True, timeout=900)
    seconds = round(time.monotonic() - started, 2)
    endpoints.stop(name)
    return seconds


def plain_start(cache: Path, log: Path) -> tuple[float, dict[str, float]]:
    """vLLM's own server, its saved-model load off, Inductor's caches in `cache`."""
    hw = platform.detect()
    env = {**vllm.environment(ENGINE, hw), "VLLM_USE_AOT_COMPILE": "0",
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "VLLM_CACHE_ROOT": str(cache / "vllm")}
    port = vllm.free_port()
    started_at, started = time.time(), time.monotonic()
    server = vllm.start_server(vllm.server_argv(sources.resolve(MODEL).path, ENGINE, MODEL, vllm.DEFAULT_HOST, port),
                               env, log, vllm.DEFAULT_HOST, port, dies_with_caller=True)
    try:
        server.wait_ready(900)
        ready = time.monotonic() - started
        return ready, vllm.start_phases(log.read_text(errors="replace"), started_at, ready)
    finally:
        server.stop()


def main(rounds: int, out_name: str) -> None:
    cold, kept, warm, server_spawned, spawned, plain, phases = [], [], [], [], [], [], {}
    command_first, command_later = [], []
    start()  # the home's zygote imports here
    command_deploy("warm-up")  # the default engine's entry, compiled if it is not yet
    for r in range(rounds):
        zygote.stop_shared()
        command_first.append(command_deploy(f"first-{r}"))
        command_later.append(command_deploy(f"later-{r}"))
        entry = compile_cache.entry_for(sources.resolve(MODEL).path, ENGINE, platform.detect())
        shutil.rmtree(entry.path)  # this round's cold start begins from nothing
        shutil.rmtree(compile_cache.root() / compile_cache.KERNELS_DIR, ignore_errors=True)
        first = start()
        shutil.rmtree(entry.path)
        reusing = start()
        second = start()
        imported = start(zygote.OFF_ENV)
        third = start(platform.SPAWNED_CORE_ENV)
        assert first.outcome == reusing.outcome == "compiled", (first, reusing)
        assert second.outcome == imported.outcome == third.outcome == "precompiled", (second, imported, third)
        assert first.kernels_reused == 0 and reusing.kernels_reused > 0, (first, reusing)
        with tempfile.TemporaryDirectory() as scratch:
            plain_start(Path(scratch), Path(scratch) / "cold.log")  # fills the scratch Inductor cache
            before, before_phases = plain_start(Path(scratch), Path(scratch) / "warm.log")
        cold.append(first.ready_seconds)
        kept.append(reusing.ready_seconds)
        warm.append(second.ready_seconds)
        server_spawned.append(imported.ready_seconds)
        spawned.append(third.ready_seconds)
        plain.append(round(before, 2))
        phases = {"cold": first.phases, "cold, kernels kept": reusing.phases, "precompiled": second.phases,
                  "precompiled, server spawned": imported.phases, "precompiled, core spawned": third.phases,
                  "precompiled, saved model off": before_phases}
        print(f"round {r + 1}: cold {cold[-1]:.1f} s, cold with {reusing.kernels_reused} kernels kept {kept[-1]:.1f} s, precompiled {warm[-1]:.1f} s ({second.compiled_files_added} files "
              f"compiled), with the server spawned {server_spawned[-1]:.1f} s, with the engine core spawned {spawned[-1]:.1f} s, "
              f"with the saved model off {plain[-1]:.1f} s; `llmopt deploy` {command_first[-1]:.1f} s with the home's "
              f"zygote stopped, {command_later[-1]:.1f} s with it up", flush=True)
    row = {"model": MODEL, "processor": platform.detect().cpu_label, "engine": ENGINE.model_dump(mode="json"),
           "rounds": rounds, "cold_s": cold, "cold_kernels_kept_s": kept, "kernels_reused": reusing.kernels_reused,
           "precompiled_s": warm, "precompiled_server_spawned_s": server_spawned, "precompiled_core_spawned_s": spawned,
           "precompiled_saved_model_off_s": plain, "cold_median_s": statistics.median(cold),
           "cold_kernels_kept_median_s": statistics.median(kept),
           "precompiled_median_s": statistics.median(warm), "precompiled_server_spawned_median_s": statistics.median(server_spawned),
           "precompiled_core_spawned_median_s": statistics.median(spawned),
           "precompiled_saved_model_off_median_s": statistics.median(plain), "command_zygote_stopped_s": command_first,
           "command_zygote_up_s": command_later, "command_zygote_stopped_median_s": statistics.median(command_first),
           "command_zygote_up_median_s": statistics.median(command_later), "last_round_phases_s": phases}
    row["ratio"] = round(row["precompiled_median_s"] / row["cold_median_s"], 3)
    row["server_spawned_ratio"] = round(row["precompiled_server_spawned_median_s"] / row["cold_median_s"], 3)
    row["saved_model_off_ratio"] = round(row["precompiled_saved_model_off_median_s"] / row["cold_median_s"], 3)
    row["kernels_kept_ratio"] = round(row["cold_kernels_kept_median_s"] / row["cold_median_s"], 3)
    print(f"\ncold start median {row['cold_median_s']:.1f} s, with the kernels kept {row['cold_kernels_kept_median_s']:.1f} s "
          f"({row['kernels_kept_ratio']}x), precompiled {row['precompiled_median_s']:.1f} s "
          f"({row['ratio']}x), with the server spawned {row['precompiled_server_spawned_median_s']:.1f} s "
          f"({row['server_spawned_ratio']}x), with the engine core spawned {row['precompiled_core_spawned_median_s']:.1f} s, with the saved model off {row['precompiled_saved_model_off_median_s']:.1f} s "
          f"({row['saved_model_off_ratio']}x); a one-off `llmopt deploy` {row['command_zygote_stopped_median_s']:.1f} s "
          f"with the home's zygote stopped, {row['command_zygote_up_median_s']:.1f} s with it up")
    names = list(next(iter(phases.values())))
    print(f"\n{'phase (last round)':<60}" + "".join(f"{k[:28]:>30}" for k in phases))
    for name in names:
        print(f"{name:<60}" + "".join(f"{p.get(name, 0):>30.1f}" for p in phases.values()))
    out = Path(__file__).parent / "results" / out_name
    out.write_text(json.dumps(row, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, sys.argv[2] if len(sys.argv) > 2 else "compile_cache.json")
