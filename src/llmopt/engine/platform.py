"""What the machine is, and the engine settings that matter on it.

On CPU, vLLM by default reserves one core for its front end; on a two-core machine that leaves one
core for the model, and decoding ran 1.6x faster with none reserved (shared/notes/engine-cpu.md).
It also wants tcmalloc and Intel OpenMP preloaded. And it runs the model in a worker process of its
own, which busy-waits against the engine-core process at every step: on two cores that contention
cost plain decoding 1.39x (benchmarks/engine_cpu_settings.py) and speculation more, so on small
machines the model runs inside the engine-core process instead. These are chosen here, from
the machine the model is served on; `vllm.environment` turns them into vLLM's environment.
"""

from __future__ import annotations

import os
import platform as std_platform
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from llmopt import names
from llmopt.engine import kernels

PACKED_LINEAR_ENV = "LLMOPT_PACKED_LINEAR"  # set: llmopt's server module gives linear layers vLLM's packed kernels
INDUCTOR_KERNELS_ENV = "LLMOPT_INDUCTOR_KERNELS"  # a folder: the server shares Inductor's compiled C++ kernels there
KERNEL_REUSED_LINE = "llmopt: Inductor's C++ kernel reused from an earlier compile"  # the server logs one a kernel
MODEL_INFOS_ENV = "LLMOPT_MODEL_INFOS"  # a folder: the server keeps vLLM's model-class facts there, for every entry
SHORT_WARM_UP_LINE = "llmopt: warm-up shortened, the compiled model was loaded"  # the server logs it when it was
SPAWNED_CORE_ENV = "LLMOPT_SPAWNED_ENGINE_CORE"  # set: its engine core is spawned, as vLLM's CPU platform does (benchmarks)
PIECEWISE_GRAPH_ENV = "LLMOPT_PIECEWISE_GRAPH"  # "1": the server compiles the model's graph piecewise on a CPU
VLLM_ATTENTION_CALLS_ENV = "LLMOPT_VLLM_ATTENTION_CALLS"  # "1": vLLM's attention methods, not `attention_calls` (benchmarks)
TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)


class Hardware(BaseModel):
    """The machine an engine runs or a model was built on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str  # "cpu" or "cuda"
    cpu_model: str
    cores: int
    memory_gib: float
    cpu_flags: tuple[str, ...]
    gpu: str | None
    gpu_count: int = 0
    # vendor, family and model numbers, e.g. 'AuthenticAMD family 26 model 2': a cloud VM's model name
    # ('AMD EPYC') is the same for every generation, and this project's machines went from one to the
    # next (Zen 4 to Zen 5) under it, with bf16 decode twice as fast. None in records made before it.
    cpu_signature: str | None = None

    @property
    def cpu_label(self) -> str:
        """The processor as tables name it: its model name, and its signature where known."""
        return f"{self.cpu_model} ({self.cpu_signature})" if self.cpu_signature else self.cpu_model

    @property
    def slug(self) -> str:
        """The machine in a file name, for facts learnt on it (its rates, its candidates' timings)."""
        return f"{names.slug(self.cpu_label, 'cpu')}-{self.cores}-cores"

    def differences(self, there: "Hardware") -> list[str]:
        """How `there`, a machine figures were measured on, differs from this one in what sets their
        speed: device, processor (its signature compared where both record one), cores and
        instruction sets. Empty where the figures tell what this machine does."""
        found = []
        if (there.device, there.gpu, there.gpu_count) != (self.device, self.gpu, self.gpu_count):
            found.append(f"{there.gpu_count} x {there.gpu} against {self.gpu_count} x {self.gpu}" if there.gpu or self.gpu
                         else f"{there.device} against {self.device}")
        signatures = {there.cpu_signature, self.cpu_signature} - {None}
        if there.cpu_model != self.cpu_model or len(signatures) > 1:
            found.append(f"{there.cpu_label} against this {self.cpu_label}")
        if there.cores != self.cores:
            found.append(f"{there.cores} cores against {self.cores}")
        only_here, only_there = set(self.cpu_flags) - set(there.cpu_flags), set(there.cpu_flags) - set(self.cpu_flags)
        if only_here:
            found.append(f"without {', '.join(sorted(only_here))}, which this one has")
        if only_there:
            found.append(f"with {', '.join(sorted(only_there))}, which this one lacks")
        return found

    @property
    def has_vnni(self) -> bool:
        """VNNI (AVX-512's, AVX's or AMX's int8), which sums int8 products in 32 bits: without it,
        oneDNN's int8 products sum in 16 and saturate (the compatibility matrix's SmoothQuant rows)."""
        return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(self.cpu_flags))

    @property
    def x86_without_avx512(self) -> bool:
        """An x86 CPU with AVX2 at most, where vLLM loads its AVX2 build: no bf16 matmul, no W4A16
        kernel, no FP8 KV cache (the defaults and the compatibility matrix follow it)."""
        return self.device == "cpu" and any(f.startswith("avx") for f in self.cpu_flags) and "avx512f" not in self.cpu_flags

    @property
    def has_amx(self) -> bool:
        """AMX tiles, which choose vLLM's CPU kernels (and llmopt's choice among them)."""
        return any(flag.startswith("amx") for flag in self.cpu_flags)


