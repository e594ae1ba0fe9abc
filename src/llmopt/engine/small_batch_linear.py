"""llmopt's small-batch bf16 linear kernel (`small_batch_linear.cpp`): built once per environment
with the machine's C++ compiler against the installed torch, loaded into the engine core, and
called where vLLM calls its packed-weight kernel, on AVX-512 BF16 processors: up to 64 rows
without AMX; with AMX up to 4 (`kernels.AMX`), since vLLM's kernel multiplies 5 rows or more on
AMX tiles, and stays for them.

Without AMX, vLLM's packed kernel multiplies 5 rows or more through torch's brgemm at about the
fp32 rate (125 GFLOP/s on the project's AMD EPYC against 400 for a large bf16 product), so a
batch-8 decode step spent 17 of its 27 ms in its linear layers (`benchmarks/step_profile.py`).
This kernel shares each weight load among up to 8 rows, with AVX-512 BF16 dot products, and
gives the same bits as vLLM's (`compare`; speed: `benchmarks/linear_kernels.py`). It is
`EngineConfig.linear_kernels` 'llmopt': the default where it applies and llmopt's kernel library
is built (`kernels`); elsewhere, or without a compiler, vLLM's packed kernel alone (with AMX, vLLM's
own choice).
"""

from __future__ import annotations

from pathlib import Path

from llmopt.engine import kernels

ENV = "LLMOPT_SMALL_BATCH_LINEAR"  # "1": the engine core's packed bf16 layers call it
MAX_ROWS = kernels.LINEAR_MAX_ROWS
# Products a new build must give vLLM's bits for before it is kept: SmolLM2's and Qwen's layer
# shapes, a vocabulary-sized one, last blocks of 16 channels; every tile height and the hand-over.
CHECKED_SHAPES = ((576, 576), (960, 576), (576, 1536), (49152, 64), (592, 576), (80, 64))
CHECKED_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 40, MAX_ROWS, MAX_ROWS + 1)


def max_rows(path: str | Path) -> int:
    """The most rows the build at `path` multiplies itself."""
    return kernels.AMX_LINEAR_MAX_ROWS if kernels.library_of(path) is kernels.AMX else MAX_ROWS


def use(path: str | Path) -> None:
    """Have vLLM's packed bf16 layers call `torch.ops.llmopt.small_batch_linear` in this process.
    The op returns its output, where vLLM's writes into one it is given: a cold compile of a bf16
    model takes apart no writing op per linear layer (0.83x the start, `benchmarks/README.md`)."""
    import torch
    from vllm import _custom_ops as ops

    kernels.load(path)

    def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        output = torch.ops.llmopt.small_batch_linear(x.reshape(-1, x.size(-1)), packed_weight, bias, n)
        return output.reshape(*x.shape[0:-1], n)

    ops.weight_packed_linear_cpu = packed_linear  # looked up by name at every call, traced once


def compare(path: str | Path, vllms: object) -> int:
    """The products checked against vLLM's packed kernel `vllms` with the library at `path` loaded:
    every `CHECKED_SHAPES` with and without a bias at every `CHECKED_ROWS`, and rows strided as
    a slice of a fused output. Raises AssertionError on the first that differs."""
    import torch
    from vllm import _custom_ops as ops

    use(path)
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
