// llmopt::prefill_attention: causal attention over vLLM's paged bf16 KV cache for prompts, with
// AVX-512 BF16 dot products, and for decodes, on processors without AMX.
//
// Without AMX, vLLM's CPU attention (`_C::cpu_attention_with_kv_cache`, its `vec` path) widens
// bf16 to fp32 and multiplies at the processor's fp32 rate: on the project's Zen 5 EPYC an
// 884-token prefill of SmolLM2-135M spends 74-78 ms in attention, a quarter to a third of the
// prefill, at about 355 GFLOP/s against the 973 its bf16 matmuls reach (benchmarks/README.md,
// step_profile.py, cpu_attention.py). Here both products run on bf16 pairs (`vdpbf16ps`):
//   S = Q K^T: query rows share each loaded pair of key dimensions, 32 keys at a time;
//   softmax in fp32 over the whole causal row (two passes, no running rescale);
//   O = P V:   P rounded to bf16, as vLLM's AMX path rounds it, sharing each loaded pair of values.
// Before that, each sequence's keys and values are copied once out of the paged cache into pair
// order (two key dimensions, or two tokens' values, side by side), shared by every query row
// and every query head of the KV head. That copy reads the whole context once for a prompt's many
// rows.
//
// Decodes (a sequence's one query, or its few with speculated tokens to verify, in any step) read
// the cache in place, in fp32 from exact widenings of its bf16: there the cache is cold (a served
// step's weights stream through the caches between two layers), and vLLM's kernel read it at
// 12.5-13 GB/s on Zen 4 at batch 4 and 8 where it read the same bytes hot at 31-33
// (benchmarks/README.md, "cpu_attention.py"). One tile is a sequence's KV head with its query heads
// (for each of its queries) as rows, so a key is read once for kDecodeRows rows, and each block
// front to back: all its keys of four dimensions at a time (the scores summed in L1), then each
// token's values whole, the next block fetched while one is summed. At batch 1 each context is cut
// in parts (`decode_parts`), merged as a split softmax. The AVX2 kernel
// (`avx2_prefill_attention.cpp`) does the same in float32.
//
// vLLM's `vec` cache layout, per block and KV head: keys transposed, [head_size][block_size];
// values as written, [block_size][head_size]. Anything this kernel does not do (sliding windows,
// ALiBi, soft caps, sinks, an FP8 cache, non-causal or encoder attention, other head sizes) goes
// to vLLM's kernel with its own arguments.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "prefill_attention.h"

