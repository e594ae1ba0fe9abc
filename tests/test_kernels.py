"""llmopt's kernels against the vLLM kernels they stand in for: the small-batch linear kernel gives
vLLM's packed kernel's bits for every row count, bias or none, strided inputs, traced by
torch.compile; the prefill attention kernel agrees with vLLM's CPU attention within bf16's rounding
and is as close to exact attention; and the library's build failures are said in one line. The
engine tests serve every model through them where they are the engine's choice (test_endpoints
checks that the engine core loaded them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmopt.engine import kernels, platform, prefill_attention, small_batch_linear
from llmopt.errors import LlmoptError

HW = platform.detect()
runs_here = pytest.mark.skipif(not platform.llmopt_kernels_apply(HW), reason="needs AVX-512 BF16 and VNNI, no AMX")

SAME_BITS = """
import torch, vllm._C
from vllm import _custom_ops as ops
from llmopt.engine import kernels, small_batch_linear
vllms = ops.weight_packed_linear_cpu
checked = small_batch_linear.compare(kernels.build(), vllms)
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


AGREES = """
import vllm._C
from vllm import _custom_ops as ops
from llmopt.engine import kernels, prefill_attention
print(prefill_attention.compare(kernels.build(), ops.cpu_attention_with_kv_cache))
"""


@runs_here
def test_the_prefill_attention_agrees_with_vllms_and_with_exact_attention() -> None:
    """On every checked shape and mix of requests, no further from attention computed in float64
    than vLLM's kernel is (at the largest within 1.5x, on average within 2x); what it hands over, vLLM's bits."""
    done = subprocess.run([sys.executable, "-c", AGREES], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = len(prefill_attention.CHECKED_HEADS) * (len(prefill_attention.CHECKED_REQUESTS) + len(prefill_attention.HANDED_OVER))
    assert done.stdout.split()[-1] == str(calls)


def test_a_build_without_a_compiler_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(kernels, "library_path", lambda: tmp_path / "kernel.so")
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(LlmoptError, match="need a C.. compiler, and none was found -- install g.. .*set linear_kernels: packed and attention_kernel: vllm"):
        kernels.build()
    assert not (tmp_path / "kernel.so").exists()


def test_a_failed_build_leaves_nothing_and_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(kernels, "library_path", lambda: tmp_path / "kernels" / "kernel.so")
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(LlmoptError, match="building llmopt's CPU kernels failed"):
        kernels.build()
    assert list((tmp_path / "kernels").iterdir()) == []


def test_a_compiler_that_is_not_there_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(kernels, "library_path", lambda: tmp_path / "kernels" / "kernel.so")
    monkeypatch.setenv("CXX", "ccache no-such-compiler")  # a launcher and a compiler, as CXX may name
    with pytest.raises(LlmoptError, match="building llmopt's CPU kernels failed: .*ccache|no-such") as caught:
        kernels.build()
    assert "\n" not in str(caught.value) and "set linear_kernels: packed and attention_kernel: vllm" in str(caught.value)


@runs_here
def test_a_library_that_does_not_load_is_not_kept(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(kernels, "library_path", lambda: tmp_path / "kernels" / "kernel.so")
    monkeypatch.setenv("CXX", """sh -c 'eval out=\\${$#}; echo not-a-library > "$out"' cc""")  # "builds" a text file
    with pytest.raises(LlmoptError, match="CPU kernels' self-check failed: .*(ELF|header|OSError)") as caught:
        kernels.build()
    assert "\n" not in str(caught.value)
    assert list((tmp_path / "kernels").iterdir()) == []