def detect() -> Hardware:
    import psutil

    flags, model, signature = _cpu_info()
    gpu, gpu_count = _gpus()
    return Hardware(
        device="cuda" if gpu else "cpu",
        cpu_model=model,
        cores=os.cpu_count() or 1,
        memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
        cpu_flags=tuple(sorted(f for f in flags if f.startswith(("avx", "amx")))),
        gpu=gpu,
        gpu_count=gpu_count,
        cpu_signature=signature,
    )


def _cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[set[str], str, str | None]:
    """The first processor's flags, model name and signature ('GenuineIntel family 6 model 143')."""
    flags: set[str] = set()
    model = std_platform.processor() or std_platform.machine()
    fields: dict[str, str] = {}
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if not key and fields:
                break  # the first processor's block ends
            fields.setdefault(key, value)
    if "flags" in fields:
        flags = set(fields["flags"].split())
    model = fields.get("model name", model)
    known = all(k in fields for k in ("vendor_id", "cpu family", "model"))
    signature = f"{fields['vendor_id']} family {fields['cpu family']} model {fields['model']}" if known else None
    return flags, model, signature


def _gpus() -> tuple[str | None, int]:
    """Name and count of CUDA devices; torch is asked only when a device node exists."""
    if not Path("/dev/nvidia0").exists():
        return None, 0
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0), torch.cuda.device_count()
    except Exception:
        pass
    return None, 0


def preload_libraries() -> list[str]:
    """tcmalloc (Debian's libtcmalloc-minimal4) and Intel OpenMP (the intel-openmp wheel), if present."""
    libs = [next((p for p in TCMALLOC_CANDIDATES if Path(p).exists()), None)]
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    libs.append(str(iomp) if iomp.exists() else None)
    return [lib for lib in libs if lib]


def default_reserved_cpus(hw: Hardware) -> int:
    """Reserve a core for the front end only when the machine has cores to spare."""
    return 0 if hw.cores <= 4 else 1


def default_executor(hw: Hardware) -> str:
    """The model in the engine-core process where cores are too few to give a worker process its own;
    on larger machines vLLM's worker process, which also pins threads to NUMA nodes."""
    return "uni" if hw.cores <= 4 else "mp"


def packed_linear_supported(hw: Hardware) -> bool:
    """vLLM's packed-weight linear kernels (`weight_packed_linear`, `int8_scaled_mm_with_quant`) are
    AVX-512 BF16 and VNNI code, with AMX tiles where the processor has them."""
    return {"avx512_bf16", "avx512_vnni"} <= set(hw.cpu_flags)