namespace {

using namespace llmopt_attention;

constexpr int64_t kKeys = 32;       // keys a score tile covers (two vectors of 16)
constexpr int64_t kRows = 8;        // query rows sharing each loaded key pair
// Rows a decode tile takes at once: their values' accumulators (rows x D/16 vectors) and the keys'
// broadcast queries (rows x 4) stay in registers.
template <int D>
constexpr int kDecodeRows = D <= 64 ? 4 : 2;

// 2^x for x in fp32 lanes, x <= 0: x = n + f, |f| <= 0.5, 2^f by its Taylor series to f^6
// (relative error under 2e-7), scaled by 2^n.
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Two rows of 32 bf16 interleaved lane by lane: the first 16 pairs, then the last 16.
inline void interleave(__m512i a, __m512i b, __m512i& low, __m512i& high) {
  static const __m512i kLow = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  static const __m512i kHigh = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55,
                                                23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  low = _mm512_permutex2var_epi16(a, kLow, b);
  high = _mm512_permutex2var_epi16(a, kHigh, b);
}

// One sequence's keys and values for one KV head, in pair order:
//   keys:   [D/2][padded][2]  (dimensions 2i and 2i+1 of a key side by side, keys along a row)
//   values: [padded/2][D][2]  (tokens 2t and 2t+1 of a dimension side by side)
// Values past the sequence are zero (their probabilities are zero; garbage could be NaN).
template <int D>
void gather(const at::BFloat16* key_cache, const at::BFloat16* value_cache, int64_t block_stride,
            const int32_t* blocks, int64_t block_size, int64_t length, int64_t padded, at::BFloat16* keys,
            at::BFloat16* values) {
  for (int64_t t0 = 0; t0 < padded; t0 += kKeys) {
    const int64_t block = blocks[t0 / block_size], offset = t0 % block_size;
    const at::BFloat16* k = key_cache + block * block_stride + offset;  // [D][block_size]
    const at::BFloat16* v = value_cache + block * block_stride + offset * D;  // [block_size][D]
    for (int d = 0; d < D; d += 2) {
      __m512i low, high;
      interleave(_mm512_loadu_si512(k + d * block_size), _mm512_loadu_si512(k + (d + 1) * block_size), low, high);
      at::BFloat16* row = keys + ((d / 2) * padded + t0) * 2;
      _mm512_storeu_si512(row, low);
      _mm512_storeu_si512(row + 32, high);
    }
    for (int64_t t = 0; t < kKeys; t += 2) {
      const bool first = t0 + t < length, second = t0 + t + 1 < length;
      at::BFloat16* row = values + ((t0 + t) / 2) * D * 2;
      for (int d = 0; d < D; d += 32) {
        const __m512i a = first ? _mm512_loadu_si512(v + t * D + d) : _mm512_setzero_si512();
        const __m512i b = second ? _mm512_loadu_si512(v + (t + 1) * D + d) : _mm512_setzero_si512();
        __m512i low, high;
        interleave(a, b, low, high);
        _mm512_storeu_si512(row + d * 2, low);
        _mm512_storeu_si512(row + d * 2 + 32, high);
      }
    }
  }
}

// Scores of `n` query rows against keys [0, count), scaled, into `scores` (row stride `padded`).
template <int D, int N>
void score_tile(const at::BFloat16* query, int64_t query_stride, const at::BFloat16* keys, int64_t padded,
                int64_t count, float scale, float* scores) {
  const float* q = reinterpret_cast<const float*>(query);  // a pair of bf16 as one 32-bit word
  const int64_t q_pairs = query_stride / 2;
  for (int64_t t0 = 0; t0 < count; t0 += kKeys) {
    __m512 acc[N][2];
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; ++p) {
      const at::BFloat16* line = keys + (p * padded + t0) * 2;
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(line), k1 = (__m512bh)_mm512_loadu_si512(line + 32);
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_ps(q[r * q_pairs + p]);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, k0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, k1);
      }
    }
    const __m512 s = _mm512_set1_ps(scale);
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) {
      _mm512_storeu_ps(scores + r * padded + t0, _mm512_mul_ps(acc[r][0], s));
      _mm512_storeu_ps(scores + r * padded + t0 + 16, _mm512_mul_ps(acc[r][1], s));
    }
  }
}

// Row softmax over keys [0, visible), in place as probabilities rounded to bf16 (`probs`, zero up
// to `count` rounded up to a pair); returns the fp32 sum the output is divided by.
inline float softmax_row(float* scores, int64_t visible, int64_t count, at::BFloat16* probs) {
  const int64_t padded = (count + 31) / 32 * 32;
  __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < visible; t += 16) {
    const __mmask16 live = visible - t >= 16 ? 0xFFFF : (__mmask16)((1u << (visible - t)) - 1);
    peak = _mm512_max_ps(peak, _mm512_mask_loadu_ps(peak, live, scores + t));
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(peak) * 1.4426950408889634f);
  const __m512 log2e = _mm512_set1_ps(1.4426950408889634f);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += 16) {
    const __mmask16 live =
        visible - t >= 16 ? 0xFFFF : (visible <= t ? 0 : (__mmask16)((1u << (visible - t)) - 1));
    __m512 e = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(scores + t), log2e, shift));
    e = _mm512_maskz_mov_ps(live, e);
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + t), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return _mm512_reduce_add_ps(sum);
}

