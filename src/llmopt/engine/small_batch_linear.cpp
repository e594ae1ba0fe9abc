// llmopt::small_batch_linear: a bf16 linear layer for 1 to 64 rows (decode batches, speculative
// verification, short prefills) on AVX-512 BF16 processors without AMX, over the weights vLLM's
// packed-weight kernel has already packed.
//
// vLLM's `_C::weight_packed_linear` runs up to 4 rows with AVX-512 BF16 dot products and hands 5
// rows or more to torch's brgemm, which without AMX multiplies at about the machine's fp32 rate:
// a batch-8 decode step of SmolLM2-135M then spends 17 of its 27 ms in its linear layers. Here
// every row of a batch shares each weight load from memory (up to 8 rows a tile, whose 16
// accumulators stay in registers), so 8 rows cost little more than one. Products accumulate in
// fp32 in the same order as vLLM's kernel, and a bias joins where vLLM's does (first up to 4 rows,
// last from 5), so outputs are bit-identical to it. Above 8 rows, each further tile of 8 reads the
// block's weights again from L2: still 1.15-1.39x vLLM's brgemm at 24-64 rows on SmolLM2's shapes
// (an n-gram step at batch 8 verifies 32 rows: 3 drafted tokens and one more, each). Larger
// batches (prefill chunks) go to vLLM's kernel.
//
// The weight layout is vLLM's (`_C::convert_weight_packed`): blocks of 32 output channels (the last
// may hold 16), each [K/2][channels][2], pairs of bf16 along K side by side.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kBlockN = 32;    // output channels in one packed block
constexpr int64_t kTileRows = 8;   // rows sharing one weight load
constexpr int64_t kMaxRows = LLMOPT_MAX_ROWS;  // small_batch_linear.MAX_ROWS; above this, vLLM's brgemm path
constexpr int64_t kBiasFirstRows = 4;  // vLLM starts from the bias up to this many rows, adds it last above
// Weights are read this far ahead into L2 (software prefetch): the hardware prefetcher alone kept
// one row's stream at 25-27 GB/s of this machine's 33, 4 KB ahead at 27-29 (8 KB ahead gained
// less at 1 row and lost at 8; benchmarks/README.md, linear_kernels.py).
constexpr int64_t kPrefetchBytes = 4096;

enum Bias { kNone, kFirst, kLast };

