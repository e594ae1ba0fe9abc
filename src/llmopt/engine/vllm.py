"""vLLM itself: its command line and environment rendered from typed settings, its server as a
subprocess (start, readiness, stop), and what its log says.

The server runs in a session of its own, writing to a log file, so it outlives the command that
started it (`llmopt deploy` returns while the endpoint keeps serving) and can be stopped with all
of its children from any later process.
"""

from __future__ import annotations

import errno
import importlib.metadata as md
import ipaddress
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llmopt import paths, procs
from llmopt.engine import (avx2_bf16_linear, avx2_int8_linear, guard, kernels, platform, prefill_attention,
                           small_batch_linear, weight_only_int8_linear, zygote)
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOCAL_SERVER_MODULE = "llmopt.engine.serve"  # the same server, able to load its saved compiled model
DEFAULT_HOST = "127.0.0.1"
LOG_TAIL_LINES = 25
CPU_ATTENTION_FILE = "vllm/v1/attention/backends/cpu_attn.py"
ARTIFACT_RELATIVE = "./"  # a path in settings that lies inside the artifact being served
KERNEL_LINE = re.compile(r"(?:Selected|Using) (\w+Kernel) for (\w+)$", re.MULTILINE)
CHUNK_BUDGET_LINE = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")
FATAL_LINE = "EngineCore encountered a fatal error"
RAISED_LINE = re.compile(r"^\(EngineCore[^)]*\) ERROR [^\]]*\] ((?:[\w.]+(?:Error|Exception)): .*)$", re.MULTILINE)
LOG_TIME = re.compile(r"^\((?:APIServer|EngineCore|Worker)[^)]*\) [A-Z]+ (\d\d-\d\d \d\d:\d\d:\d\d) ", re.MULTILINE)
# A start's phases, each ending at the first log line that matches (the last one ends at ready).
START_PHASES = (
    ("server process and imports", re.compile(r"^\(APIServer")),
    ("engine-core process and imports", re.compile(r"Initializing a V1 LLM engine")),
    ("model and weights", re.compile(r"Warming up model for the compilation")),
    ("warm-up: trace and compile, or load compiled; profile run", re.compile(r"Warming up done")),
    ("KV cache, server up", None),
)
# Every flag llmopt renders, by the setting it comes from. Nothing else reaches vLLM's command line.
FLAGS = {
    "served_name": "--served-model-name",
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "seed": "--seed",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "stream_interval": "--stream-interval",
    "kv_cache_dtype": "--kv-cache-dtype",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "tensor_parallel_size": "--tensor-parallel-size",
    "speculative": "--speculative-config",
    "compilation": "--compilation-config",
    "trust_remote_code": "--trust-remote-code",
    "chat_template": "--chat-template",
    "guard": "--middleware",
}
GUARD = "llmopt.engine.guard.Guard"  # every route behind the API key, not only vLLM's /v1
# vLLM's published server images, by device; the tag is the engine version ("v0.32.0").
IMAGES = {"cpu": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo", "cuda": "vllm/vllm-openai"}
IMAGE_PYTHON = "python3"


def engine_name_version() -> tuple[str, str]:
    """The installed engine distribution: `vllm-cpu` on CPU machines, `vllm` on GPU ones."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    raise LlmoptError("vLLM is not installed", "run `bash scripts/install.sh` (CPU) or `pip install -e .[gpu]`")


def relative(path: Path, root: Path) -> str:
    """How settings name a file inside an artifact, wherever the artifact is later moved."""
    return ARTIFACT_RELATIVE + path.relative_to(root).as_posix()


def located(config: EngineConfig, root: Path) -> EngineConfig:
    """Settings with the artifact-relative paths in them resolved against where the artifact lies."""
    spec = config.speculative
    if spec is None or not spec.model or not spec.model.startswith(ARTIFACT_RELATIVE):
        return config
    draft = root / spec.model[len(ARTIFACT_RELATIVE):]
    return config.model_copy(update={"speculative": spec.model_copy(update={"model": str(draft)})})


def speculative_config(config: EngineConfig) -> dict[str, object] | None:
    """vLLM's --speculative-config JSON for the typed settings."""
    spec = config.speculative
    if spec is None:
        return None
    rendered: dict[str, object] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method == "draft_model":
        rendered["model"] = spec.model
    else:
        rendered.update(prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)
    if spec.schedule:
        rendered["num_speculative_tokens_per_batch_size"] = [[b.first, b.last, b.tokens] for b in spec.schedule]
    return rendered


def _values(config: EngineConfig, served_name: str | None, trust_remote_code: bool, chat_template: str | None,
            guarded: bool, hw: platform.Hardware | None) -> dict[str, object]:
    """Each flag's value for the settings (None or False: left out), in a stable order. GPU settings
    only where the model is served on one, and the graph's wrapper as chosen there (this machine
    when `hw` is None, detected only when a setting depends on it)."""
    on_gpu = config.gpu_memory_utilization is not None and (hw or platform.detect()).device != "cpu"
    return {
        "served_name": served_name,
        "dtype": dtype(config, hw),
        "max_model_len": config.max_model_len,
        "seed": config.seed,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "stream_interval": config.stream_interval if config.stream_interval != 1 else None,
        "kv_cache_dtype": config.kv_cache_dtype,
        "gpu_memory_utilization": config.gpu_memory_utilization if on_gpu else None,
        "tensor_parallel_size": config.tensor_parallel_size if config.tensor_parallel_size != 1 else None,
        "speculative": speculative_config(config),
        "compilation": _compilation(config, hw),
        "trust_remote_code": trust_remote_code,
        "chat_template": chat_template,
        "guard": GUARD if guarded else None,
    }


def _compilation(config: EngineConfig, hw: platform.Hardware | None) -> dict[str, object] | None:
    """vLLM's --compilation-config for the settings: eager, or Inductor's C++ wrapper where chosen."""
    if config.compilation.mode == "eager":
        return {"mode": 0}
    if graph_wrapper(config, hw) == "cpp":
        return {"inductor_compile_config": {"cpp_wrapper": True}}
    return None


def dtype(config: EngineConfig, hw: platform.Hardware | None) -> str:
    """The activations' dtype on the machine `hw` (this one when None, detected unless the settings
    name a dtype)."""
    return config.dtype or platform.default_dtype(hw or platform.detect())


def holds_bf16_weights(config: EngineConfig, hw: platform.Hardware | None) -> bool:
    """Whether unquantized layers stream bf16 weights though the activations are float32: llmopt's
    AVX2 float32 kernel (`avx2_bf16_linear`) on the machine `hw` (this one when None)."""
    hw = hw or platform.detect()
    return (platform.avx2_int8_applies(hw) and dtype(config, hw) == "float32"
            and (config.linear_kernels or platform.default_linear_kernels(hw)) == "llmopt")


def graph_wrapper(config: EngineConfig, hw: platform.Hardware | None) -> str | None:
    """How the compiled graph calls its kernels on the machine `hw` (this one when None, detected
    only if the choice depends on it); None when the model runs eagerly."""
    if config.compilation.mode == "eager":
        return None
    if config.compilation.wrapper == "python":
        return "python"
    hw = hw or platform.detect()
    chosen = config.compilation.wrapper or platform.default_graph_wrapper(hw)
    if chosen == "cpp" and hw.device != "cpu":
        raise LlmoptError(f"compilation wrapper 'cpp' is for CPUs, and this machine serves on {hw.gpu or hw.device}",
                          "leave compilation.wrapper unset (vLLM replays CUDA graphs there) or set it to 'python'")
    return chosen


def compiled_graph(config: EngineConfig, hw: platform.Hardware | None) -> str | None:
    """What Inductor compiles on the machine `hw` (this one when None, detected only if the choice
    depends on it): the whole graph or its pieces; None when the model runs eagerly."""
    if config.compilation.mode == "eager":
        return None
    hw = hw or platform.detect()
    if hw.device != "cpu":
        if config.compilation.graph == "whole":
            raise LlmoptError(f"compilation graph 'whole' is for CPUs, and this machine serves on {hw.gpu or hw.device}",
                              "leave compilation.graph unset (vLLM compiles piecewise there)")
        return "piecewise"
    return config.compilation.graph or platform.default_compiled_graph(hw)


def _block_fp8(model_path: str | Path) -> bool:
    """Whether the checkpoint's config.json declares block-wise FP8 weights (compressed-tensors)."""
    try:
        quant = json.loads((Path(model_path) / "config.json").read_text()).get("quantization_config")
        groups = quant.get("config_groups") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return any(isinstance(g, dict) and isinstance(g.get("weights"), dict) and g["weights"].get("type") == "float"
               and g["weights"].get("strategy") == "block" for g in groups.values())


def for_checkpoint(config: EngineConfig, model_path: str | Path, hw: platform.Hardware) -> EngineConfig:
    """The settings as this checkpoint runs here. vLLM 0.32's CPU FP8 kernel (`fp8_scaled_mm_cpu`)
    declares its block size `SymInt[]` but reads a list of plain ints: Inductor's C++ wrapper hands it
    SymInts and the first forward fails ("isIntList() INTERNAL ASSERT FAILED ... Expected IntList but
    got GenericList", seen on an Intel Xeon with AMX), so block-FP8 weights on a CPU run the graph
    from the Python wrapper, which passes ints."""
    if hw.device != "cpu" or graph_wrapper(config, hw) != "cpp" or not _block_fp8(model_path):
        return config
    if config.compilation.wrapper == "cpp":
        raise LlmoptError("compilation wrapper 'cpp' cannot run block-FP8 weights on a CPU: vLLM's FP8 kernel rejects "
                          "the block size Inductor's C++ wrapper passes it", "leave compilation.wrapper unset, or set it to 'python'")
    return config.model_copy(update={"compilation": config.compilation.model_copy(update={"wrapper": "python"})})


def flags(config: EngineConfig, served_name: str, trust_remote_code: bool = False, chat_template: str | None = None,
          guarded: bool = False, hw: platform.Hardware | None = None) -> list[str]:
    """vLLM server flags for the settings, in a stable order, on the machine `hw` (this one when None)."""
    argv: list[str] = []
    for name, value in _values(config, served_name, trust_remote_code, chat_template, guarded, hw).items():
        if value is None or value is False:
            continue
        if value is True:
            argv.append(FLAGS[name])
        else:
            argv += [FLAGS[name], json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return argv


def engine_kwargs(config: EngineConfig, hw: platform.Hardware | None = None) -> dict[str, object]:
    """The settings as vLLM's engine arguments (`EngineArgs` fields, what Ray Serve LLM's `engine_kwargs`
    takes): the values `flags` renders, without the served name and the server's own options."""
    values = _values(config, None, False, None, False, hw)
    return {FLAGS[name].removeprefix("--").replace("-", "_"): value for name, value in values.items()
            if value is not None and value is not False}


def environment(config: EngineConfig, hw: platform.Hardware) -> dict[str, str]:
    """The environment vLLM needs on this machine, for these settings. None on a GPU: its CPU knobs (KV
    cache space, reserved cores, preloaded allocator and OpenMP, threads) would only get in the way."""
    if hw.device != "cpu":
        return {}
    reserved = platform.default_reserved_cpus(hw) if config.reserved_cpus is None else config.reserved_cpus
    env = {"VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved)}
    linear, attention = linear_kernels(config, hw), attention_kernel(config, hw)
    avx2 = platform.avx2_int8_applies(hw)
    if linear in ("packed", "llmopt") and not avx2:
        env[platform.PACKED_LINEAR_ENV] = "1"
    if linear == "llmopt":
        env.update(dict.fromkeys((avx2_int8_linear.ENV, avx2_bf16_linear.ENV) if avx2 else (small_batch_linear.ENV,), "1"))
    if linear == "weight_only":
        env[weight_only_int8_linear.ENV] = "1"
    if attention == "llmopt":
        env[prefill_attention.ENV] = "1"
    if graph_wrapper(config, hw) == "cpp":
        # Inductor's C++ wrapper passes no Python object to an op: vLLM's opaque layer names become strings
        env["VLLM_USE_LAYERNAME"] = "0"
    if compiled_graph(config, hw) == "piecewise":  # llmopt's server module keeps vLLM's piecewise compile on a CPU
        env[platform.PIECEWISE_GRAPH_ENV] = "1"
    if "llmopt" in (linear, attention):  # built here if it is not yet, so a failed build is said before any engine starts
        env[kernels.LIBRARY_ENV] = str(kernels.build(platform.kernel_library(hw)))
    libraries = platform.preload_libraries() if config.preload else []
    if libraries:
        env["LD_PRELOAD"] = ":".join(libraries)
    executor = config.executor if config.tensor_parallel_size == 1 else "mp"
    if (executor or platform.default_executor(hw)) == "uni":
        # vLLM's CPU platform switches to its worker-process executor unless multiprocessing is off;
        # the API server still runs the engine core in a process of its own. Without that worker,
        # vLLM no longer sets OpenMP's threads, so they are set as it would, minus the core pinning:
        # KMP_AFFINITY in the server's environment pins the API server's main thread when it imports
        # torch, and every thread and process it starts after (the engine core, the model's threads)
        # inherits that one core (0.21x of unpinned at batch 1); pinning only the model's main thread
        # did not pay on two cores, nor did a longer KMP_BLOCKTIME (benchmarks/engine_cpu_settings.py).
        env |= {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": str(max(1, hw.cores - reserved)),
            "KMP_BLOCKTIME": "5",
        }
    return env


def linear_kernels(config: EngineConfig, hw: platform.Hardware) -> str:
    """The linear kernels an engine runs with on this machine; 'packed' where they cannot run is refused."""
    chosen = config.linear_kernels or platform.default_linear_kernels(hw)
    if chosen == "llmopt" and platform.avx2_int8_applies(hw):
        return chosen
    if chosen in ("packed", "llmopt") and not platform.packed_linear_supported(hw):
        raise LlmoptError(f"linear_kernels '{chosen}' needs AVX-512 BF16 and VNNI, which this {hw.cpu_model} lacks",
                          "leave linear_kernels unset or set it to 'vllm'")
    return chosen


def attention_kernel(config: EngineConfig, hw: platform.Hardware) -> str:
    """The attention kernel an engine runs with on this machine; llmopt's where it cannot run is refused."""
    chosen = config.attention_kernel or platform.default_attention_kernel(hw)
    if chosen == "llmopt" and not platform.prefill_attention_applies(hw):
        raise LlmoptError(f"attention_kernel 'llmopt' runs on AVX-512 BF16 without AMX or on AVX2 without AVX-512 and VNNI, "
                          f"and this {hw.cpu_model} {'has AMX' if hw.has_amx else 'is neither'}",
                          "leave attention_kernel unset or set it to 'vllm'")
    return chosen


def plain_environment(config: EngineConfig, hw: platform.Hardware) -> dict[str, str]:
    """The environment of plain vLLM's server for these settings: as `environment`, without the
    switches only llmopt's server module reads (its kernels, a piecewise graph on a CPU)."""
    whole = config.compilation.model_copy(update={"graph": "whole"}) if hw.device == "cpu" else config.compilation
    return environment(config.model_copy(update={"linear_kernels": "vllm", "attention_kernel": "vllm", "compilation": whole}), hw)


def image_environment(config: EngineConfig, hw: platform.Hardware) -> dict[str, str]:
    """The environment in vLLM's own image (`image`) on the machine `hw` describes: as
    `plain_environment`, but with the image's preloads (vLLM's CPU image preloads tcmalloc and
    Intel OpenMP itself), never library paths found on this machine."""
    return plain_environment(config.model_copy(update={"preload": False}), hw)


def image(version: str, device: str) -> str:
    """vLLM's published server image for an engine version (the one an artifact was built and measured with)."""
    return f"{IMAGES['cpu' if device == 'cpu' else 'cuda']}:v{version}"


def server_command(python: str = sys.executable, module: str = SERVER_MODULE) -> list[str]:
    """The program that serves: vLLM's OpenAI server module (vllm-cpu's `vllm` command fails at once),
    or llmopt's start of it (`LOCAL_SERVER_MODULE`) where the compile cache's environment is set."""
    return [python, "-m", module]


def server_args(model_path: str, config: EngineConfig, served_name: str, host: str, port: int,
                trust_remote_code: bool = False, chat_template: str | None = None, guarded: bool = False,
                hw: platform.Hardware | None = None) -> list[str]:
    """The server's arguments: what to serve, where to listen, and the flags for the settings."""
    return ["--model", model_path, "--host", host, "--port", str(port),
            *flags(config, served_name, trust_remote_code, chat_template, guarded, hw)]


def server_argv(model_path: str, config: EngineConfig, served_name: str, host: str, port: int,
                trust_remote_code: bool = False, chat_template: str | None = None, guarded: bool = False,
                hw: platform.Hardware | None = None, module: str = SERVER_MODULE) -> list[str]:
    """The full command that serves `model_path`; `guarded` puts every route behind the API key
    the server finds in its environment (`secret_env`)."""
    return [*server_command(module=module), *server_args(model_path, config, served_name, host, port, trust_remote_code,
                                            chat_template, guarded, hw)]


def chat_env(has_chat_template: bool) -> dict[str, str]:
    """For a model with no chat template: the guard answers chat requests with what to do."""
    return {} if has_chat_template else {guard.NO_CHAT_ENV: "1"}


def secret_env(api_key: str | None) -> dict[str, str]:
    """How the API key reaches the server: in its environment, never on a command line or in a log."""
    return {guard.API_KEY_ENV: api_key} if api_key else {}


def check_address(host: str, port: int | None) -> None:
    """An address to bind: an IP address or a name that resolves, and a port from 1 to 65535."""
    if port is not None and not 0 < port < 65536:
        raise LlmoptError(f"port {port} is not a TCP port", "pass a port from 1 to 65535, or omit --port to pick a free one")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError, ValueError):
        raise LlmoptError(f"host '{host}' is not an address this machine can bind", "pass an IP address such as 127.0.0.1") from None


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, ValueError):
        return False


def shell_command(argv: list[str], env: dict[str, str]) -> str:
    """A copy-pasteable command line: the environment assignments, then the server command."""
    assignments = [f"{shlex.quote(k)}={shlex.quote(v)}" for k, v in sorted(env.items())]
    return " ".join([*assignments, *(shlex.quote(a) for a in ["python", *argv[1:]])])


def attention_head_sizes(hw: platform.Hardware) -> list[int] | None:
    """The head sizes vLLM's attention takes on this device; None where llmopt knows no limit. On
    CPU an unsupported one passes the engine's start and kills it at the first request.

    Asking vLLM means importing its attention backend, about 9 s on two cores, before every job
    and deploy; the answer is kept in the llmopt home instead, under the engine's version and the
    backend file's size and modification time (a rebuilt engine of the same version asks again)."""
    if hw.device != "cpu":
        return None
    dist, version = engine_name_version()
    backend = Path(md.distribution(dist).locate_file(CPU_ATTENTION_FILE))
    try:
        found = backend.stat()
        stamp = f"{found.st_size}-{found.st_mtime_ns}"
    except OSError:
        stamp = "unknown"
    kept = paths.engine_fact(f"{dist}-{version}-{stamp}-cpu-attention-head-sizes.json")
    try:
        sizes = [int(size) for size in json.loads(kept.read_text())]
        if sizes:
            return sizes
    except (OSError, ValueError, TypeError):
        pass
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = [int(size) for size in CPUAttentionBackend.get_supported_head_sizes()]
    paths.keep_fact(kept, json.dumps(sizes))
    return sizes


def logged_linear_kernels(log_text: str) -> dict[str, str]:
    """The linear kernel vLLM chose per layer type, from its log."""
    return {layer: kernel for kernel, layer in KERNEL_LINE.findall(log_text)}


def chunked_prefill_budget(log_text: str) -> int | None:
    """The tokens per step vLLM says it schedules with chunked prefill, from its log."""
    found = CHUNK_BUDGET_LINE.findall(log_text)
    return int(found[-1]) if found else None


def start_phases(log_text: str, started_at: float, ready_seconds: float) -> dict[str, float]:
    """Where an engine start's seconds went, from the server's log (vLLM stamps its lines to the
    second, so each phase is good to about a second; with vLLM's worker processes their lines
    count too). Phases whose line is not in the log (a GPU start has no CPU warm-up) are left
    out; their time goes to the next phase found."""
    year = time.localtime(started_at).tm_year
    log_text = _this_start(log_text)
    stamped = [(m.group(1), _line_at(log_text, m.start())) for m in LOG_TIME.finditer(log_text)]
    phases: dict[str, float] = {}
    previous = end = started_at
    for name, pattern in START_PHASES:
        if pattern is None:
            end = started_at + ready_seconds
        else:
            stamp = next((stamp for stamp, line in stamped if pattern.search(line)), None)
            try:
                end = time.mktime(time.strptime(f"{year}-{stamp}", "%Y-%m-%d %H:%M:%S"))
            except ValueError:  # no such line, or not a time
                continue
        end = min(max(end, previous), started_at + ready_seconds)
        phases[name] = round(end - previous, 1)
        previous = end
    return phases


def kernels_reused(log_text: str) -> int:
    """How many of Inductor's C++ kernels an engine start copied from earlier compiles rather than
    built (`engine/serve.py`), from the server's log."""
    return _this_start(log_text).count(platform.KERNEL_REUSED_LINE)


def _this_start(log_text: str) -> str:
    """The last start's part of a log that starts append to."""
    return log_text[log_text.rfind("\n$ ") + 1:]


def _line_at(text: str, start: int) -> str:
    end = text.find("\n", start)
    return text[start:] if end < 0 else text[start:end]


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LlmoptError(
                    f"port {port} on {host} is already in use", "pass another --port, or omit it to pick a free one"
                ) from exc
            raise LlmoptError(f"cannot bind {host}:{port} ({exc.strerror})", "pass another --host or --port") from exc


@dataclass
class ServerProcess:
    """A started vLLM server: its pid, where it listens, and where it logs."""

    pid: int
    create_time: float
    host: str
    port: int
    log_path: Path
    popen: subprocess.Popen | None = field(default=None, repr=False)
    sockets: Path | None = None  # the folder of its ZeroMQ sockets (`socket_folder`)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            return False
        return procs.is_alive(self.pid, self.create_time)

    def wait_ready(self, timeout_s: float, headers: dict[str, str] | None = None) -> float:
        """Poll /health until it answers 200. Returns the seconds waited."""
        start = time.monotonic()
        with httpx.Client(timeout=5, headers=headers) as client:
            while time.monotonic() - start < timeout_s:
                if not self.alive():
                    raise LlmoptError(
                        f"the engine exited before it was ready; last log lines:\n{log_tail(self.log_path)}",
                        f"read the full log at {self.log_path}",
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return time.monotonic() - start
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        raise LlmoptError(
            f"the engine was not ready after {timeout_s:.0f} s; last log lines:\n{log_tail(self.log_path)}",
            f"raise the timeout (--timeout) or read {self.log_path}",
        )

    def stop(self, grace_s: float = 20.0) -> None:
        if os.getpgid(0) == _pgid(self.pid):  # started in our group (a job's engine): not the group, only it
            procs.stop_tree(self.pid, self.create_time, grace_s)
        else:
            procs.stop_group(self.pid, self.create_time, grace_s)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)


def start_server(argv: list[str], env: dict[str, str], log_path: Path, host: str, port: int,
                 own_session: bool = True, secret_env: dict[str, str] | None = None,
                 dies_with_caller: bool = False) -> ServerProcess:
    """Start the server. With `own_session=False` it stays in the caller's process group, so
    stopping the caller (a job's worker) stops the engine too; `dies_with_caller` stops it when the
    caller dies, however it dies (a server deployed for one run). `secret_env` reaches the process
    but not its log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sockets = socket_folder()
    full_env = {**os.environ, **env, SOCKETS_ENV: str(sockets), **(secret_env or {})}
    with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
        log.write(f"$ {shell_command(argv, env)}\n".encode())
        log.flush()
        pid = zygote.start(argv, full_env, log_path, own_session, dies_with_caller) if zygote.forks(argv) else None
        popen = None if pid is not None else subprocess.Popen(
            procs.dying_with_caller(argv) if dies_with_caller else argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=own_session,
        )
    pid = pid if popen is None else popen.pid
    server = ServerProcess(pid, procs.create_time(pid), host, port, log_path, popen, sockets)
    (sockets / SOCKETS_OWNER).write_text(f"{server.pid} {server.create_time}")
    return server


SOCKETS_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM's API server and engine core make their ZeroMQ sockets
SOCKETS_PREFIX, SOCKETS_OWNER = "llmopt-sockets-", "server"
SOCKETS_UNCLAIMED_S = 600.0  # a folder with no owner yet is a start under way, for this long


def socket_folder() -> Path:
    """A folder of its own for a server's ZeroMQ sockets. vLLM makes them in the temporary folder,
    named by UUID, and a server stopped by a signal leaves them there: three a start, about 2,700
    over a few days of this project's tests. The folders of servers no longer running go first."""
    sweep_socket_folders()
    return Path(tempfile.mkdtemp(prefix=SOCKETS_PREFIX))


def sweep_socket_folders() -> None:
    """Remove the socket folders whose server has exited (its pid and start time are recorded in the
    folder); another user's, unreadable, are left alone."""
    for folder in Path(tempfile.gettempdir()).glob(SOCKETS_PREFIX + "*"):
        try:
            pid, created = (folder / SOCKETS_OWNER).read_text().split()
            gone = not procs.is_alive(int(pid), float(created))
        except FileNotFoundError:
            gone = folder.is_dir() and time.time() - folder.stat().st_mtime > SOCKETS_UNCLAIMED_S
        except (OSError, ValueError):
            continue
        if gone:
            shutil.rmtree(folder, ignore_errors=True)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def engine_failure(path: Path) -> str | None:
    """The exception that killed the engine core, from the last start's part of its log
    ("EngineCore encountered a fatal error" and the traceback's last line), or None while it has
    not died."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    text = text[text.rfind("\n$ ") + 1:]  # earlier starts appended to the same log
    start = text.rfind(FATAL_LINE)
    if start < 0:
        return None
    raised = [m.group(1) for m in RAISED_LINE.finditer(text, start)]
    return raised[0].strip() if raised else "no exception in its log"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text[-lines:])