// Outputs of `n` rows: probabilities (row stride `padded`) times values over `count` keys.
template <int D, int N>
void value_tile(const at::BFloat16* probs, int64_t padded, const at::BFloat16* values, int64_t count,
                const float* sums, at::BFloat16* out, int64_t out_stride) {
  constexpr int V = D / 16;
  __m512 acc[N][V];
#pragma GCC unroll 8
  for (int r = 0; r < N; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* p = reinterpret_cast<const float*>(probs);
  const int64_t p_pairs = padded / 2;
  for (int64_t t = 0; t < (count + 1) / 2; ++t) {
    __m512bh v[V];
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) v[j] = (__m512bh)_mm512_loadu_si512(values + (t * D + j * 16) * 2);
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_ps(p[r * p_pairs + t]);
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, v[j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < N; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.0f / sums[r]);
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + j * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][j], inverse)));
  }
}

template <int D, int N>
void rows_tile(const at::BFloat16* query, int64_t query_stride, const at::BFloat16* keys, const at::BFloat16* values,
               int64_t padded, int64_t first_position, float scale, float* scores, at::BFloat16* probs,
               at::BFloat16* out, int64_t out_stride) {
  const int64_t count = first_position + N;  // keys the last row sees
  score_tile<D, N>(query, query_stride, keys, padded, count, scale, scores);
  float sums[N];
  for (int r = 0; r < N; ++r) sums[r] = softmax_row(scores + r * padded, first_position + r + 1, count, probs + r * padded);
  constexpr int kValueRows = D <= 64 ? 4 : 2;  // accumulators for the whole head in registers
  for (int r = 0; r < N; r += kValueRows) {
    constexpr int M = N < kValueRows ? N : kValueRows;
    if (N - r >= M) {
      value_tile<D, M>(probs + r * padded, padded, values, count, sums + r, out + r * out_stride, out_stride);
    } else {
      for (int i = r; i < N; ++i)
        value_tile<D, 1>(probs + i * padded, padded, values, count, sums + i, out + i * out_stride, out_stride);
    }
  }
}

template <int D>
void query_tile(int64_t n, const at::BFloat16* query, int64_t query_stride, const at::BFloat16* keys,
                const at::BFloat16* values, int64_t padded, int64_t first_position, float scale, float* scores,
                at::BFloat16* probs, at::BFloat16* out, int64_t out_stride) {
  with_rows<kRows>(n, [&](auto rows) {
    rows_tile<D, decltype(rows)::value>(query, query_stride, keys, values, padded, first_position, scale, scores, probs,
                                        out, out_stride);
  });
}

// 16 bf16 widened to fp32, exactly (a bf16 is the upper half of a float32).
inline __m512 widen(const at::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Scores of N decode rows (query heads of a sequence's queries, row r's at `query[r]`) against keys
// [first, count), `first` on a block's boundary, scaled, into `scores` (row stride `padded`, indexed
// by key): a block's keys read front to back, four dimensions' lines at a time.
template <int D, int N>
void decode_scores(const at::BFloat16* const (&query)[N], const Cache<at::BFloat16>& cache, int64_t first,
                   int64_t count, float scale, float* scores, int64_t padded) {
  constexpr int kDims = 4;
  for (int64_t b0 = first; b0 < count; b0 += cache.block_size) {
    const at::BFloat16* k = cache.keys + cache.blocks[b0 / cache.block_size] * cache.stride;
    // the next block's keys (after the last, the first block's values), fetched while this one's are summed
    const char* next = reinterpret_cast<const char*>(
        b0 + cache.block_size < count ? cache.keys + cache.blocks[b0 / cache.block_size + 1] * cache.stride
                                      : cache.values + cache.blocks[first / cache.block_size] * cache.stride);
    const int64_t vectors = (std::min(cache.block_size, count - b0) + 15) / 16;
    for (int r = 0; r < N; ++r)
      for (int64_t v = 0; v < vectors; ++v) _mm512_storeu_ps(scores + r * padded + b0 + v * 16, _mm512_setzero_ps());
    for (int d = 0; d < D; d += kDims) {
      for (int64_t byte = 0; byte < kDims * cache.block_size * 2; byte += 64)
          _mm_prefetch(next + d * cache.block_size * 2 + byte, _MM_HINT_T0);
      __m512 x[N][kDims];
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r)
#pragma GCC unroll 4
        for (int i = 0; i < kDims; ++i) x[r][i] = _mm512_set1_ps(static_cast<float>(query[r][d + i]));
      const at::BFloat16* line = k + d * cache.block_size;
      for (int64_t v = 0; v < vectors; ++v) {
        __m512 keys[kDims];
#pragma GCC unroll 4
        for (int i = 0; i < kDims; ++i) keys[i] = widen(line + i * cache.block_size + v * 16);
#pragma GCC unroll 8
        for (int r = 0; r < N; ++r) {
          float* sum = scores + r * padded + b0 + v * 16;
          __m512 acc = _mm512_loadu_ps(sum);
#pragma GCC unroll 4
          for (int i = 0; i < kDims; ++i) acc = _mm512_fmadd_ps(x[r][i], keys[i], acc);
          _mm512_storeu_ps(sum, acc);
        }
      }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int r = 0; r < N; ++r)
      for (int64_t v = 0; v < vectors; ++v) {
        float* sum = scores + r * padded + b0 + v * 16;
        _mm512_storeu_ps(sum, _mm512_mul_ps(_mm512_loadu_ps(sum), s));
      }
  }
}