template <int ROWS, int COLS, Bias BIAS>
void tile(const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t channels, at::BFloat16* c, int64_t ldc,
          const float* bias, int64_t k) {
  __m512 acc[ROWS][COLS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < COLS; ++j) acc[r][j] = BIAS == kFirst ? _mm512_loadu_ps(bias + j * 16) : _mm512_setzero_ps();
  const float* pairs = reinterpret_cast<const float*>(a);  // two bf16 of a row as one 32-bit word
  const int64_t lda_pairs = lda / 2;
  for (int64_t kp = 0; kp < k / 2; ++kp) {
    __m512bh w[COLS];
#pragma GCC unroll 2
    for (int j = 0; j < COLS; ++j) {
      const at::BFloat16* line = b + (kp * channels + j * 16) * 2;  // 64 bytes: 16 channels' pair
      // an address, past the weights near their end, that a prefetch never faults on
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(line) + kPrefetchBytes), _MM_HINT_T1);
      w[j] = (__m512bh)_mm512_loadu_si512(line);
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_ps(pairs[r * lda_pairs + kp]);
#pragma GCC unroll 2
      for (int j = 0; j < COLS; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, w[j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < COLS; ++j) {
      const __m512 sum = BIAS == kLast ? _mm512_add_ps(acc[r][j], _mm512_loadu_ps(bias + j * 16)) : acc[r][j];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + j * 16), (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

template <int COLS, Bias BIAS>
void rows(int64_t n, const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t channels, at::BFloat16* c,
          int64_t ldc, const float* bias, int64_t k) {
  switch (n) {
    case 1: return tile<1, COLS, BIAS>(a, lda, b, channels, c, ldc, bias, k);
    case 2: return tile<2, COLS, BIAS>(a, lda, b, channels, c, ldc, bias, k);
    case 3: return tile<3, COLS, BIAS>(a, lda, b, channels, c, ldc, bias, k);
    case 4: return tile<4, COLS, BIAS>(a, lda, b, channels, c, ldc, bias, k);
    case 5: return tile<5, COLS, BIAS>(a, lda, b, channels, c, ldc, bias, k);
    case 6: return tile<6, COLS, BIAS>(a, lda, b, channels, c, ldc, bias, k);
    case 7: return tile<7, COLS, BIAS>(a, lda, b, channels, c, ldc, bias, k);
    default: return tile<8, COLS, BIAS>(a, lda, b, channels, c, ldc, bias, k);
  }
}

template <Bias BIAS>
void block(int64_t m, const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t channels, at::BFloat16* c,
           int64_t ldc, const float* bias, int64_t k) {
  for (int64_t m0 = 0; m0 < m; m0 += kTileRows) {
    const int64_t n = std::min(kTileRows, m - m0);
    if (channels == kBlockN) {
      rows<2, BIAS>(n, a + m0 * lda, lda, b, channels, c + m0 * ldc, ldc, bias, k);
    } else {
      rows<1, BIAS>(n, a + m0 * lda, lda, b, channels, c + m0 * ldc, ldc, bias, k);
    }
  }
}

void vllm_packed(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("_C::weight_packed_linear", "")
                       .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool)>();
  op.call(out, x, packed, bias, true);
}

void vllm_onednn(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& handler) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("_C::onednn_mm", "")
                       .typed<void(at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&)>();
  op.call(out, x, bias, handler);
}

// Functional (returns its output, mutates nothing): in vLLM's traced graph a mutating op becomes an
// auto_functionalized node that Inductor's post-grad passes take apart again, each time rescanning
// the graph, which made a cold compile of a bf16 model with 120 of these slower (benchmarks/README.md).
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                              int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2, "llmopt::small_batch_linear takes 2-D inputs and packed weights");
  // Other dtypes, more rows, other shapes or strides go to vLLM's kernel, which checks its arguments.
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  at::Tensor out = at::empty({m, n_out}, x.options());
  const bool ours = x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && m <= kMaxRows &&
                    packed.size(1) == k && k % 2 == 0 && n % 16 == 0 && n == n_out && x.stride(1) == 1 &&
                    x.stride(0) % 2 == 0 && packed.is_contiguous() &&
                    (!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->numel() == n &&
                                           bias->is_contiguous()));
  if (!ours) {
    vllm_packed(out, x, packed, bias);
    return out;
  }
  const at::BFloat16* a = x.data_ptr<at::BFloat16>();
  const at::BFloat16* b = packed.data_ptr<at::BFloat16>();
  at::BFloat16* c = out.data_ptr<at::BFloat16>();
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t lda = x.stride(0);
  at::parallel_for(0, (n + kBlockN - 1) / kBlockN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kBlockN;
      const int64_t channels = std::min(kBlockN, n - n0);
      if (!bias_data) {
        block<kNone>(m, a, lda, b + n0 * k, channels, c + n0, n, nullptr, k);
      } else if (m <= kBiasFirstRows) {
        block<kFirst>(m, a, lda, b + n0 * k, channels, c + n0, n, bias_data + n0, k);
      } else {
        block<kLast>(m, a, lda, b + n0 * k, channels, c + n0, n, bias_data + n0, k);
      }
    }
  });
  return out;
}

// A layer that keeps its weights twice, packed and in oneDNN's layout (`onednn`: vLLM's handler of
// them, with the bias in the layer's dtype as oneDNN takes it): up to kMaxRows rows here, more in
// oneDNN, where vLLM gives such a layer oneDNN for every batch. With AMX, vLLM's packed kernel took
// 1.5x oneDNN's time for a step's layers at 40 rows (a decode batch with a prefill chunk).
at::Tensor small_batch_linear_or_onednn(const at::Tensor& x, const at::Tensor& packed,
                                        const std::optional<at::Tensor>& bias, int64_t n_out, const at::Tensor& onednn,
                                        const std::optional<at::Tensor>& onednn_bias) {
  if (x.dim() != 2 || x.size(0) <= kMaxRows) {
    return small_batch_linear(x, packed, bias, n_out);
  }
  at::Tensor out = at::empty({x.size(0), n_out}, x.options());
  vllm_onednn(out, x.stride(1) == 1 ? x : x.contiguous(), onednn_bias, onednn);
  return out;
}

}  // namespace

TORCH_LIBRARY(llmopt, m) {
  m.def("small_batch_linear(Tensor x, Tensor packed, Tensor? bias, SymInt n) -> Tensor");
  m.def("small_batch_linear_or_onednn(Tensor x, Tensor packed, Tensor? bias, SymInt n, Tensor onednn, "
        "Tensor? onednn_bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmopt, CPU, m) {
  m.impl("small_batch_linear", &small_batch_linear);
  m.impl("small_batch_linear_or_onednn", &small_batch_linear_or_onednn);
}
