// llmopt::prefill_attention on x86 processors with AVX2 and no AVX-512: causal attention over vLLM's
// paged float32 KV cache (llmopt serves float32 there) for prompts and decodes.
//
// There vLLM's CPU attention (`_C::cpu_attention_with_kv_cache`, its `vec` path) spent 501 ms of an
// 884-token prefill of SmolLM2-135M on the project's Zen 3 EPYC, a quarter of it, at about 54
// GFLOP/s where the linear layers beside it reach 133 (benchmarks/README.md, "step_profile.py").
// Here every product is a float32 FMA on 8 lanes, read in place from the cache, whose `vec` layout
// already suits it:
//   S = Q K^T: keys are transposed per block, [head_size][block_size], so a line of 16 keys' same
//              dimension multiplies a broadcast query value; kRows query rows share each line;
//   softmax in float32 over the whole causal row (two passes, no running rescale);
//   O = P V:   values are [block_size][head_size], so each token's values multiply its broadcast
//              probability, kRows query rows sharing each loaded 16 dimensions.
// Nothing is rounded below float32, so the outputs are as close to exact as vLLM's.
//
// Decodes (a sequence's one query, or its few with speculated tokens to verify): the cache is cold
// there (a served step's weights stream through the caches between two layers), and vLLM's kernel
// read it at 7-9 GB/s on Zen 3 where the machine streams 20 (benchmarks/README.md,
// "cpu_attention.py"): a score tile of 16 keys walks 64 lines 512 bytes apart. Here one tile is a
// sequence's KV head with all its query heads (for each of its queries) as rows, so a key is read
// once for kDecodeRows rows, and each block is read front to back: all its keys of one dimension at
// a time (the scores summed in L1, not in registers), then each token's values whole.
// Where a step's tiles are few and do not share out evenly among the threads (batch 1), each
// context is cut in parts of whole blocks, read on their own and merged as a split softmax.

#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "prefill_attention.h"

namespace {

using namespace llmopt_attention;

constexpr int64_t kKeys = 16;     // keys a score tile covers (two vectors of 8)
constexpr int kRows = 6;          // query rows sharing each loaded line of keys, and of values: 12 accumulators
constexpr int kDecodeRows = 8;    // rows (query heads of a sequence's queries) a decode tile takes at once
constexpr int kValueVectors = 2;  // a head's values 16 dimensions at a time (single-threaded on Zen 3: 63
                                  // GFLOP/s, against 53-59 with two query rows or three over 32 dimensions)

// e^x for x in float32 lanes, x <= 0: x = n ln 2 + f, |f| <= ln 2 / 2 (n ln 2 taken off in two parts,
// so f carries no error of x's size), e^f by its Taylor series to f^7 (relative error under 1e-8,
// below float32's rounding), scaled by 2^n through the exponent bits.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // 2^n stays a normal number
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

// Lanes t .. t + 7 below `visible`, as an all-ones mask.
inline __m256 below(int64_t t, int64_t visible) {
  const __m256i lanes = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(t)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(visible)), lanes));
}

// `op` over a vector's eight lanes.
template <typename Op>
inline float horizontal(__m256 v, Op op) {
  __m128 x = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = op(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(op(x, _mm_shuffle_ps(x, x, 1)));
}

using Cache = llmopt_attention::Cache<float>;

// Scores of N query rows against keys [0, count), scaled, into `scores` (row stride `padded`).
template <int D, int N>
void score_tile(const float* query, int64_t query_stride, const Cache& cache, int64_t count, float scale,
                float* scores, int64_t padded) {
  for (int64_t t0 = 0; t0 < count; t0 += kKeys) {
    const float* k = cache.keys + cache.blocks[t0 / cache.block_size] * cache.stride + t0 % cache.block_size;
    __m256 acc[N][2];
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_loadu_ps(k + d * cache.block_size), k1 = _mm256_loadu_ps(k + d * cache.block_size + 8);
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r) {
        const __m256 x = _mm256_broadcast_ss(query + r * query_stride + d);
        acc[r][0] = _mm256_fmadd_ps(x, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(x, k1, acc[r][1]);
      }
    }
    const __m256 s = _mm256_set1_ps(scale);
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) {
      _mm256_storeu_ps(scores + r * padded + t0, _mm256_mul_ps(acc[r][0], s));
      _mm256_storeu_ps(scores + r * padded + t0 + 8, _mm256_mul_ps(acc[r][1], s));
    }
  }
}

