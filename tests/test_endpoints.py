"""Endpoints on the real engine: the OpenAI and SageMaker routes, records that tell the truth."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

import llmopt
from llmopt import client, endpoints, procs
from llmopt.engine import (attention_calls, avx2_bf16_linear, avx2_int8_linear, kernels, platform, prefill_attention, small_batch_linear, vllm,
                           weight_only_int8_linear, zygote)
from llmopt.engine.config import CompilationConfig, EngineConfig
from llmopt.errors import LlmoptError

from conftest import SMALL_ENGINE, assert_one_line_error, run_cli


@pytest.mark.engine
def test_chat_non_streaming(endpoint) -> None:
    # "The capital of France is Paris" leads "L'..." by only 0.1 nats in fp32: bf16 kernels on some
    # processors (AVX-512 without AMX) flip it, so the question asks for the answer in a sentence.
    body = {"model": endpoint.served_name,
            "messages": [{"role": "user", "content": "Answer in one sentence: what is the capital city of France?"}],
            "max_tokens": 24, "temperature": 0}
    reply = httpx.post(f"{endpoint.url}/v1/chat/completions", json=body, timeout=60).json()
    text = reply["choices"][0]["message"]["content"]
    assert "Paris" in text, text
    assert reply["usage"]["completion_tokens"] > 0


@pytest.mark.engine
def test_chat_streaming(endpoint) -> None:
    result = client.chat(endpoint.url, endpoint.served_name, "Name a colour of the sky.", max_tokens=16)
    assert result.text.strip()
    assert 0 < result.completion_tokens <= 16
    assert 0 < result.seconds_to_first_token <= result.seconds_total


def _streamed_chunks(endpoint: endpoints.Endpoint, tokens: int) -> list[str]:
    """The text of each chunk a streamed completion of "1, 2, 3, 4," arrives in, at temperature 0."""
    body = {"model": endpoint.served_name, "prompt": "1, 2, 3, 4,", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{endpoint.url}/v1/completions", json=body, timeout=60) as response:
        return [json.loads(line[6:])["choices"][0]["text"] for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.engine
def test_completions_streaming(endpoint) -> None:
    chunks = _streamed_chunks(endpoint, 8)
    assert len(chunks) > 1 and "5" in "".join(chunks)


@pytest.mark.engine
def test_a_stream_interval_gathers_tokens_into_fewer_chunks(endpoint, smol) -> None:
    """The same 32 tokens, streamed one by one by the session's endpoint and four at a time after
    the first by one deployed with `stream_interval=4`."""
    every = _streamed_chunks(endpoint, 32)
    with llmopt.deploy(smol.id, name="gathered", engine=SMALL_ENGINE.model_copy(update={"stream_interval": 4})) as gathered:
        assert "'stream_interval': 4" in Path(gathered.log_path).read_text()  # vLLM's own "non-default args" line
        fewer = _streamed_chunks(gathered, 32)
    assert "".join(fewer) == "".join(every)
    assert len(every) >= 24 and len(fewer) <= 1 + 31 // 4 + 2, (len(every), len(fewer))


@pytest.mark.engine
def test_sagemaker_ping_and_invocations(endpoint) -> None:
    assert httpx.get(f"{endpoint.url}/ping", timeout=10).status_code == 200
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    reply = httpx.post(f"{endpoint.url}/invocations", json=body, timeout=60)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"]


@pytest.mark.engine
def test_record_and_cli_views(endpoint) -> None:
    record = llmopt.get_endpoint(endpoint.name)
    assert record.status == endpoints.READY and record.ready_at and record.pid
    assert record.engine.kv_cache_gib == 1
    assert record.environment["VLLM_CPU_KVCACHE_SPACE"] == "1" and "VLLM_CPU_NUM_OF_RESERVED_CPU" in record.environment
    listed = run_cli("endpoints", "list")
    assert listed.returncode == 0 and endpoint.name in listed.stdout and "READY" in listed.stdout
    as_json = json.loads(run_cli("endpoints", "list", "--json").stdout)
    assert [e["name"] for e in as_json if e["status"] == "READY"] == [e.name for e in llmopt.list_endpoints("ready")]
    described = json.loads(run_cli("endpoints", "describe", endpoint.name).stdout)
    assert described["port"] == endpoint.port and described["engine"]["max_model_len"] == SMALL_ENGINE.max_model_len
    logs = run_cli("endpoints", "logs", endpoint.name)
    assert f"-m {vllm.LOCAL_SERVER_MODULE} --model" in logs.stdout  # vLLM's server as llmopt starts it


@pytest.mark.engine
def test_model_runs_in_the_engine_core_process_on_small_machines(endpoint) -> None:
    """On this 2-core machine no worker process is spawned: vLLM's log says who loaded the model."""
    if platform.detect().cores > 4:
        pytest.skip("larger machines keep vLLM's worker process")
    env = llmopt.get_endpoint(endpoint.name).environment
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == str(platform.detect().cores)
    loader = [line for line in Path(endpoint.log_path).read_text().splitlines() if "Starting to load model" in line]
    assert loader and all(line.startswith("(EngineCore") for line in loader), loader