def llmopt_kernels_apply(hw: Hardware) -> bool:
    """Whether llmopt's AVX-512 library (`kernels.AVX512`) stands in for vLLM's kernels: on AVX-512
    BF16 without AMX, its small-batch linear kernels for the packed bf16 and int8 ones, its prefill
    attention for the `vec` path's. With AMX only its bf16 linear kernel runs, up to 4 rows, in a
    build of its own (`kernels.AMX`); vLLM's multiply on AMX tiles the rest (other bits)."""
    return packed_linear_supported(hw) and not hw.has_amx


def builds_kernels(hw: Hardware) -> bool:
    """Whether llmopt has a kernel library for this processor (`kernel_library`)."""
    return packed_linear_supported(hw) or avx2_int8_applies(hw)


def avx2_int8_applies(hw: Hardware) -> bool:
    """llmopt's AVX2 W8A8 kernel (`avx2_int8_linear`) serves int8 layers on x86 without AVX-512 nor
    VNNI, where oneDNN's int8 has no fast path."""
    return hw.x86_without_avx512 and "avx2" in hw.cpu_flags and not hw.has_vnni


def kernel_library(hw: Hardware) -> kernels.Library:
    """The build of llmopt's kernels for this processor."""
    if avx2_int8_applies(hw):
        return kernels.AVX2
    return kernels.AMX if hw.has_amx else kernels.AVX512


def default_linear_kernels(hw: Hardware) -> str:
    """Packed-weight kernels on AVX-512 BF16 and VNNI processors. vLLM takes them only where AMX is,
    and otherwise oneDNN, whose matrix-vector products stream cold weights at 10-25 GB/s on an AMD
    EPYC against the packed kernels' 21-33 (benchmarks/linear_kernels.py): SmolLM2-135M's bf16
    batch-1 decode ran 1.21x faster served with them, 1.48x in vLLM's offline API
    (benchmarks/engine_cpu_settings.py). With them, llmopt's small-batch kernel where it is built
    (`small_batch_linear`): vLLM's packed kernel multiplies 5 rows or more at about the fp32 rate
    there. With AMX, vLLM gives bf16 layers oneDNN, which streamed SmolLM2-135M's weights at 9.7
    GB/s at batch 1 (`benchmarks/step_profile.py`; the machine reads 18.8): there llmopt's AMX build
    of its small-batch kernel up to 4 rows, and vLLM's choice above (its packed kernel on AMX tiles
    for layers under 1 MiB, oneDNN for the others, which then hold their weights twice), where
    built, and vLLM's choice where not. On x86 without
    AVX-512 nor VNNI, llmopt's AVX2 kernels where they are built: its W8A8 one for int8 layers
    (oneDNN's int8 has no fast path there), and for float32 layers whose weights bf16 holds exactly
    its float32 one streaming them in bf16 (`avx2_bf16_linear`: SmolLM2-135M served 1.86x oneDNN's
    float32 at batch 1 and 1.79x at 8, `benchmarks/int8_weight_only.py`); where not built, torch's weight-only int8 kernel (`weight_only_int8_linear`) and oneDNN.
    AVX-VNNI processors (AVX2 with VNNI) keep vLLM's choice: not measured there."""
    if avx2_int8_applies(hw):
        return "llmopt" if kernels.built(kernels.AVX2) else "weight_only"
    if not packed_linear_supported(hw):
        return "vllm"
    if kernels.built(kernel_library(hw)):
        return "llmopt"
    return "vllm" if hw.has_amx else "packed"


def prefill_attention_applies(hw: Hardware) -> bool:
    """llmopt's prefill attention stands in for vLLM's `vec` path without AMX: in bf16 on AVX-512
    BF16 processors (`prefill_attention.cpp`), in float32 where its AVX2 library serves
    (`avx2_prefill_attention.cpp`)."""
    return llmopt_kernels_apply(hw) or avx2_int8_applies(hw)


