"""llmopt's kernels against the vLLM kernels they stand in for: the small-batch linear kernels, bf16
and int8, give vLLM's packed kernels' bits for every row count, bias or none, strided inputs,
traced by torch.compile; the prefill attention kernel agrees with vLLM's CPU attention within bf16's rounding
and is as close to exact attention; the lean attention calls (`attention_calls`) give vLLM's
backend methods' bits; and the library's build failures are said in one line. The engine tests
serve every model through them where they are the engine's choice (test_endpoints checks that the
engine core loaded them). On x86 without AVX-512 nor VNNI, the AVX2 W8A8 kernel computes its
reference's bits (SmoothQuant's product, exactly), and the float32 kernel with bf16-held weights is
as close to float64 as oneDNN's float32 product and takes only the layers bf16 holds exactly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmopt.engine import (avx2_bf16_linear, avx2_int8_linear, kernels, platform, prefill_attention, small_batch_int8_linear,
                           small_batch_linear)
from llmopt.errors import LlmoptError

HW = platform.detect()
runs_here = pytest.mark.skipif(not platform.llmopt_kernels_apply(HW), reason="needs AVX-512 BF16 and VNNI, no AMX")
bf16_linear_runs_here = pytest.mark.skipif(not platform.packed_linear_supported(HW), reason="needs AVX-512 BF16 and VNNI")
attention_runs_here = pytest.mark.skipif(not platform.prefill_attention_applies(HW),
                                         reason="needs AVX-512 BF16 without AMX, or AVX2 without AVX-512 and VNNI")
avx2_here = pytest.mark.skipif("avx2" not in HW.cpu_flags, reason="needs x86 with AVX2")

SAME_BITS = """
import torch, vllm._C
from vllm import _custom_ops as ops
from llmopt.engine import kernels, platform, small_batch_linear
vllms = ops.weight_packed_linear_cpu
checked = small_batch_linear.compare(kernels.build(platform.kernel_library(platform.detect())), vllms)
n, k = 576, 1536
packed = torch.ops._C.convert_weight_packed(torch.randn(n, k, dtype=torch.bfloat16))
traced = torch.compile(lambda x: ops.weight_packed_linear_cpu(x, packed, n, None), dynamic=True)
for m in (3, 6, 12):
    x = torch.randn(m, k, dtype=torch.bfloat16)
    assert torch.equal(traced(x), vllms(x, packed, n, None))