@pytest.mark.parametrize("cores, engine, expected", [
    (2, EngineConfig(), "uni"),
    (4, EngineConfig(reserved_cpus=1), "uni"),
    (16, EngineConfig(), "mp"),
    (2, EngineConfig(executor="mp"), "mp"),
    (2, EngineConfig(tensor_parallel_size=2), "mp"),
])
def test_executor_is_chosen_from_the_machine(cores: int, engine: EngineConfig, expected: str) -> None:
    hw = platform.Hardware(device="cpu", cpu_model="test", cores=cores, memory_gib=24, cpu_flags=(), gpu=None)
    env = vllm.environment(engine, hw)
    reserved = int(env["VLLM_CPU_NUM_OF_RESERVED_CPU"])
    if expected == "uni":
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == str(cores - reserved)
    else:
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "OMP_NUM_THREADS" not in env


@pytest.mark.engine
def test_linear_layers_get_the_kernels_chosen_for_this_processor(endpoint) -> None:
    """On AVX-512 BF16, vLLM's packed-weight kernels (the engine's log says so), with llmopt's small-batch
    kernel where it is built (loaded in the engine core, where the model runs: up to 64 rows, and its
    prefill attention; with AMX, its AMX build, up to 4 rows, and oneDNN above for the layers vLLM gives oneDNN); on x86 without AVX-512 nor VNNI, llmopt's AVX2 library: its int8
    kernel, and its float32 one with bf16-held weights for the model's layers and tied lm_head. Its attention layers, on CPU, through llmopt's lean calls."""
    hw = platform.detect()
    chosen = vllm.linear_kernels(EngineConfig(), hw)
    packed = chosen in ("packed", "llmopt") and not platform.avx2_int8_applies(hw)
    assert (platform.PACKED_LINEAR_ENV in llmopt.get_endpoint(endpoint.name).environment) == packed
    prompt = "The sea is wide and the sky is blue. " * 8  # a prompt: the attention kernel's first call says so
    httpx.post(f"{endpoint.url}/v1/completions", json={"model": endpoint.served_name, "prompt": prompt, "max_tokens": 2},
               timeout=60).raise_for_status()
    log = Path(endpoint.log_path).read_text().splitlines()
    said = [line for line in log if "packed-weight linear kernels" in line]
    assert len(said) == packed and all(line.startswith("(EngineCore") for line in said), said
    server = psutil.Process(llmopt.get_endpoint(endpoint.name).pid)
    cores = [p for p in [server, *server.children(recursive=True)] if "EngineCore" in p.name() + " ".join(p.cmdline())]
    assert len(cores) == 1, cores
    core = cores[0]
    mapped = {Path(m.path).name for m in core.memory_maps(grouped=False)}
    attention = vllm.attention_kernel(EngineConfig(), hw)
    assert (kernels.library_path(platform.kernel_library(hw)).name in mapped) == ("llmopt" in (chosen, attention)), (chosen, attention)
    avx2 = chosen == "llmopt" and platform.avx2_int8_applies(hw)
    rows = small_batch_linear.max_rows(kernels.library_path(platform.kernel_library(hw)))
    for line, used in ((f"small-batch bf16 linear kernel for up to {rows} rows", chosen == "llmopt" and packed),
                       (small_batch_linear.ONEDNN_ABOVE_LINE, chosen == "llmopt" and packed and hw.has_amx),
                       (prefill_attention.PROMPTS_LINE, attention == "llmopt"),
                       (prefill_attention.DECODES_LINE, attention == "llmopt"),
                       (attention_calls.LINE, hw.device == "cpu"),
                       (f"Using {avx2_bf16_linear.KERNEL} for UnquantizedLinearMethod", avx2),
                       (f"Using {avx2_bf16_linear.KERNEL} for UnquantizedEmbeddingMethod", avx2)):
        said = [entry for entry in log if line in entry]
        assert len(said) == used and all(entry.startswith("(EngineCore") for entry in said), said


