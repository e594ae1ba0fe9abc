"""llmopt's small-batch bf16 linear kernel (`small_batch_linear.cpp`): built once per environment
with the machine's C++ compiler against the installed torch, loaded into the engine core, and
called where vLLM calls its packed-weight kernel.

Without AMX, vLLM's packed kernel multiplies 5 rows or more through torch's brgemm at about the
fp32 rate (125 GFLOP/s on the project's AMD EPYC against 400 for a large bf16 product), so a
batch-8 decode step spent 17 of its 27 ms in its linear layers (`benchmarks/step_profile.py`).
This kernel shares each weight load among up to 8 rows, with AVX-512 BF16 dot products, and
gives the same bits as vLLM's (`benchmarks/linear_kernels.py`). It is `EngineConfig.linear_kernels`
'llmopt': the default where the packed kernels are and the library is built (`scripts/install.sh`
builds it); elsewhere, or without a compiler, vLLM's packed kernel alone.

The build is direct: one g++ command over torch's headers and libraries, found without importing
torch, into the environment's `lib/llmopt-kernels/`, named by the source's hash and torch's
version, so a changed source or torch builds anew and a deploy can tell cheaply whether it exists.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from llmopt.errors import LlmoptError

SOURCE = Path(__file__).with_name("small_batch_linear.cpp")
LIBRARY_ENV = "LLMOPT_SMALL_BATCH_LINEAR"  # the built library's path: the engine core loads it
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
         "-D_GLIBCXX_USE_CXX11_ABI=1")


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return Path(sys.prefix) / "lib" / "llmopt-kernels" / f"small_batch_linear-{digest}-torch{md.version('torch')}.so"


def built() -> bool:
    return library_path().is_file()


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise LlmoptError("torch is not installed", "run `bash scripts/install.sh`")
    return Path(next(iter(spec.submodule_search_locations)))


def build() -> Path:
    """The built library, compiled now if it is not there yet (about 30 s on two cores)."""
    target = library_path()
    if target.is_file():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise LlmoptError("llmopt's small-batch linear kernel needs a C++ compiler, and none was found",
                          "install g++ (Debian: apt-get install g++), or set linear_kernels: packed")
    torch_dir = _torch_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        done = subprocess.run([compiler, *FLAGS, f"-I{torch_dir / 'include'}",
                               f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", str(SOURCE),
                               f"-L{torch_dir / 'lib'}", "-ltorch", "-ltorch_cpu", "-lc10",
                               f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(partial)],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise LlmoptError(f"building llmopt's small-batch linear kernel failed: {done.stderr.strip()[-400:]}",
                              "set linear_kernels: packed, or report the compiler's message")
        os.replace(partial, target)  # whole or not at all, whoever else builds it at the same time
    for stale in target.parent.glob("small_batch_linear-*.so"):  # other sources or torch versions
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def load(path: str | Path) -> None:
    """Register `torch.ops.llmopt.small_batch_linear` in this process, with the shape function
    torch.compile traces it by, and have vLLM's packed bf16 layers call it."""
    import torch
    from vllm import _custom_ops as ops

    torch.ops.load_library(str(path))

    @torch.library.register_fake("llmopt::small_batch_linear")
    def _traced(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        return None

    def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        output = torch.empty((*x.shape[0:-1], n), dtype=x.dtype)
        torch.ops.llmopt.small_batch_linear(output.reshape(-1, n), x.reshape(-1, x.size(-1)), packed_weight, bias)
        return output

    ops.weight_packed_linear_cpu = packed_linear  # looked up by name at every call, traced once