print(checked)
"""


@pytest.mark.vllm
@bf16_linear_runs_here
def test_the_kernel_gives_vllms_bits_at_every_batch() -> None:
    """The build for this processor: up to 64 rows without AMX; with AMX up to 4, where vLLM's kernel
    does not use the tiles (past them, its tiles' bits). Its op for layers kept in oneDNN's layout as
    well gives oneDNN's bits above those rows."""
    done = subprocess.run([sys.executable, "-c", SAME_BITS], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    checked = len(small_batch_linear.CHECKED_SHAPES) * 2 * len(small_batch_linear.CHECKED_ROWS) * 2
    assert done.stdout.split()[-1] == str(checked)


AMX_LAYERS = """
import torch, vllm._C
from vllm import _custom_ops as ops
from vllm.model_executor.layers import utils
from llmopt.engine import kernels, serve, small_batch_linear
vllms = ops.weight_packed_linear_cpu
library = kernels.build(kernels.AMX)
vllms_choice = serve._packed_linear_kernels()
small_batch_linear.use(library)
small_batch_linear.use_onednn_above(vllms_choice)
torch.cpu._init_amx()
checked = 0
for n, k, bias in ((3072, 576, False), (960, 576, True), (576, 576, True)):
    layer = torch.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    weight, onednn_bias = layer.weight.detach().clone(), layer.bias.detach().clone() if bias else None
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert layer.weight.numel() == 0
    packed, onednn = torch.ops._C.convert_weight_packed(weight), ops.create_onednn_mm(weight.t(), 32)
    fp32_bias = None if onednn_bias is None else onednn_bias.float()
    traced = torch.compile(lambda x: layer.cpu_linear(x, layer.weight, layer.bias), dynamic=True)
    for m in (1, 3, 4, 5, 8, 40, 300):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        in_onednn = m > 4 and not vllms_choice(n, k, torch.bfloat16)
        expected = ops.onednn_mm(onednn, x, onednn_bias) if in_onednn else vllms(x, packed, n, fp32_bias)
        assert torch.equal(layer.cpu_linear(x, layer.weight, layer.bias), expected), (n, k, m)
        assert torch.equal(traced(x), expected), ("traced", n, k, m)
        checked += in_onednn
print(checked)
"""


@pytest.mark.vllm
@pytest.mark.skipif(not (HW.has_amx and platform.packed_linear_supported(HW)), reason="needs AMX")
def test_with_amx_layers_vllm_gives_onednn_keep_it_above_four_rows() -> None:
    """A bf16 layer of more than 1 MiB (vLLM gives it oneDNN) holds its weights packed for the small-batch
    kernel and in oneDNN's layout: up to 4 rows the kernel's bits, above them oneDNN's, eager and traced;
    a smaller layer stays on the packed kernels at every row count, as vLLM has it."""
    done = subprocess.run([sys.executable, "-c", AMX_LAYERS], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == str(2 * 4)  # two layers over 1 MiB, four row counts above 4


SAME_INT8_BITS = """
import torch, vllm._C
from vllm.model_executor.kernels.linear.scaled_mm import cpu
from llmopt.engine import kernels, small_batch_int8_linear
vllms = cpu.CPUInt8ScaledMMLinearKernel._apply_weights_sgl
library = kernels.build()
checked = small_batch_int8_linear.compare(library)
small_batch_int8_linear.use(library)
assert cpu.CPUInt8ScaledMMLinearKernel._apply_weights_sgl is not vllms
n, k = 576, 1536
packed = torch.ops._C.convert_weight_packed(torch.randint(-127, 128, (n, k), dtype=torch.int8))
scales = torch.rand(n) / 100
ours = torch.compile(lambda x: torch.ops.llmopt.small_batch_int8_linear(x, packed, scales, None), dynamic=True)
for m in (3, 6, 12):
    x = torch.randn(m, k, dtype=torch.bfloat16)
    assert torch.equal(ours(x), torch.ops._C.int8_scaled_mm_with_quant(x, packed, scales, None, x.dtype, True))
print(checked)
"""


@pytest.mark.vllm
@runs_here
def test_the_int8_kernel_gives_vllms_bits_at_every_batch() -> None:
    """What a SmoothQuant layer computes is unchanged: vLLM's bits up to 32 rows and past them (where
    vLLM's kernel takes over), traced by torch.compile as the engine's graph calls it."""
    done = subprocess.run([sys.executable, "-c", SAME_INT8_BITS], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    checked = len(small_batch_int8_linear.CHECKED_SHAPES) * 2 * len(small_batch_int8_linear.CHECKED_ROWS)
    assert done.stdout.split()[-1] == str(checked)


AGREES = """
import vllm._custom_ops
from vllm import _custom_ops as ops
from llmopt.engine import kernels, platform, prefill_attention
print(prefill_attention.compare(kernels.build(platform.kernel_library(platform.detect())), ops.cpu_attention_with_kv_cache))
"""


@pytest.mark.vllm
@attention_runs_here
def test_the_prefill_attention_agrees_with_vllms_and_with_exact_attention() -> None:
    """On every checked shape and mix of requests, in the dtype it is for (bf16; float32 on AVX2), no
    further from attention computed in float64 than vLLM's kernel is beyond what neither controls
    (`prefill_attention._disagrees`), decodes too, alone and beside prompts; what it hands over,
    vLLM's bits."""
    done = subprocess.run([sys.executable, "-c", AGREES], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = len(prefill_attention.CHECKED_HEADS) * (len(prefill_attention.CHECKED_REQUESTS) + len(prefill_attention.WIDE_SCORES)
                                                   + len(prefill_attention.HANDED_OVER))
    assert done.stdout.split()[-1] == str(calls)


LEAN_CALLS = """
import sys
from types import SimpleNamespace
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()  # vLLM's build for this processor: AVX-512 BF16, AVX-512 or AVX2
from vllm import _custom_ops as ops
from vllm.v1.attention.backends import cpu_attn
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl, CPUAttentionMetadata
from llmopt.engine import attention_calls, kernels, platform, prefill_attention
attention_calls.use()
hw = platform.detect()
dtype = getattr(torch, platform.default_dtype(hw))  # what llmopt serves in here, and its attention kernel takes
methods = {"vllm": Impl.llmopt_vllm_methods, "lean": (Impl.forward, Impl.do_kv_cache_update)}
generator = torch.Generator().manual_seed(0)
isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
if isa == "amx":  # Linux gives a process AMX tiles on request: the engine's first oneDNN matmul asks, a kernel alone does not
    assert torch.cpu._init_amx()
layer = SimpleNamespace(isa=isa, _k_scale_float=0.5, _v_scale_float=2.0)  # distinct: swapped, an FP8 cache shows it
heads, kv_heads, size, block = 9, 3, 64, 128
# the backend asks the engine's settings only for the model's dtype (encoder attention's kernel)
cpu_attn.get_current_vllm_config = lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=dtype))
# each of the layer's own settings the kernels take, one at a time: a swapped argument changes the bits
variants = [{}, {"sliding_window": 64}, {"logits_soft_cap": 30.0},
            {"alibi_slopes": [2.0 ** -(h + 1) for h in range(heads)]},
            {"sinks": torch.randn(heads, dtype=torch.float32, generator=generator)}]
if torch.cpu._is_avx512_supported():
    variants.append({"kv_cache_dtype": "fp8_e4m3"})
checked = 0
for prefill_kernel in (False, True):
    if prefill_kernel:  # steps then go to llmopt's attention kernel, through either method
        if sys.argv[1] != "1":
            break
        prefill_attention.use(kernels.build(platform.kernel_library(hw)))
    for variant in variants:
        given = {"alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto"} | variant
        impl = Impl(heads, size, size ** -0.5, kv_heads, given["alibi_slopes"], given["sliding_window"],
                    given["kv_cache_dtype"], logits_soft_cap=given.get("logits_soft_cap"), sinks=given.get("sinks"))
        window = -1 if given["sliding_window"] is None else given["sliding_window"]
        for requests in (((1, 40),), ((1, 130), (1, 7), (1, 300), (1, 64)), ((20, 20),), ((1, 90), (17, 17), (3, 260))):
            for padding in (0, 3):  # rows past the step's tokens, which neither method touches
                counts = [-(-length // block) for _, length in requests]
                table = torch.zeros(len(requests), max(counts), dtype=torch.int32)
                order = torch.randperm(sum(counts) + 1, generator=generator).int()
                starts, slots = [0], []
                for row, (queries, length) in enumerate(requests):
                    table[row, :counts[row]] = order[sum(counts[:row]):sum(counts[:row]) + counts[row]]
                    starts.append(starts[-1] + queries)
                    slots += [int(table[row, p // block]) * block + p % block for p in range(length - queries, length)]
                tokens = starts[-1]
                seq_lens = torch.tensor([l for _, l in requests], dtype=torch.int32)
                query_start = torch.tensor(starts, dtype=torch.int32)
                plan = ops.cpu_attn_get_scheduler_metadata(len(requests), heads, kv_heads, size, seq_lens, dtype,
                                                           query_start, True, window, isa, True)
                metadata = CPUAttentionMetadata(num_actual_tokens=tokens, max_query_len=max(q for q, _ in requests),
                                                query_start_loc=query_start, max_seq_len=int(seq_lens.max()),
                                                seq_lens=seq_lens, block_table=table,
                                                slot_mapping=torch.tensor(slots, dtype=torch.int64),
                                                scheduler_metadata=plan, causal=True)
                cache = torch.randn(sum(counts) + 1, kv_heads, block, 2 * size, dtype=dtype, generator=generator)
                if given["kv_cache_dtype"] != "auto":
                    cache = torch.randint(0, 120, cache.shape, dtype=torch.uint8, generator=generator)
                query = torch.randn(tokens + padding, heads, size, dtype=dtype, generator=generator)
                key, value = (torch.randn(tokens + padding, kv_heads, size, dtype=dtype, generator=generator)
                              for _ in "kv")
                found = {}
                for name, (forward, update) in methods.items():
                    kv_cache, output = cache.clone(), torch.full_like(query, 7.0)
                    update(impl, layer, key[:tokens], value[:tokens], kv_cache, metadata.slot_mapping)
                    assert forward(impl, layer, query, key, value, kv_cache, metadata, output) is output
                    found[name] = (kv_cache, output)
                shape = (variant, requests, padding)
                assert impl.__dict__["_llmopt_halves"][0] is kv_cache, shape  # the lean methods ran, not vLLM's
                assert torch.equal(found["vllm"][0], found["lean"][0]), (shape, "cache")
                assert torch.equal(found["vllm"][1], found["lean"][1]), (shape, "output")
                assert not torch.equal(found["lean"][1][:tokens], torch.full_like(query[:tokens], 7.0)), shape
                assert torch.equal(found["lean"][1][tokens:], torch.full_like(query[tokens:], 7.0)), shape
                checked += 1
untouched = torch.full_like(query, 7.0)
assert Impl.forward(impl, layer, query, key, value, cache, None, untouched) is untouched  # a warm-up: no metadata
assert torch.equal(untouched, torch.full_like(query, 7.0))
print(len(variants), checked)
"""


@pytest.mark.vllm
def test_the_lean_attention_calls_give_vllms_bits() -> None:
    """Decode steps, a prompt, mixed steps, with rows past the step's tokens, for a plain layer and
    for each setting the kernels take from a layer (a sliding window, a soft cap, ALiBi, sinks, an
    FP8 cache with its scales): the KV cache and the outputs the lean methods leave are vLLM's
    methods' to the bit, with vLLM's kernel alone and, where it runs, with llmopt's prefill
    attention taking the steps; in the dtype llmopt serves in here."""
    applies = platform.prefill_attention_applies(HW)
    done = subprocess.run([sys.executable, "-c", LEAN_CALLS, "1" if applies else "0"], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    variants, checked = map(int, done.stdout.split()[-2:])
    assert variants >= 5 and checked == variants * 8 * (2 if applies else 1)


INT8_LAYER = """
import torch
from vllm.model_executor.kernels.linear.scaled_mm import Int8ScaledMMLinearLayerConfig, cpu


def int8_layer(n, k):
    \"\"\"An int8 layer as vLLM loads one (two fused parts, each with its scale, and a bias), its weight,
    and its scales per output channel.\"\"\"
    layer, weight, parts = torch.nn.Module(), torch.randint(-128, 128, (n, k), dtype=torch.int8), [n - n // 3, n // 3]
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.tensor([[0.01], [0.02]]), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(n), requires_grad=False)
    layer.logical_widths = parts
    return layer, weight, torch.tensor([0.01] * parts[0] + [0.02] * parts[1])


def int8_kernel():
    \"\"\"vLLM's CPU int8 kernel for a layer of SmoothQuant's scheme (dynamic symmetric per-token inputs).\"\"\"
    config = Int8ScaledMMLinearLayerConfig(is_static_input_scheme=False, is_channelwise=False, input_symmetric=True)
    return cpu.CPUInt8ScaledMMLinearKernel(config, ("weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj"))
"""

AVX2_INT8 = INT8_LAYER + """
from llmopt.engine import avx2_int8_linear, kernels
library = kernels.build(kernels.AVX2)
checked = avx2_int8_linear.compare(library)
n, k = 1000, 576  # channels that do not fill a block
weight = torch.randint(-128, 128, (n, k), dtype=torch.int8)
packed, scales = avx2_int8_linear.pack(weight), avx2_int8_linear.padded(torch.rand(n) / 100)
ours = torch.compile(lambda x: torch.ops.llmopt.avx2_int8_linear(x, packed, scales, None, n), dynamic=True)
for m in (3, 6, 12, 70):
    x = torch.randn(m, k)
    assert torch.equal(ours(x), torch.ops.llmopt.avx2_int8_linear(x, packed, scales, None, n))
# as the engine's int8 layers call it: a fused layer of two parts, a scale per part, and a bias
avx2_int8_linear.use(library)
layer, weight, channelwise = int8_layer(40, 64)
kernel = int8_kernel()
kernel.process_weights_after_loading(layer)
x = torch.randn(2, 3, 64)
for bias in (layer.bias, torch.randn(40), None):  # its own, padded once at load; another, padded when called
    expected = avx2_int8_linear.reference(x.reshape(-1, 64), weight, channelwise, bias).reshape(2, 3, 40)
    assert torch.equal(kernel.apply_weights(layer, x, bias), expected)
print(checked)
"""


@pytest.mark.vllm
@avx2_here
def test_the_avx2_int8_kernel_computes_the_reference_at_every_batch() -> None:
    """SmoothQuant's layers without VNNI: the rows quantized as vLLM's dynamic scheme does, exact
    integer products and the reference's epilogue, bit for bit, for decode steps and prefills alike,
    and traced by torch.compile as the engine's graph calls it (it builds on any AVX2 processor)."""
    done = subprocess.run([sys.executable, "-c", AVX2_INT8], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    checked = len(avx2_int8_linear.CHECKED_SHAPES) * 2 * len(avx2_int8_linear.CHECKED_ROWS)
    assert done.stdout.split()[-1] == str(checked)


AVX2_BF16 = """
import torch
import torch.nn.functional as F
from vllm.model_executor.layers import utils
from llmopt.engine import avx2_bf16_linear, kernels
library = kernels.build(kernels.AVX2)
checked = avx2_bf16_linear.compare(library)
n, k = 1000, 576  # channels that do not fill a block
weight = torch.randn(n, k).bfloat16().float()
packed = avx2_bf16_linear.pack(weight)
ours = torch.compile(lambda x: torch.ops.llmopt.avx2_bf16_linear(x, packed, None, n), dynamic=True)
for m in (3, 6, 12, 70):
    x = torch.randn(m, k)
    assert torch.equal(ours(x), torch.ops.llmopt.avx2_bf16_linear(x, packed, None, n))


def layer(weight, bias=None):
    \"\"\"A layer as vLLM's unquantized method holds one when its weights are loaded.\"\"\"
    module = torch.nn.Module()
    module.weight = weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight, requires_grad=False)
    module.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    module.quant_method = object()
    return module


def distance(out, x, weight, bias):
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    return (out.double() - exact).abs().max().item(), (F.linear(x, weight, bias).double() - exact).abs().max().item()


vllms = utils.dispatch_cpu_unquantized_gemm
avx2_bf16_linear.use(library)
# a bf16 checkpoint's layer, upcast to float32: packed in bf16, its float32 weight let go as vLLM's would be
weight, bias = torch.randn(40, 64).bfloat16().float(), torch.randn(40)
held = layer(weight.clone(), bias)
utils.dispatch_cpu_unquantized_gemm(held, remove_weight=True)
assert held.weight.numel() == 0
x = torch.randn(2, 3, 64)
for given in (held.bias, torch.randn(40), None):  # its own, padded once at load; another, padded when called
    out = utils.cpu_unquantized_gemm(held, x, held.weight, given)
    assert out.shape == (2, 3, 40)
    ours_error, torchs = distance(out.reshape(-1, 40), x.reshape(-1, 64), weight, given)
    assert ours_error <= avx2_bf16_linear.TOLERANCE * torchs + 1e-6, (ours_error, torchs)
# weights bf16 does not hold: vLLM's own choice, the same bits as a layer it dispatched itself
full = torch.randn(40, 64)
kept, theirs = layer(full.clone()), layer(full.clone())
utils.dispatch_cpu_unquantized_gemm(kept, remove_weight=True)
vllms(theirs, remove_weight=True)
x = torch.randn(5, 64)
assert torch.equal(utils.cpu_unquantized_gemm(kept, x, kept.weight), utils.cpu_unquantized_gemm(theirs, x, theirs.weight))
# a tied lm_head: the embeddings' weight, kept for their lookups, packed once for both
shared = torch.nn.Parameter(torch.randn(300, 64).bfloat16().float(), requires_grad=False)
embeddings, head = layer(shared), layer(shared)
utils.dispatch_cpu_unquantized_gemm(embeddings, remove_weight=False)
first = getattr(shared, avx2_bf16_linear.PACKED)
utils.dispatch_cpu_unquantized_gemm(head, remove_weight=False)
assert getattr(shared, avx2_bf16_linear.PACKED) is first and head.weight is shared and shared.numel() == 300 * 64
x = torch.randn(4, 64)
assert torch.equal(utils.cpu_unquantized_gemm(head, x, head.weight), utils.cpu_unquantized_gemm(embeddings, x, shared))
print(checked)
"""


@pytest.mark.vllm
@avx2_here
def test_the_avx2_bf16_kernel_is_as_exact_as_onednn_and_takes_only_bf16_weights() -> None:
    """Float32 layers of a bf16 checkpoint without AVX-512: their weights held in bf16 (half the bytes
    a step streams) and products no further from float64 than oneDNN's float32 ones, at every row
    count, traced by torch.compile; as vLLM's unquantized layers call it, with a bias of their own or
    another; a layer whose weights bf16 does not hold keeps vLLM's bits; a tied lm_head packs once."""
    done = subprocess.run([sys.executable, "-c", AVX2_BF16], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    checked = len(avx2_bf16_linear.CHECKED_SHAPES) * 2 * len(avx2_bf16_linear.CHECKED_ROWS)
    assert done.stdout.split()[-1] == str(checked)


def test_the_avx2_bf16_packing_keeps_every_weight_in_its_channel() -> None:
    """The packed blocks, read back as the kernel widens them (each 128-bit half of a line
    interleaved with zeros), give every channel's weights in order, padding channels zero."""
    import torch

    weight = torch.randn(37, 5).bfloat16().float()
    packed = avx2_bf16_linear.pack(weight).view(-1, 5, 2, 2, 4)  # blocks, inputs, 128-bit halves, vectors, 4 channels
    widened = torch.cat([packed[:, :, :, 0], packed[:, :, :, 1]], dim=2).reshape(-1, 5, 16)  # vpunpcklwd, vpunpckhwd
    unpacked = widened.transpose(1, 2).reshape(-1, 5).float()
    assert torch.equal(unpacked[:37], weight) and not unpacked[37:].any()
    assert avx2_bf16_linear.exact(weight) and not avx2_bf16_linear.exact(weight + 1e-4)


WEIGHT_ONLY_INT8 = INT8_LAYER + """
from llmopt.engine import weight_only_int8_linear
weight_only_int8_linear.use()
layer, weight, channelwise = int8_layer(40, 64)
kernel = int8_kernel()
kernel.process_weights_after_loading(layer)
x = torch.randn(2, 3, 64)
for bias in (layer.bias, None):
    expected = torch._weight_int8pack_mm(x.reshape(-1, 64).bfloat16(), weight, channelwise.bfloat16()).float()
    expected = (expected if bias is None else expected + bias).reshape(2, 3, 40)
    assert torch.equal(kernel.apply_weights(layer, x, bias), expected)
assert weight_only_int8_linear.takes(None, weight) and not weight_only_int8_linear.takes(None, weight[:, :60])
print("ok")
"""


@pytest.mark.vllm
def test_int8_layers_run_torchs_weight_only_kernel_where_chosen() -> None:
    """`linear_kernels: weight_only`: vLLM's int8 layers (fused parts with a scale each, a bias) give
    torch's weight-only int8 product of their bf16 rows, where vLLM would call oneDNN."""
    done = subprocess.run([sys.executable, "-c", WEIGHT_ONLY_INT8], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "ok"


def test_the_avx2_int8_reference_is_smoothquants_product() -> None:
    """The reference the kernel is held to is the W8A8 product itself: within the rows'
    quantization step of the float product of the dequantized weights."""
    import torch

    generator = torch.Generator().manual_seed(1)
    weight = torch.randint(-128, 128, (48, 64), dtype=torch.int8, generator=generator)
    scales, x = torch.rand(48, generator=generator) / 100, torch.randn(5, 64, generator=generator)
    exact = x.double() @ (weight.double() * scales.double()[:, None]).T
    step = x.abs().amax(dim=1, keepdim=True).double() / 127  # each row's quantization step
    bound = step / 2 * (weight.double().abs() * scales.double()[:, None]).sum(dim=1)[None, :]
    error = (avx2_int8_linear.reference(x, weight, scales, None).double() - exact).abs()
    assert bool((error <= bound * 1.001 + 1e-6).all())
    assert not torch.equal(avx2_int8_linear.reference(x, weight, scales, None), (x @ (weight.float() * scales[:, None]).T))


def test_a_build_without_a_compiler_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(kernels, "library_path", lambda library=kernels.AVX512: tmp_path / "kernel.so")
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(LlmoptError, match="need a C.. compiler, and none was found -- install g.. .*set linear_kernels: packed and attention_kernel: vllm"):
        kernels.build()
    assert not (tmp_path / "kernel.so").exists()


def test_a_failed_build_leaves_nothing_and_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(kernels, "library_path", lambda library=kernels.AVX512: tmp_path / "kernels" / "kernel.so")
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(LlmoptError, match="building llmopt's CPU kernels failed"):
        kernels.build()
    assert list((tmp_path / "kernels").iterdir()) == []


def test_a_compiler_that_is_not_there_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(kernels, "library_path", lambda library=kernels.AVX512: tmp_path / "kernels" / "kernel.so")
    monkeypatch.setenv("CXX", "ccache no-such-compiler")  # a launcher and a compiler, as CXX may name
    with pytest.raises(LlmoptError, match="building llmopt's CPU kernels failed: .*ccache|no-such") as caught:
        kernels.build()
    assert "\n" not in str(caught.value) and "set linear_kernels: packed and attention_kernel: vllm" in str(caught.value)


@runs_here
def test_a_library_that_does_not_load_is_not_kept(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(kernels, "library_path", lambda library=kernels.AVX512: tmp_path / "kernels" / "kernel.so")
    monkeypatch.setenv("CXX", """sh -c 'eval out=\\${$#}; echo not-a-library > "$out"' cc""")  # "builds" a text file
    with pytest.raises(LlmoptError, match="CPU kernels' self-check failed: .*(ELF|header|OSError)") as caught:
        kernels.build()
    assert "\n" not in str(caught.value)
    assert list((tmp_path / "kernels").iterdir()) == []


def test_with_amx_the_library_is_the_bf16_kernel_alone_up_to_four_rows() -> None:
    """vLLM's packed bf16 kernel multiplies 5 rows or more on AMX tiles, whose bits the kernel does not
    give (it differed at 8 rows), and vLLM's int8 kernel and attention run on them too."""
    amx = platform.Hardware(device="cpu", cpu_model="Xeon", cores=2, memory_gib=24, gpu=None,
                            cpu_flags=("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"))
    assert platform.kernel_library(amx) is kernels.AMX and platform.builds_kernels(amx)
    assert not platform.llmopt_kernels_apply(amx) and not platform.prefill_attention_applies(amx)
    assert [source.name for source in kernels.AMX.sources] == ["small_batch_linear.cpp"]
    assert f"-DLLMOPT_MAX_ROWS={kernels.AMX_LINEAR_MAX_ROWS}" in kernels.AMX.flags and kernels.AMX_LINEAR_MAX_ROWS == 4
    for library, rows in ((kernels.AMX, 4), (kernels.AVX512, kernels.LINEAR_MAX_ROWS)):
        path = kernels.library_path(library)
        assert kernels.library_of(path) is library and small_batch_linear.max_rows(path) == rows
    assert kernels.library_of(kernels.library_path(kernels.AVX2)) is kernels.AVX2


def test_every_header_a_library_includes_is_in_its_hash_and_shipped() -> None:
    """A header edited alone must build anew (it is in the library's name) and reach an installed
    package (package data): each `#include "..."` of a library's sources is one of its `headers`."""
    import dataclasses
    import re
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    shipped = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["llmopt"]
    for library in (kernels.AVX512, kernels.AMX, kernels.AVX2):
        included = {source.with_name(name) for source in library.sources
                    for name in re.findall(r'#include "([^"]+)"', source.read_text())}
        assert included == set(library.headers), library.prefix
        for path in (*library.sources, *library.headers):
            assert any(fnmatch(f"engine/{path.name}", pattern) for pattern in shipped), path.name
    assert kernels.AVX2.headers  # the AVX2 kernels share their blocking
    before = kernels.library_path(kernels.AVX2)
    changed = dataclasses.replace(kernels.AVX2, headers=(Path(__file__),))
    assert kernels.library_path(changed) != before
