"""llmopt's small-batch linear kernel against vLLM's packed-weight kernel, which it stands in for:
the same bits for every row count, bias or none, strided inputs, traced by torch.compile; and
its build's failures said in one line. The engine tests serve every model through it where it is
the engine's choice (test_endpoints checks that the engine core loaded it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmopt.engine import platform, small_batch_linear
from llmopt.errors import LlmoptError

HW = platform.detect()
runs_here = pytest.mark.skipif(not platform.packed_linear_supported(HW), reason="needs AVX-512 BF16 and VNNI")

SAME_BITS = """
import torch, vllm._C
from vllm import _custom_ops as ops
from llmopt.engine import small_batch_linear
vllms = ops.weight_packed_linear_cpu
small_batch_linear.load(small_batch_linear.build())
torch.manual_seed(0)
checked = 0
for n, k in ((576, 576), (960, 576), (576, 1536), (49152, 64), (592, 576), (80, 64)):  # 592, 80: a last block of 16
    w = torch.randn(n, k, dtype=torch.bfloat16)
    packed = torch.ops._C.convert_weight_packed(w)
    for bias in (None, torch.randn(n, dtype=torch.float32)):
        for m in (1, 2, 4, 5, 8, 9, 16, 17, 40):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            assert torch.equal(vllms(x, packed, n, bias), ops.weight_packed_linear_cpu(x, packed, n, bias)), (n, k, m)
            checked += 1
    wide = torch.randn(8, k + 64, dtype=torch.bfloat16)[:, :k]  # rows strided, as a slice of a fused output
    assert torch.equal(vllms(wide, packed, n, None), ops.weight_packed_linear_cpu(wide, packed, n, None))
traced = torch.compile(lambda x: ops.weight_packed_linear_cpu(x, packed, n, None), dynamic=True)
for m in (3, 6, 12):
    x = torch.randn(m, k, dtype=torch.bfloat16)
    assert torch.equal(traced(x), vllms(x, packed, n, None))
print(checked)
"""


@runs_here
def test_the_kernel_gives_vllms_bits_at_every_batch() -> None:
    done = subprocess.run([sys.executable, "-c", SAME_BITS], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == str(6 * 2 * 9)


def test_a_build_without_a_compiler_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(small_batch_linear, "library_path", lambda: tmp_path / "kernel.so")
    monkeypatch.setattr(small_batch_linear.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(LlmoptError, match="needs a C.. compiler, and none was found -- install g.. .*set linear_kernels: packed"):
        small_batch_linear.build()
    assert not (tmp_path / "kernel.so").exists()


def test_a_failed_build_leaves_nothing_and_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(small_batch_linear, "library_path", lambda: tmp_path / "kernels" / "kernel.so")
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(LlmoptError, match="building llmopt's small-batch linear kernel failed"):
        small_batch_linear.build()
    assert list((tmp_path / "kernels").iterdir()) == []
