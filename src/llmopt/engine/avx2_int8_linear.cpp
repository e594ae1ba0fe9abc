// llmopt::avx2_int8_linear: a W8A8 linear layer (SmoothQuant's: int8 weights with a scale per output
// channel, activations quantized to int8 per row as they come) for x86 processors with AVX2 and no
// AVX-512 nor VNNI, at every row count: decode steps and prefills alike.
//
// There vLLM has only oneDNN for int8 layers, which without VNNI streamed 0.3-1.6 GB/s of weights on
// the project's Zen 3 EPYC (0.35x float32's layers at one row, `benchmarks/linear_kernels.py`), and
// torch's weight-only int8 kernel streams 5-9 GB/s at one row and falls behind float32 from about
// eight rows. Without VNNI the 8-bit product (`vpmaddubsw`) sums into 16 bits, which saturate unless
// a sign trick costs an operation per product; here the int8 values are widened to 16 bits once and
// multiplied with `vpmaddwd` (16 products into 8 exact int32 sums), which needs no trick and on Zen 3
// issues on both multiply pipes: about twice float32's multiply-adds per cycle.
//
// Layout (`avx2_int8_linear.pack`): blocks of 16 output channels, each [K/2][16][2] bytes (a pair of
// consecutive input values per channel side by side), channels padded to a multiple of 16 with zero
// weights. A row is quantized as vLLM's dynamic per-token scheme does (scale amax / 127, values
// rounded to nearest even), held as int16 pairs; products accumulate exactly in int32, and the
// epilogue is (sum * row scale) * channel scale (+ bias) in float32, as `avx2_int8_linear.reference`
// computes it, so the outputs are its bits.

#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx2_blocks.h"

namespace {

using namespace llmopt_avx2;

// One row of float32 as int16 values in [-127, 127], two to a 32-bit word; K even.
void quantize_row(int16_t* q, float& scale, const float* x, int64_t k) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = *std::max_element(lanes, lanes + 8);
  for (; i < k; ++i) m = std::max(m, std::abs(x[i]));
  m = std::max(m, 1e-7f);
  scale = m / 127;
  const float inverse = 127 / m;
  const __m256 inv = _mm256_set1_ps(inverse);
  i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inv));
    // packs interleaves 128-bit lanes: put them back in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), packed);
  }
  for (; i < k; ++i) q[i] = static_cast<int16_t>(std::nearbyint(x[i] * inverse));
}

// One pair of a row's quantized values as a 32-bit word, to broadcast (memcpy: no aliasing of int16 as int32).
inline int32_t pair(const int16_t* a) {
  int32_t word;
  std::memcpy(&word, a, sizeof(word));
  return word;
}

// ROWS quantized rows times one block of 16 channels, written to c (valid channels only).
template <int ROWS>
void tile(const int16_t* a, int64_t lda, const float* a_scales, int64_t kp, const int8_t* b, const float* b_scales,
          const float* bias, float* c, int64_t ldc, int64_t valid) {
  __m256i acc[ROWS][2];
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t kq = 0; kq < kp; ++kq) {
    const int8_t* line = b + kq * kBlockN * 2;  // 32 bytes: 16 channels' pair of values
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 16)));
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
      const __m256i x = _mm256_set1_epi32(pair(a + r * lda + 2 * kq));
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, x));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, x));
    }
  }
  const __m256 scale0 = _mm256_loadu_ps(b_scales), scale1 = _mm256_loadu_ps(b_scales + 8);
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r) {
    const __m256 row_scale = _mm256_set1_ps(a_scales[r]);
    store_row(_mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][0]), row_scale), scale0),
              _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][1]), row_scale), scale1), bias, c + r * ldc, valid);
  }
}

at::Tensor avx2_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "llmopt::avx2_int8_linear takes 2-D float32 inputs with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), blocks = (n + kBlockN - 1) / kBlockN;
  TORCH_CHECK(k % 2 == 0 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.numel() == blocks * kBlockN * k,
              "llmopt::avx2_int8_linear: weights packed by avx2_int8_linear.pack for this input width");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == blocks * kBlockN,
              "llmopt::avx2_int8_linear: a float32 scale per packed channel");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == blocks * kBlockN),
              "llmopt::avx2_int8_linear: a float32 bias per packed channel");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const int64_t kp = k / 2;
  std::vector<int16_t> quantized(m * k);
  std::vector<float> row_scales(m);
  const float* a = x.data_ptr<float>();
  const int64_t stride = x.stride(0);
  auto quantize = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(quantized.data() + r * k, row_scales[r], a + r * stride, k);
  };
  if (m <= kChunkRows) {
    quantize(0, m);  // a few us: not worth opening a parallel region for
  } else {
    at::parallel_for(0, m, 16, quantize);
  }
  const int16_t* q = quantized.data();
  const int8_t* b = packed.data_ptr<int8_t>();
  const float* b_scales = scales.data_ptr<float>();
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* c = out.data_ptr<float>();
  for_blocks(m, n, [&](int64_t m0, int64_t chunk, int64_t n0, int64_t valid) {
    for_tiles(chunk, [&](auto rows, int64_t r0) {
      const int64_t first = m0 + r0;
      tile<decltype(rows)::value>(q + first * k, k, row_scales.data() + first, kp, b + n0 * k, b_scales + n0,
                                  bias_data ? bias_data + n0 : nullptr, c + first * n + n0, n, valid);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmopt, m) {
  m.def("avx2_int8_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmopt, CPU, m) {
  m.impl("avx2_int8_linear", &avx2_int8_linear);
}