// A decode row's softmax over its `visible` scores (none where it is not positive), in place,
// unnormalized and zero from there up to `count`; summed a block of 128 keys at a time, as the
// values are.
inline Softmax decode_softmax(float* scores, int64_t visible, int64_t count) {
  const auto live = [visible](int64_t t) {
    return visible - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (visible - t)) - 1);
  };
  __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < visible; t += 16) peak = _mm512_max_ps(peak, _mm512_mask_loadu_ps(peak, live(t), scores + t));
  const float largest = _mm512_reduce_max_ps(peak);
  const __m512 log2e = _mm512_set1_ps(1.4426950408889634f), shift = _mm512_set1_ps(largest * 1.4426950408889634f);
  __m512 sum = _mm512_setzero_ps(), part = sum;
  for (int64_t t = 0; t < visible; t += 16) {
    const __m512 e = _mm512_maskz_mov_ps(live(t), exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(scores + t), log2e, shift)));
    part = _mm512_add_ps(part, e);
    if (t % 128 == 112) sum = _mm512_add_ps(sum, part), part = _mm512_setzero_ps();
    _mm512_storeu_ps(scores + t, e);
  }
  for (int64_t t = std::max<int64_t>(0, (visible + 15) / 16 * 16); t < count; t += 16)
    _mm512_storeu_ps(scores + t, _mm512_setzero_ps());
  return {largest, _mm512_reduce_add_ps(_mm512_add_ps(sum, part))};
}

// Probabilities (row stride `padded`, indexed by key) times values over keys [first, count), added
// to `total`: each token's D values read whole; each block's products summed apart and then added up.
template <int D, int N>
void decode_values(const float* probs, int64_t padded, const Cache<at::BFloat16>& cache, int64_t first, int64_t count,
                   float (&total)[N][D]) {
  constexpr int V = D / 16;
  for (int64_t b0 = first; b0 < count; b0 += cache.block_size) {
    const at::BFloat16* v = cache.values + cache.blocks[b0 / cache.block_size] * cache.stride;
    const char* next = b0 + cache.block_size < count
        ? reinterpret_cast<const char*>(cache.values + cache.blocks[b0 / cache.block_size + 1] * cache.stride) : nullptr;
    const int64_t tokens = std::min(cache.block_size, count - b0);
    __m512 acc[N][V];
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < tokens; ++t) {
      if (next)
        for (int byte = 0; byte < D * 2; byte += 64) _mm_prefetch(next + t * D * 2 + byte, _MM_HINT_T0);
      __m512 values[V];
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) values[j] = widen(v + t * D + j * 16);
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r) {
        const __m512 x = _mm512_set1_ps(probs[r * padded + b0 + t]);
#pragma GCC unroll 8
        for (int j = 0; j < V; ++j) acc[r][j] = _mm512_fmadd_ps(x, values[j], acc[r][j]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j)
        _mm512_storeu_ps(total[r] + j * 16, _mm512_add_ps(_mm512_loadu_ps(total[r] + j * 16), acc[r][j]));
  }
}

