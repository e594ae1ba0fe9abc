// llmopt::small_batch_int8_linear: a W8A8 linear layer (SmoothQuant's: int8 weights with a scale per
// output channel, activations quantized per row as they come) for 5 to 32 rows on AVX-512 VNNI
// processors without AMX, over the weights vLLM's int8 kernel has already packed.
//
// vLLM's `_C::int8_scaled_mm_with_quant` quantizes the rows in one parallel region, then multiplies
// in tiles of 4 rows by 32 channels: 8 rows read each block of weights twice, 16 rows four times,
// and on the project's Zen 4 EPYC it streamed 21-29 GB/s of weights at one row, 16-23 at 8 and 12-16
// at 16 (`benchmarks/linear_kernels.py`). Here the rows are quantized before the one parallel
// region, and up to 8 rows share each weight load (16 accumulators in registers), with the
// weights read ahead into L2 as the bf16 kernel does. Products accumulate exactly in int32, the
// quantization and the epilogue are vLLM's operation for operation, so the outputs are its bits
// (`small_batch_int8_linear.compare`). Up to 4 rows vLLM's tile reads each weight once too, and in
// the engine this kernel was no faster there (benchmarks/README.md): those, more than 32 rows, and
// shapes the tiles do not cover go to vLLM's kernel.
//
// The layout is vLLM's (`_C::convert_weight_packed` on int8): blocks of 32 output channels, each
// [K/4][32][4] bytes (four int8 along K side by side per channel), then the block's 32 int32
// compensations (128 times each channel's weight sum), since VNNI multiplies unsigned by signed
// bytes: a row is quantized to int8 and shifted by 128, and the compensation takes the shift back.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlockN = 32;      // output channels in one packed block
constexpr int64_t kTileRows = 8;     // rows sharing one weight load
constexpr int64_t kMinRows = LLMOPT_INT8_MIN_ROWS;  // small_batch_int8_linear.MIN_ROWS; fewer go to vLLM's kernel
constexpr int64_t kMaxRows = LLMOPT_INT8_MAX_ROWS;  // small_batch_int8_linear.MAX_ROWS; more go to vLLM's kernel
constexpr int64_t kPrefetchBytes = 4096;  // as the bf16 kernel's: read this far ahead into L2

// vLLM's `quantize_row_int8<at::BFloat16>` (sgl-kernels' vec.h), operation for operation: the row's
// absolute maximum (at least 1e-7), its scale amax / 127, and each value times 127 / amax rounded to
// nearest even, plus 128. K is a multiple of 32.
void quantize_row(uint8_t* q, float& scale, const at::BFloat16* x, int64_t k) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i offset = _mm512_set1_epi32(128);
  __m512 amax0 = _mm512_setzero_ps(), amax1 = _mm512_setzero_ps();
  auto widen = [](__m256i half) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)); };
  for (int64_t i = 0; i < k; i += 32) {
    const __m512i v = _mm512_loadu_si512(x + i);
    amax0 = _mm512_max_ps(amax0, _mm512_andnot_ps(sign, widen(_mm512_extracti32x8_epi32(v, 0))));
    amax1 = _mm512_max_ps(amax1, _mm512_andnot_ps(sign, widen(_mm512_extracti32x8_epi32(v, 1))));
  }
  const float amax = std::max(_mm512_reduce_max_ps(_mm512_max_ps(amax0, amax1)), 1e-7f);
  scale = amax / 127;
  const __m512 inverse = _mm512_set1_ps(127 / amax);
  for (int64_t i = 0; i < k; i += 32) {
    const __m512i v = _mm512_loadu_si512(x + i);
    __m512 v0 = _mm512_mul_ps(widen(_mm512_extracti32x8_epi32(v, 0)), inverse);
    __m512 v1 = _mm512_mul_ps(widen(_mm512_extracti32x8_epi32(v, 1)), inverse);
    v0 = _mm512_roundscale_ps(v0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v1 = _mm512_roundscale_ps(v1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i q0 = _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v0), offset));
    const __m128i q1 = _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v1), offset));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_set_m128i(q1, q0));
  }
}

