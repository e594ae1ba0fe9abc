// llmopt::avx2_bf16_linear: a float32 linear layer whose weights are held in bf16, for x86 processors
// with AVX2 and no AVX-512, where llmopt serves float32 (`platform.default_dtype`): the unquantized
// layers of a bf16 model and the `lm_head` of a quantized one, at every row count.
//
// There vLLM upcasts a bf16 checkpoint's weights to float32 and multiplies them with oneDNN, so a
// decode step streams 4 bytes a weight, of which the last two are zeros, at about 56% of the read
// bandwidth (`benchmarks/step_profile.py` on the project's Zen 3 EPYC). Held as the checkpoint's
// bf16 (a weight is packed only where bf16 holds it exactly: `avx2_bf16_linear.exact`) and widened
// to float32 in registers, a step streams half the bytes; products and sums are float32 with fused
// multiply-adds, so the outputs are float32 products of the same weights, summed in another order
// than oneDNN's (`avx2_bf16_linear.compare` holds them as close to float64 as oneDNN's).
//
// Layout (`avx2_bf16_linear.pack`): blocks of 16 output channels, each [K][16] bf16, the channels of
// a block in the order 0-3, 8-11, 4-7, 12-15, so that interleaving a line's 32 bytes with zeros
// (`vpunpcklwd`, `vpunpckhwd`, which work in 128-bit lanes) gives channels 0-7 and 8-15 as float32;
// channels padded to a multiple of 16 with zero weights.

#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "avx2_blocks.h"

namespace {

using namespace llmopt_avx2;

// Products are summed a span of inputs at a time and the spans' sums added: one chain of K fused
// multiply-adds strayed 2-3x further from float64 than oneDNN's product on SmolLM2's down projection
// (K = 1536); summed by spans of 32, at most 1.9x on the checked shapes, 1.0x on SmolLM2's and Qwen's.
constexpr int64_t kSpan = 32;

// One input's products for ROWS rows and a block's 16 channels, added to `acc`.
template <int ROWS>
inline void step(__m256 (&acc)[ROWS][2], const float* a, int64_t lda, int64_t i, const uint16_t* b, __m256i zero) {
  const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i * kBlockN));
  const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, line));  // channels 0-7
  const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, line));  // channels 8-15
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r) {
    const __m256 x = _mm256_broadcast_ss(a + r * lda + i);
    acc[r][0] = _mm256_fmadd_ps(w0, x, acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(w1, x, acc[r][1]);
  }
}

// ROWS rows times one block of 16 channels, written to c (valid channels only).
template <int ROWS>
void tile(const float* a, int64_t lda, int64_t k, const uint16_t* b, const float* bias, float* c, int64_t ldc,
          int64_t valid) {
  __m256 sums[ROWS][2];
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  // one or two rows: alternate inputs in two chains of sums, or each waits on its own last add
  constexpr int CHAINS = ROWS <= 2 ? 2 : 1;
  for (int64_t k0 = 0; k0 < k; k0 += kSpan) {
    __m256 acc[CHAINS][ROWS][2];
#pragma GCC unroll 2
    for (int h = 0; h < CHAINS; ++h)
#pragma GCC unroll 6
      for (int r = 0; r < ROWS; ++r) acc[h][r][0] = acc[h][r][1] = _mm256_setzero_ps();
    const int64_t end = std::min(k, k0 + kSpan);
    int64_t i = k0;
    for (; i + CHAINS <= end; i += CHAINS) {
#pragma GCC unroll 2
      for (int h = 0; h < CHAINS; ++h) step<ROWS>(acc[h], a, lda, i + h, b, zero);
    }
    for (; i < end; ++i) step<ROWS>(acc[0], a, lda, i, b, zero);
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 2
      for (int h = 0; h < CHAINS; ++h) {
        sums[r][0] = _mm256_add_ps(sums[r][0], acc[h][r][0]);
        sums[r][1] = _mm256_add_ps(sums[r][1], acc[h][r][1]);
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r) store_row(sums[r][0], sums[r][1], bias, c + r * ldc, valid);
}

at::Tensor avx2_bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                            int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "llmopt::avx2_bf16_linear takes 2-D float32 inputs");
  const at::Tensor rows_x = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), blocks = (n + kBlockN - 1) / kBlockN;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.numel() == blocks * kBlockN * k,
              "llmopt::avx2_bf16_linear: weights packed by avx2_bf16_linear.pack for this input width");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == blocks * kBlockN),
              "llmopt::avx2_bf16_linear: a float32 bias per packed channel");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const float* a = rows_x.data_ptr<float>();
  const int64_t lda = rows_x.stride(0);
  const uint16_t* b = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* c = out.data_ptr<float>();
  for_blocks(m, n, [&](int64_t m0, int64_t chunk, int64_t n0, int64_t valid) {
    for_tiles(chunk, [&](auto rows, int64_t r0) {
      tile<decltype(rows)::value>(a + (m0 + r0) * lda, lda, k, b + n0 * k, bias_data ? bias_data + n0 : nullptr,
                                  c + (m0 + r0) * n + n0, n, valid);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmopt, m) {
  m.def("avx2_bf16_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmopt, CPU, m) {
  m.impl("avx2_bf16_linear", &avx2_bf16_linear);
}