// Row softmax over keys [0, visible), in place, unnormalized and zero up to `count` rounded up to
// a vector (keys past `visible` may be past the sequence: never read as numbers).
inline Softmax softmax_row(float* scores, int64_t visible, int64_t count) {
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 peak = lowest;
  for (int64_t t = 0; t < visible; t += 8)
    peak = _mm256_max_ps(peak, _mm256_blendv_ps(lowest, _mm256_loadu_ps(scores + t), below(t, visible)));
  const float largest = horizontal(peak, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); });
  const __m256 shift = _mm256_set1_ps(largest);
  __m256 sum = _mm256_setzero_ps(), part = sum;  // summed 128 keys at a time, as the values are
  for (int64_t t = 0; t < count; t += 8) {
    const __m256 live = below(t, visible);
    const __m256 x = _mm256_blendv_ps(lowest, _mm256_loadu_ps(scores + t), live);
    const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(x, shift)), live);
    part = _mm256_add_ps(part, e);
    if (t % 128 == 120) sum = _mm256_add_ps(sum, part), part = _mm256_setzero_ps();
    _mm256_storeu_ps(scores + t, e);
  }
  return {largest, horizontal(_mm256_add_ps(sum, part), [](__m128 a, __m128 b) { return _mm_add_ps(a, b); })};
}

// Outputs of N rows: probabilities (row stride `padded`) times values over keys [0, count),
// divided by each row's sum; kValueVectors * 8 dimensions at a time. Each block's products are summed apart and
// then added up, which keeps a long row's sum as close to exact as vLLM's.
template <int D, int N>
void value_tile(const float* probs, int64_t padded, const Cache& cache, int64_t count, const float* sums, float* out,
                int64_t out_stride) {
  for (int j0 = 0; j0 < D; j0 += 8 * kValueVectors) {
    __m256 total[N][kValueVectors];
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < kValueVectors; ++j) total[r][j] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < count; b0 += cache.block_size) {
      const float* v = cache.values + cache.blocks[b0 / cache.block_size] * cache.stride + j0;
      const int64_t tokens = std::min(cache.block_size, count - b0);
      __m256 acc[N][kValueVectors];
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r)
#pragma GCC unroll 8
        for (int j = 0; j < kValueVectors; ++j) acc[r][j] = _mm256_setzero_ps();
      for (int64_t t = 0; t < tokens; ++t) {
        __m256 values[kValueVectors];
#pragma GCC unroll 8
        for (int j = 0; j < kValueVectors; ++j) values[j] = _mm256_loadu_ps(v + t * D + j * 8);
#pragma GCC unroll 8
        for (int r = 0; r < N; ++r) {
          const __m256 x = _mm256_broadcast_ss(probs + r * padded + b0 + t);
#pragma GCC unroll 8
          for (int j = 0; j < kValueVectors; ++j) acc[r][j] = _mm256_fmadd_ps(x, values[j], acc[r][j]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r)
#pragma GCC unroll 8
        for (int j = 0; j < kValueVectors; ++j) total[r][j] = _mm256_add_ps(total[r][j], acc[r][j]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) {
      const __m256 sum = _mm256_set1_ps(sums[r]);
#pragma GCC unroll 8
      for (int j = 0; j < kValueVectors; ++j)
        _mm256_storeu_ps(out + r * out_stride + j0 + j * 8, _mm256_div_ps(total[r][j], sum));
    }
  }
}

template <int D, int N>
void rows_tile(const float* query, int64_t query_stride, const Cache& cache, int64_t first_position, float scale,
               float* scores, int64_t padded, float* out, int64_t out_stride) {
  const int64_t count = first_position + N;  // keys the last row sees
  score_tile<D, N>(query, query_stride, cache, count, scale, scores, padded);
  float sums[N];
  for (int r = 0; r < N; ++r) sums[r] = softmax_row(scores + r * padded, first_position + r + 1, count).sum;
  value_tile<D, N>(scores, padded, cache, count, sums, out, out_stride);
}

template <int D>
void query_tile(int64_t n, const float* query, int64_t query_stride, const Cache& cache, int64_t first_position,
                float scale, float* scores, int64_t padded, float* out, int64_t out_stride) {
  with_rows<kRows>(n, [&](auto rows) {
    rows_tile<D, decltype(rows)::value>(query, query_stride, cache, first_position, scale, scores, padded, out, out_stride);
  });
}

// Scores of N decode rows (query heads of a sequence's queries, row r's at `query[r]`) against keys
// [first, count), `first` on a block's boundary, scaled, into `scores` (row stride `padded`, indexed
// by key): a block's keys read front to back.
template <int D, int N>
void decode_scores(const float* const (&query)[N], const Cache& cache, int64_t first, int64_t count, float scale,
                   float* scores, int64_t padded) {
  for (int64_t b0 = first; b0 < count; b0 += cache.block_size) {
    const float* k = cache.keys + cache.blocks[b0 / cache.block_size] * cache.stride;
    const int64_t vectors = (std::min(cache.block_size, count - b0) + 7) / 8;
    for (int r = 0; r < N; ++r)
      for (int64_t v = 0; v < vectors; ++v) _mm256_storeu_ps(scores + r * padded + b0 + v * 8, _mm256_setzero_ps());
    for (int d = 0; d < D; ++d) {
      __m256 x[N];
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r) x[r] = _mm256_broadcast_ss(query[r] + d);
      const float* line = k + d * cache.block_size;
      for (int64_t v = 0; v < vectors; ++v) {
        const __m256 keys = _mm256_loadu_ps(line + v * 8);
#pragma GCC unroll 8
        for (int r = 0; r < N; ++r) {
          float* sum = scores + r * padded + b0 + v * 8;
          _mm256_storeu_ps(sum, _mm256_fmadd_ps(x[r], keys, _mm256_loadu_ps(sum)));
        }
      }
    }
    const __m256 s = _mm256_set1_ps(scale);
    for (int r = 0; r < N; ++r)
      for (int64_t v = 0; v < vectors; ++v) {
        float* sum = scores + r * padded + b0 + v * 8;
        _mm256_storeu_ps(sum, _mm256_mul_ps(_mm256_loadu_ps(sum), s));
      }
  }
}