// A decode tile: N rows' softmaxes and undivided outputs over keys [first, last), row r's over those
// before visible[r].
template <int D, int N>
void decode_tile(const at::BFloat16* const (&query)[N], const int64_t (&visible)[N], const Cache<at::BFloat16>& cache,
                 int64_t first, int64_t last, float scale, float* scores, int64_t widest, Softmax (&softmax)[N],
                 float (&total)[N][D]) {
  decode_scores<D, N>(query, cache, first, last, scale, scores, widest);
  for (int r = 0; r < N; ++r)
    softmax[r] = decode_softmax(scores + r * widest + first, std::min(last, visible[r]) - first, last - first);
  decode_values<D, N>(scores, widest, cache, first, last, total);
}

template <int D>
void attend(at::Tensor& output, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const Step& step, float scale, const at::Tensor& block_table) {
  const int64_t heads = query.size(1), kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t group = heads / kv_heads, sequences = step.sequences;
  const int32_t* lengths = step.lengths;
  const Split split = llmopt_attention::split(step);
  if (!split.decodes.empty())
    attend_decodes<at::BFloat16, D, kDecodeRows<D>>(
        output, query, key_cache, value_cache, step, split.decodes, scale, block_table,
        row_width(step, split.decodes, kKeys),
        [](auto rows, auto&&... args) { decode_tile<D, decltype(rows)::value>(args...); });
  if (split.prompts.empty()) return;
  // Scratch: every prompt's keys and values in pair order, per KV head.
  std::vector<int64_t> padded(sequences, 0), offset(sequences + 1, 0);
  for (const int64_t s : split.prompts) padded[s] = (lengths[s] + kKeys - 1) / kKeys * kKeys;
  for (int64_t s = 0; s < sequences; ++s) offset[s + 1] = offset[s] + kv_heads * padded[s] * D * 2;  // keys and values
  const int64_t widest = *std::max_element(padded.begin(), padded.end());  // a row of scores
  at::Tensor scratch = at::empty({offset[sequences]}, query.options());
  at::BFloat16* pairs = scratch.data_ptr<at::BFloat16>();
  const at::BFloat16* keys_in = key_cache.data_ptr<at::BFloat16>();
  const at::BFloat16* values_in = value_cache.data_ptr<at::BFloat16>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  const int64_t items = static_cast<int64_t>(split.prompts.size()) * kv_heads;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = split.prompts[item / kv_heads], g = item % kv_heads;
      at::BFloat16* keys = pairs + offset[s] + g * padded[s] * D * 2;
      gather<D>(keys_in + g * key_cache.stride(1), values_in + g * value_cache.stride(1), key_cache.stride(0),
                table + s * table_stride, block_size, lengths[s], padded[s], keys, keys + padded[s] * D);
    }
  });
  const at::BFloat16* q = query.data_ptr<at::BFloat16>();
  at::BFloat16* o = output.data_ptr<at::BFloat16>();
  for_query_tiles(step, split.prompts, heads, kRows, [&] {
    return [&, scores = std::vector<float>(kRows * widest), probs = std::vector<at::BFloat16>(kRows * widest)](
               const Tile& tile) mutable {
      const int64_t s = tile.sequence;
      const at::BFloat16* keys = pairs + offset[s] + tile.head / group * padded[s] * D * 2;
      query_tile<D>(tile.rows, q + tile.first * query.stride(0) + tile.head * query.stride(1), query.stride(0), keys,
                    keys + padded[s] * D, padded[s], tile.position, scale, scores.data(), probs.data(),
                    o + tile.first * output.stride(0) + tile.head * output.stride(1), output.stride(0));
    };
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmopt, m) { m.def(llmopt_attention::kSchema); }
TORCH_LIBRARY_IMPL(llmopt, CPU, m) {
  m.impl("prefill_attention", &llmopt_attention::prefill_attention<at::kBFloat16, kKeys, attend<64>, attend<128>>);
}
