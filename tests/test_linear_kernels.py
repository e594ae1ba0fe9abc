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
runs_here = pytest.mark.skipif(not platform.small_batch_linear_applies(HW), reason="needs AVX-512 BF16 and VNNI, no AMX")

SAME_BITS = """
import torch, vllm._C
from vllm import _custom_ops as ops
from llmopt.engine import small_batch_linear
vllms = ops.weight_packed_linear_cpu
checked = small_batch_linear.compare(small_batch_linear.build(), vllms)
n, k = 576, 1536
packed = torch.ops._C.convert_weight_packed(torch.randn(n, k, dtype=torch.bfloat16))
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
    checked = len(small_batch_linear.CHECKED_SHAPES) * 2 * len(small_batch_linear.CHECKED_ROWS)
    assert done.stdout.split()[-1] == str(checked)


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


def test_a_compiler_that_is_not_there_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(small_batch_linear, "library_path", lambda: tmp_path / "kernels" / "kernel.so")
    monkeypatch.setenv("CXX", "ccache no-such-compiler")  # a launcher and a compiler, as CXX may name
    with pytest.raises(LlmoptError, match="building llmopt's small-batch linear kernel failed: .*ccache|no-such") as caught:
        small_batch_linear.build()
    assert "\n" not in str(caught.value) and "set linear_kernels: packed" in str(caught.value)


@runs_here
def test_a_library_that_does_not_load_is_not_kept(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(small_batch_linear, "library_path", lambda: tmp_path / "kernels" / "kernel.so")
    monkeypatch.setenv("CXX", """sh -c 'eval out=\\${$#}; echo not-a-library > "$out"' cc""")  # "builds" a text file
    with pytest.raises(LlmoptError, match="small-batch linear kernel's self-check failed: .*(ELF|header|OSError)") as caught:
        small_batch_linear.build()
    assert "\n" not in str(caught.value)
    assert list((tmp_path / "kernels").iterdir()) == []