// Probabilities (row stride `padded`, indexed by key) times values over keys [first, count), added
// to `total`: each token's D values read whole; each block's products summed apart and then added
// up, as `value_tile` does.
template <int D, int N>
void decode_values(const float* probs, int64_t padded, const Cache& cache, int64_t first, int64_t count,
                   float (&total)[N][D]) {
  for (int64_t b0 = first; b0 < count; b0 += cache.block_size) {
    const float* v = cache.values + cache.blocks[b0 / cache.block_size] * cache.stride;
    const int64_t tokens = std::min(cache.block_size, count - b0);
    alignas(32) float acc[N][D] = {};
    for (int64_t t = 0; t < tokens; ++t) {
      __m256 x[N];
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r) x[r] = _mm256_broadcast_ss(probs + r * padded + b0 + t);
#pragma GCC unroll 16
      for (int j = 0; j < D; j += 8) {
        const __m256 values = _mm256_loadu_ps(v + t * D + j);
#pragma GCC unroll 8
        for (int r = 0; r < N; ++r) _mm256_store_ps(acc[r] + j, _mm256_fmadd_ps(x[r], values, _mm256_load_ps(acc[r] + j)));
      }
    }
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < D; j += 8)
        _mm256_storeu_ps(total[r] + j, _mm256_add_ps(_mm256_loadu_ps(total[r] + j), _mm256_load_ps(acc[r] + j)));
  }
}

// A decode tile: N rows' softmaxes and undivided outputs over keys [first, last), row r's over those
// before visible[r].
template <int D, int N>
void decode_tile(const float* const (&query)[N], const int64_t (&visible)[N], const Cache& cache, int64_t first,
                 int64_t last, float scale, float* scores, int64_t widest, Softmax (&softmax)[N], float (&total)[N][D]) {
  decode_scores<D, N>(query, cache, first, last, scale, scores, widest);
  for (int r = 0; r < N; ++r)
    softmax[r] = softmax_row(scores + r * widest + first, std::min(last, visible[r]) - first, last - first);
  decode_values<D, N>(scores, widest, cache, first, last, total);
}

template <int D>
void attend(at::Tensor& output, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const Step& step, float scale, const at::Tensor& block_table) {
  const int64_t heads = query.size(1), group = heads / key_cache.size(1);
  const Split split = llmopt_attention::split(step);
  if (!split.decodes.empty())
    attend_decodes<float, D, kDecodeRows>(output, query, key_cache, value_cache, step, split.decodes, scale, block_table,
                                          row_width(step, split.decodes, kKeys),
                                          [](auto rows, auto&&... args) { decode_tile<D, decltype(rows)::value>(args...); });
  if (split.prompts.empty()) return;
  const int64_t widest = row_width(step, split.prompts, kKeys);  // a row of scores, keys rounded up to a tile
  const float* keys = key_cache.data_ptr<float>();
  const float* values = value_cache.data_ptr<float>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float* q = query.data_ptr<float>();
  float* o = output.data_ptr<float>();
  for_query_tiles(step, split.prompts, heads, kRows, [&] {
    return [&, scores = std::vector<float>(kRows * widest)](const Tile& tile) mutable {
      const int64_t g = tile.head / group;
      const Cache cache{keys + g * key_cache.stride(1), values + g * value_cache.stride(1), key_cache.stride(0),
                        table + tile.sequence * block_table.stride(0), key_cache.size(2)};
      query_tile<D>(tile.rows, q + tile.first * query.stride(0) + tile.head * query.stride(1), query.stride(0), cache,
                    tile.position, scale, scores.data(), widest, o + tile.first * output.stride(0) + tile.head * output.stride(1),
                    output.stride(0));
    };
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmopt, m) { m.def(llmopt_attention::kSchema); }
TORCH_LIBRARY_IMPL(llmopt, CPU, m) {
  m.impl("prefill_attention", &llmopt_attention::prefill_attention<at::kFloat, kKeys, attend<64>, attend<128>>);
}