@pytest.mark.engine
def test_the_engine_core_is_forked_from_the_server(endpoint) -> None:
    """Forked, not spawned (vLLM's CPU default): it shares its server's memory layout, which a newly
    started interpreter would not have (address randomization)."""
    server = psutil.Process(llmopt.get_endpoint(endpoint.name).pid)
    cores = [p for p in [server, *server.children(recursive=True)] if "EngineCore" in p.name() + " ".join(p.cmdline())]
    assert len(cores) == 1, cores
    core = cores[0]

    def libc(process: psutil.Process) -> str:
        return next(m.addr for m in process.memory_maps(grouped=False) if Path(m.path).name.startswith("libc.so"))

    assert libc(core) == libc(core.parent())
    # and its main thread may run where the server's may: Intel OpenMP pins a forked child's to the
    # first core, and numba (n-gram speculation) sized itself from that and set the model to one thread
    assert os.sched_getaffinity(core.pid) == os.sched_getaffinity(server.pid)


@pytest.mark.engine
def test_a_later_deploy_by_another_command_is_forked_from_the_homes_zygote_and_answers_as_a_spawned_one(
        endpoint, smol, monkeypatch) -> None:
    """The session's endpoint started the home's zygote, which imported vLLM's server: a later
    deploy, even by a one-off `llmopt deploy` in a process of its own, is forked from it and skips
    the imports, and serves what a spawned one does."""
    question = "Name three colours of the rainbow."
    done = run_cli("deploy", smol.id, "--name", "forked", "--kv-cache-gib", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        forked = endpoints.get("forked")
        server = psutil.Process(forked.pid)
        homes = server.parent()
        assert homes.cmdline()[1:3] == ["-m", zygote.__name__] and os.getsid(homes.pid) == homes.pid
        assert psutil.Process(endpoint.pid).parent().pid == homes.pid  # the one the session's endpoint came from
        assert server.cmdline()[1:3] == ["-m", zygote.SERVER_MODULE]  # what `ps` shows: the command a spawned one runs
        # on this process's cores, its engine core too: Intel OpenMP, loaded in the zygote, pins a
        # forked child to the first, which the server and everything it starts would inherit
        assert all(os.sched_getaffinity(p.pid) == os.sched_getaffinity(0) for p in [server, *server.children(recursive=True)])
        assert forked.start.outcome == "precompiled"
        forked_imports = forked.start.phases["server process and imports"]
        said = client.chat(forked.url, forked.served_name, question, max_tokens=32).text
    finally:
        endpoints.stop("forked")
    monkeypatch.setenv(zygote.OFF_ENV, "1")
    with llmopt.deploy(smol.id, name="spawned", engine=SMALL_ENGINE) as spawned:
        assert psutil.Process(spawned.pid).parent().pid == os.getpid()
        assert spawned.start.outcome == "precompiled"
        # vLLM's server imports take 4-10 s on these machines (4.6 on Zen 5 on 2026-12-08); a forked one's none
        assert forked_imports + 2 < spawned.start.phases["server process and imports"]
        assert client.chat(spawned.url, spawned.served_name, question, max_tokens=32).text == said


@pytest.mark.vllm
def test_a_forked_engine_core_gets_the_inductor_options_a_spawned_one_reads_at_import() -> None:
    """vLLM's CPU platform sets them in the environment after torch is imported; they change
    Inductor's code and vLLM's key for its saved model."""
    code = ("from llmopt.engine import serve\n"  # imports vLLM, and torch with it
            "import os; os.environ.update(TORCHINDUCTOR_CPP_DYNAMIC_THREADS='1', TORCHINDUCTOR_COMPILE_THREADS='1')\n"
            "from torch._inductor import config; before = config.cpp.dynamic_threads\n"
            "serve._forked_engine_core()\n"
            "from vllm.v1.engine import utils; import inspect\n"
            "assert 'get_mp_context()' in inspect.getsource(utils.CoreEngineProcManager.__init__)\n"
            "print(before, utils.get_mp_context().get_start_method(), config.cpp.dynamic_threads, config.compile_threads)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "fork", "True", "1"]


# minor page faults of a call 200 frames deep, made 2,000 times, from where a process stands and
# as a forked engine core's loop (vLLM's process target, as llmopt's server module leaves it)
FRAME_CHUNKS = """
import inspect, resource
from llmopt.engine import serve
from vllm.v1.engine import utils
from vllm.v1.engine.core import EngineCoreProc

def deep(n):
    a = b = c = d = e = f = g = h = n
    return deep(n - 1) if n else a

def faults(times):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        deep(200)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

assert "target=EngineCoreProc.run_engine_core" in inspect.getsource(utils.CoreEngineProcManager.__init__)
EngineCoreProc.run_engine_core = staticmethod(faults)
serve._forked_engine_core()
faults(10)
print(faults(2000), EngineCoreProc.run_engine_core(times=2000))
"""


@pytest.mark.vllm
def test_a_forked_engine_cores_loop_runs_on_a_frame_chunk_that_nothing_else_ends() -> None:
    """CPython unmaps a chunk of its frame stack as soon as the frame that opened it returns: calls
    that cross a chunk's end map and fault fresh pages every time (a piecewise graph's step did, in
    a forked core, 30 times a step). Deeper than a chunk, the calls here cross one every time from
    where the process stands, and none from the frame the forked core's loop runs in."""
    done = subprocess.run([sys.executable, "-c", FRAME_CHUNKS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    anywhere, own_chunk = map(int, done.stdout.split())
    assert anywhere > 4000 and own_chunk < 100, (anywhere, own_chunk)


AVX512 = ("avx512_bf16", "avx512_vnni", "avx512bw", "avx512f")


@pytest.mark.parametrize("flags, engine, built, expected", [
    (AVX512, EngineConfig(), True, "llmopt"),
    (AVX512, EngineConfig(), False, "packed"),
    ((*AVX512, "amx_bf16", "amx_int8", "amx_tile"), EngineConfig(), True, "llmopt"),  # its AMX build: the bf16 kernel up to 4 rows
    ((*AVX512, "amx_bf16", "amx_int8", "amx_tile"), EngineConfig(), False, "vllm"),
    (AVX512, EngineConfig(linear_kernels="vllm"), True, "vllm"),
    (AVX512, EngineConfig(linear_kernels="packed"), True, "packed"),
    (AVX512, EngineConfig(linear_kernels="vllm", attention_kernel="vllm"), True, "vllm"),
    (AVX512, EngineConfig(attention_kernel="vllm"), True, "llmopt"),
    (AVX512, EngineConfig(linear_kernels="packed", attention_kernel="llmopt"), False, "packed"),
    ((*AVX512, "amx_tile"), EngineConfig(linear_kernels="packed"), False, "packed"),
    (("avx2",), EngineConfig(), True, "llmopt"),  # no AVX-512: oneDNN's int8 has no VNNI there, llmopt's AVX2 W8A8
    (("avx2",), EngineConfig(), False, "weight_only"),  # and where that kernel is not built, torch's weight-only int8
    (("avx2", "avx_vnni"), EngineConfig(), True, "vllm"),  # AVX-VNNI: oneDNN's int8 has it (not measured)
    (("avx2",), EngineConfig(linear_kernels="vllm"), True, "vllm"),
    (AVX512, EngineConfig(linear_kernels="weight_only"), True, "weight_only"),
])
def test_linear_kernels_are_chosen_from_the_processor(flags: tuple[str, ...], engine: EngineConfig, built: bool,
                                                      expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "built", lambda library=kernels.AVX512: built)
    monkeypatch.setattr(kernels, "build", lambda library=kernels.AVX512: Path(f"/built/{library.prefix}.so"))
    hw = platform.Hardware(device="cpu", cpu_model="test", cores=2, memory_gib=24, cpu_flags=flags, gpu=None)
    assert vllm.linear_kernels(engine, hw) == expected
    env = vllm.environment(engine, hw)
    avx2 = platform.avx2_int8_applies(hw)
    assert (platform.PACKED_LINEAR_ENV in env) == (expected in ("packed", "llmopt") and not avx2)
    assert (env.get(small_batch_linear.ENV) == "1") == (expected == "llmopt" and not avx2)
    assert (env.get(avx2_int8_linear.ENV) == "1") == (expected == "llmopt" and avx2)
    assert (env.get(avx2_bf16_linear.ENV) == "1") == (expected == "llmopt" and avx2)
    assert (env.get(weight_only_int8_linear.ENV) == "1") == (expected == "weight_only")
    attention = vllm.attention_kernel(engine, hw)
    assert attention == (engine.attention_kernel or ("llmopt" if built and platform.prefill_attention_applies(hw) else "vllm"))
    assert (env.get(prefill_attention.ENV) == "1") == (attention == "llmopt")
    assert (kernels.LIBRARY_ENV in env) == ("llmopt" in (expected, attention))
    if kernels.LIBRARY_ENV in env:  # the build for this processor
        assert env[kernels.LIBRARY_ENV] == f"/built/{platform.kernel_library(hw).prefix}.so"
    image = vllm.image_environment(engine, hw)  # vLLM's own image has none of them
    assert not {platform.PACKED_LINEAR_ENV, small_batch_linear.ENV, prefill_attention.ENV, kernels.LIBRARY_ENV,
                weight_only_int8_linear.ENV, avx2_int8_linear.ENV, avx2_bf16_linear.ENV} & set(image)


@pytest.mark.parametrize("flags, engine, wrapper", [
    (("avx2", "avx512f"), EngineConfig(), "cpp"),
    (("avx2",), EngineConfig(), "python"),
    (("avx2",), EngineConfig(compilation=CompilationConfig(wrapper="cpp")), "cpp"),
    (("avx2", "avx512f"), EngineConfig(compilation=CompilationConfig(wrapper="python")), "python"),
    (("avx2", "avx512f"), EngineConfig(compilation=CompilationConfig(mode="eager")), None),
    (("avx2", "avx512f"), EngineConfig(compilation=CompilationConfig(mode="eager", wrapper="cpp")), None),
])
def test_the_graph_wrapper_on_cpu_and_what_it_takes(flags: tuple[str, ...], engine: EngineConfig, wrapper: str | None) -> None:
    """Inductor's C++ wrapper by default on CPUs with AVX-512 (Python's on AVX2: served there, the
    C++ one read faster for bf16 and slower for SmoothQuant); it passes no Python object to an op,
    so vLLM's ops then name their layers by plain strings. An eager model has no graph to wrap."""
    hw = platform.Hardware(device="cpu", cpu_model="test", cores=2, memory_gib=24, cpu_flags=flags, gpu=None)
    assert vllm.graph_wrapper(engine, hw) == wrapper
    argv = vllm.flags(engine, "m", hw=hw)
    compilation = json.loads(argv[argv.index("--compilation-config") + 1]) if "--compilation-config" in argv else None
    expected = {"cpp": {"inductor_compile_config": {"cpp_wrapper": True}}, "python": None, None: {"mode": 0}}[wrapper]
    assert compilation == expected
    assert vllm.engine_kwargs(engine, hw).get("compilation_config") == expected
    for env in (vllm.environment(engine, hw), vllm.image_environment(engine, hw)):  # vLLM's own image takes the flag too
        assert env.get("VLLM_USE_LAYERNAME") == ("0" if wrapper == "cpp" else None)


@pytest.mark.parametrize("flags, compilation, graph", [
    (("avx2",), CompilationConfig(), "whole"),  # vLLM's CPU way: piecewise steps were longer served
    (("avx2", "avx512f"), CompilationConfig(), "whole"),
    (("avx2",), CompilationConfig(graph="piecewise"), "piecewise"),
    (("avx2", "avx512f"), CompilationConfig(graph="piecewise", wrapper="cpp"), "piecewise"),
    (("avx2",), CompilationConfig(mode="eager"), None),
])
def test_the_compiled_graph_on_cpu_and_what_it_takes(flags: tuple[str, ...], compilation: CompilationConfig, graph: str | None) -> None:
    """On a CPU vLLM compiles the whole graph; llmopt's server module keeps its piecewise compile
    where the settings ask, through the environment; vLLM's own server and image know no such switch."""
    hw = platform.Hardware(device="cpu", cpu_model="test", cores=2, memory_gib=24, cpu_flags=flags, gpu=None)
    engine = EngineConfig(compilation=compilation)
    assert vllm.compiled_graph(engine, hw) == graph
    assert vllm.environment(engine, hw).get(platform.PIECEWISE_GRAPH_ENV) == ("1" if graph == "piecewise" else None)
    assert platform.PIECEWISE_GRAPH_ENV not in vllm.image_environment(engine, hw)
    assert platform.PIECEWISE_GRAPH_ENV not in vllm.plain_environment(engine, hw)


@pytest.mark.parametrize("device, flags, engine, dtype", [
    ("cpu", ("avx", "avx2"), EngineConfig(), "float32"),  # no bf16 matmul in vLLM's AVX2 build
    ("cpu", ("avx", "avx2"), EngineConfig(dtype="bfloat16"), "bfloat16"),
    ("cpu", AVX512, EngineConfig(), "bfloat16"),
    ("cpu", ("avx2", "avx512f"), EngineConfig(), "bfloat16"),  # AVX-512 without BF16: not measured, vLLM's choice
    ("cpu", (), EngineConfig(), "bfloat16"),  # not x86 (Arm lists no AVX)
    ("cuda", ("avx", "avx2"), EngineConfig(), "bfloat16"),
])
def test_the_dtype_is_chosen_from_the_processor(device: str, flags: tuple[str, ...], engine: EngineConfig, dtype: str) -> None:
    hw = platform.Hardware(device=device, cpu_model="test", cores=2, memory_gib=24, cpu_flags=flags,
                           gpu="NVIDIA L4" if device == "cuda" else None, gpu_count=int(device == "cuda"))
    argv = vllm.flags(engine, "m", hw=hw)
    assert argv[argv.index("--dtype") + 1] == dtype == vllm.engine_kwargs(engine, hw)["dtype"]


@pytest.mark.parametrize("choice, flags", [("packed", ("avx2",)), ("llmopt", ("avx2", "avx512f"))])
def test_packed_linear_kernels_where_they_cannot_run_are_refused(choice: str, flags: tuple[str, ...]) -> None:
    """'llmopt' on AVX2 alone is its AVX2 int8 kernel; on AVX-512 without BF16 and VNNI nothing of llmopt's runs."""
    hw = platform.Hardware(device="cpu", cpu_model="Old Xeon", cores=2, memory_gib=24, cpu_flags=flags, gpu=None)
    with pytest.raises(LlmoptError, match=f"'{choice}' needs AVX-512 BF16 and VNNI, which this Old Xeon lacks -- leave linear_kernels unset"):
        vllm.environment(EngineConfig(linear_kernels=choice), hw)


@pytest.mark.parametrize("flags, lacks", [(("avx2", "avx512f"), "is neither"), (("avx2", "avx_vnni"), "is neither"),
                                          ((*AVX512, "amx_bf16", "amx_tile"), "has AMX")])
def test_the_prefill_attention_where_it_cannot_run_is_refused(flags: tuple[str, ...], lacks: str) -> None:
    hw = platform.Hardware(device="cpu", cpu_model="Xeon", cores=2, memory_gib=24, cpu_flags=flags, gpu=None)
    with pytest.raises(LlmoptError, match=f"attention_kernel 'llmopt' runs on AVX-512 BF16 without AMX or on AVX2 without "
                                          f"AVX-512 and VNNI, and this Xeon {lacks} -- leave attention_kernel unset"):
        vllm.environment(EngineConfig(linear_kernels="vllm", attention_kernel="llmopt"), hw)


def test_one_process_executor_with_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 use 'mp'"):
        EngineConfig(executor="uni", tensor_parallel_size=2)


@pytest.mark.engine
def test_port_in_use_is_refused(endpoint) -> None:
    assert_one_line_error(run_cli("deploy", endpoint.model, "--port", str(endpoint.port)), f"port {endpoint.port}", "--port")
    with pytest.raises(LlmoptError, match="already in use"):
        llmopt.deploy(endpoint.model, port=endpoint.port)


@pytest.mark.engine
def test_engine_that_fails_to_start_is_reported(smol) -> None:
    """An impossible engine setting: vLLM exits at once; the error carries its log, the record says FAILED."""
    with pytest.raises(LlmoptError) as info:
        llmopt.deploy(smol.id, name="doomed", engine=EngineConfig(max_model_len=1_000_000, kv_cache_gib=1), timeout_s=300)
    assert "exited before it was ready" in info.value.problem
    assert "max_model_len" in info.value.problem or "max-model-len" in info.value.problem  # vLLM's own reason
    record = llmopt.get_endpoint("doomed")
    assert record.status == endpoints.FAILED and record.failure_reason


@pytest.mark.engine
def test_cli_deploy_returns_and_a_killed_engine_shows_failed(smol) -> None:
    """`llmopt deploy` returns while the server keeps serving; killing it from outside is seen."""
    deployed = run_cli("deploy", smol.id, "--name", "cli-ep", "--max-model-len", "4096", "--kv-cache-gib", "1")
    assert deployed.returncode == 0, deployed.stderr
    assert "ready at http://127.0.0.1:" in deployed.stdout
    record = llmopt.get_endpoint("cli-ep")
    assert record.status == endpoints.READY
    answer = client.chat(record.url, record.served_name, "Say yes.", max_tokens=4)
    assert answer.completion_tokens > 0
    os.killpg(os.getpgid(record.pid), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while procs.is_alive(record.pid, record.pid_create_time) and time.monotonic() < deadline:
        time.sleep(0.5)
    record = llmopt.get_endpoint("cli-ep")
    assert record.status == endpoints.FAILED
    assert "exited unexpectedly" in record.failure_reason
    listed = run_cli("endpoints", "list", "--status", "failed")
    assert "cli-ep" in listed.stdout