// ROWS quantized rows times one block of 32 channels; the epilogue is vLLM's tinygemm's.
template <int ROWS, bool BIAS>
void tile(const uint8_t* a, const float* a_scales, int64_t k, const int8_t* b, const float* b_scales,
          const float* bias, at::BFloat16* c, int64_t ldc) {
  __m512i acc[ROWS][2];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const int32_t* quads = reinterpret_cast<const int32_t*>(a);  // four quantized values of a row as one word
  const int64_t k4 = k / 4;
  for (int64_t kq = 0; kq < k4; ++kq) {
    const int8_t* line = b + kq * kBlockN * 4;  // 128 bytes: 32 channels' four values
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(line) + kPrefetchBytes), _MM_HINT_T1);
    const __m512i w0 = _mm512_loadu_si512(line), w1 = _mm512_loadu_si512(line + 64);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512i x = _mm512_set1_epi32(quads[r * k4 + kq]);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], x, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], x, w1);
    }
  }
  const int32_t* compensation = reinterpret_cast<const int32_t*>(b + kBlockN * k);
  const __m512i comp0 = _mm512_loadu_si512(compensation), comp1 = _mm512_loadu_si512(compensation + 16);
  const __m512 scale0 = _mm512_loadu_ps(b_scales), scale1 = _mm512_loadu_ps(b_scales + 16);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    const __m512 row_scale = _mm512_set1_ps(a_scales[r]);
    __m512 c0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], comp0));
    __m512 c1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], comp1));
    if constexpr (BIAS) {
      c0 = _mm512_fmadd_ps(_mm512_mul_ps(c0, row_scale), scale0, _mm512_loadu_ps(bias));
      c1 = _mm512_fmadd_ps(_mm512_mul_ps(c1, row_scale), scale1, _mm512_loadu_ps(bias + 16));
    } else {
      c0 = _mm512_mul_ps(_mm512_mul_ps(c0, row_scale), scale0);
      c1 = _mm512_mul_ps(_mm512_mul_ps(c1, row_scale), scale1);
    }
    _mm512_storeu_si512(c + r * ldc, (__m512i)_mm512_cvtne2ps_pbh(c1, c0));
  }
}

template <bool BIAS>
void block(int64_t m, const uint8_t* a, const float* a_scales, int64_t k, const int8_t* b, const float* b_scales,
           const float* bias, at::BFloat16* c, int64_t ldc) {
  for (int64_t m0 = 0; m0 < m; m0 += kTileRows) {
    const uint8_t* rows_a = a + m0 * k;
    const float* rows_scales = a_scales + m0;
    at::BFloat16* rows_c = c + m0 * ldc;
    switch (std::min(kTileRows, m - m0)) {
      case 1: tile<1, BIAS>(rows_a, rows_scales, k, b, b_scales, bias, rows_c, ldc); break;
      case 2: tile<2, BIAS>(rows_a, rows_scales, k, b, b_scales, bias, rows_c, ldc); break;
      case 3: tile<3, BIAS>(rows_a, rows_scales, k, b, b_scales, bias, rows_c, ldc); break;
      case 4: tile<4, BIAS>(rows_a, rows_scales, k, b, b_scales, bias, rows_c, ldc); break;
      case 5: tile<5, BIAS>(rows_a, rows_scales, k, b, b_scales, bias, rows_c, ldc); break;
      case 6: tile<6, BIAS>(rows_a, rows_scales, k, b, b_scales, bias, rows_c, ldc); break;
      case 7: tile<7, BIAS>(rows_a, rows_scales, k, b, b_scales, bias, rows_c, ldc); break;
      default: tile<8, BIAS>(rows_a, rows_scales, k, b, b_scales, bias, rows_c, ldc); break;
    }
  }
}

at::Tensor vllms(at::Tensor x, at::Tensor packed, at::Tensor scales, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("_C::int8_scaled_mm_with_quant", "")
                       .typed<at::Tensor(at::Tensor&, at::Tensor&, at::Tensor&, const std::optional<at::Tensor>&,
                                         at::ScalarType, bool)>();  // vLLM's signature, references included
  return op.call(x, packed, scales, bias, x.scalar_type(), true);
}

// Functional, as `small_batch_linear` is, for the same reason (a cold compile's graph passes).
at::Tensor small_batch_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2, "llmopt::small_batch_int8_linear takes 2-D inputs and packed weights");
  // Other dtypes, more rows, other shapes or strides go to vLLM's kernel, which checks its arguments.
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  const bool ours = x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kChar && m >= kMinRows && m <= kMaxRows &&
                    packed.size(1) == k + 4 && k % 32 == 0 && n % kBlockN == 0 && x.stride(1) == 1 &&
                    packed.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == n &&
                    scales.is_contiguous() &&
                    (!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->numel() == n &&
                                           bias->is_contiguous()));
  if (!ours) return vllms(x, packed, scales, bias);
  // the rows quantized before the parallel region: at most 32 rows of a layer's input, a few us
  thread_local std::vector<uint8_t> quantized;
  thread_local std::vector<float> row_scales;
  quantized.resize(m * k);
  row_scales.resize(m);
  const at::BFloat16* a = x.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < m; ++r) quantize_row(quantized.data() + r * k, row_scales[r], a + r * x.stride(0), k);
  at::Tensor out = at::empty({m, n}, x.options());
  const int8_t* b = packed.data_ptr<int8_t>();
  const float* b_scales = scales.data_ptr<float>();
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::BFloat16* c = out.data_ptr<at::BFloat16>();
  const uint8_t* q = quantized.data();
  const float* q_scales = row_scales.data();
  at::parallel_for(0, n / kBlockN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kBlockN;
      const int8_t* weights = b + n0 * (k + 4);
      if (bias_data) {
        block<true>(m, q, q_scales, k, weights, b_scales + n0, bias_data + n0, c + n0, n);
      } else {
        block<false>(m, q, q_scales, k, weights, b_scales + n0, nullptr, c + n0, n);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmopt, m) {
  m.def("small_batch_int8_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmopt, CPU, m) {
  m.impl("small_batch_int8_linear", &small_batch_int8_linear);
}