def default_attention_kernel(hw: Hardware) -> str:
    """llmopt's prefill attention where it applies and is built: without AMX, vLLM's attention
    computes at the fp32 rate, a quarter to a third of a QA prompt's prefill on the project's Zen 5
    EPYC, and this kernel runs it about twice as fast; on Zen 3 (AVX2, float32) vLLM's took a
    quarter of an 884-token prefill at 54 GFLOP/s (`engine.prefill_attention`)."""
    return "llmopt" if prefill_attention_applies(hw) and kernels.built(kernel_library(hw)) else "vllm"


def default_dtype(hw: Hardware) -> str:
    """bfloat16 (vLLM's choice for a bf16 model), except on x86 processors without AVX-512: there
    vLLM's oneDNN refuses a bf16 matmul and torch's fallback multiplies at ~9.5 GFLOP/s whatever the
    batch on the project's Zen 3 EPYC (AVX2), against fp32's 19-85 (2x at one row, 9x at 512), so
    float32 serves faster despite streaming twice the bytes (benchmarks/README.md,
    "engine_cpu_settings.py"). AVX-512 without BF16 was not measured and keeps vLLM's choice."""
    return "float32" if hw.x86_without_avx512 else "bfloat16"


def default_graph_wrapper(hw: Hardware) -> str:
    """Inductor's C++ wrapper on CPUs with AVX-512: there vLLM runs its compiled graph as a Python
    function of about 300 kernel and op calls a decode step; from C++, SmolLM2-135M's bf16 decoded
    1.07-1.08x faster served at batch 1 in each of three alternating rounds on Zen 5. On x86 without
    AVX-512 (float32 there) the Python wrapper: on a Zen 3 EPYC the C++ one took 1.3 ms off a
    batch-1 step's graph offline, but served it read 1.09x at batch 8 for bf16 and 0.93x for
    SmoothQuant (each in every round), 0.95-0.97x at batch 1, and a cold compile took about 50 s
    longer (benchmarks/README.md, "engine_cpu_settings.py"). On GPUs vLLM replays CUDA graphs, and
    the Python wrapper stays."""
    return "cpp" if hw.device == "cpu" and not hw.x86_without_avx512 else "python"


def default_compiled_graph(hw: Hardware) -> str:
    """On a CPU, the whole graph, as vLLM's CPU platform compiles it. Piecewise (vLLM's way on GPUs,
    kept on a CPU by llmopt's server module) halves a cold compile of SmolLM2-135M (45-52 s against
    85-112 on a Zen 3 EPYC, 40-49 against 94 on a Zen 4: a layer's pieces compile once), but served
    its steps are longer: on Zen 3 SmoothQuant's time between tokens at c=1 rose 0.5-4.2 ms in each
    of three alternating rounds (0.91x the tokens/s; bf16 within the noise), on Zen 4, with
    Inductor's C++ wrapper, bf16 decoded at 0.73x at c=1 and 0.77x at c=8, behind in every round,
    where offline its steps were only 0.3-1.1 ms longer (benchmarks/README.md,
    "piecewise_compile.py"). A start compiles once an entry, a deployment decodes for hours:
    piecewise is a setting, for compile-bound work."""
    return "whole"


def kernels_build(hw: Hardware) -> str:
    """The default kernels here down to the build of llmopt's library, and how the compiled graph
    calls them: what a measurement depends on, where the kernels' names alone would let a rebuilt
    library (or the other graph wrapper) reuse older figures."""
    chosen = f"{default_linear_kernels(hw)}+{default_attention_kernel(hw)}"
    built = f"{chosen}:{kernels.library_path(kernel_library(hw)).stem}" if "llmopt" in chosen else chosen
    return f"{built} {default_graph_wrapper(hw)}-wrapper"


def torch_version() -> str:
    """The installed torch, read from its metadata (importing torch takes seconds)."""
    import importlib.metadata as md

    return md.version("torch")
