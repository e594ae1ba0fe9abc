// What llmopt's two prefill attention kernels share (`prefill_attention.cpp`, bf16 with AVX-512 BF16;
// `avx2_prefill_attention.cpp`, float32 with AVX2): the op they register in place of vLLM's CPU
// attention, with its arguments; which calls are theirs (causal attention without extras over
// vLLM's `vec` cache layout, head size 64 or 128); vLLM's kernel for every other call, with its own
// arguments; which of a step's sequences take the decode tiles (fewer than LLMOPT_MIN_QUERIES
// queries: a decode, with the tokens speculated for it to verify) and which the query tiles (a
// prompt); and how both are shared among threads.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace llmopt_attention {

// kernels.ATTENTION_MIN_QUERIES: a sequence with this many queries takes the query tiles, one with
// fewer the decode tiles
constexpr int64_t kMinQuery = LLMOPT_MIN_QUERIES;

constexpr const char* kSchema =
    "prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor(a!) output, "
    "Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, Tensor? alibi_slopes, "
    "int sliding_window, Tensor block_table, float softcap, Tensor scheduler_metadata, Tensor? s_aux, "
    "Tensor? dynamic_causal, float k_scale, float v_scale, str kv_cache_dtype) -> ()";

// A step's sequences: queries [starts[s], starts[s + 1]) of the step, each seeing lengths[s] keys.
struct Step {
  const int32_t* starts;
  const int32_t* lengths;
  int64_t sequences;
};

// A step's sequences by the tiles they take: `decodes`, fewer than kMinQuery queries each (a decode,
// with the tokens speculated for it to verify; or a prompt, or its last chunk, that short), the
// decode tiles, which read the cache in place, `Rows` of a KV head's rows at a time (the first pass
// from memory, the others from the processor's caches; a query tile would copy the whole context
// for a few rows); `prompts`, kMinQuery or more, the query tiles. A sequence without queries takes
// neither.
struct Split {
  std::vector<int64_t> decodes, prompts;
};

inline Split split(const Step& step) {
  Split out;
  for (int64_t s = 0; s < step.sequences; ++s) {
    const int64_t queries = step.starts[s + 1] - step.starts[s];
    if (queries > 0) (queries < kMinQuery ? out.decodes : out.prompts).push_back(s);
  }
  return out;
}

// The longest context of `sequences`, in keys rounded up to a tile of `keys`: a row of scores.
inline int64_t row_width(const Step& step, const std::vector<int64_t>& sequences, int64_t keys) {
  int64_t most = 0;
  for (const int64_t s : sequences) most = std::max<int64_t>(most, (step.lengths[s] + keys - 1) / keys * keys);
  return most;
}

// Up to `rows` queries of one head: the step's queries [first, first + rows), the first at
// `position` in its sequence.
struct Tile {
  int64_t sequence, head, first, rows, position;
};

inline void vllm_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           at::Tensor& output, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           double scale, bool causal, const std::optional<at::Tensor>& alibi_slopes,
                           int64_t sliding_window, const at::Tensor& block_table, double softcap,
                           const at::Tensor& scheduler_metadata, const std::optional<at::Tensor>& s_aux,
                           const std::optional<at::Tensor>& dynamic_causal, double k_scale, double v_scale,
                           const std::string& kv_cache_dtype) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("_C::cpu_attention_with_kv_cache", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&,
                      const at::Tensor&, double, bool, const std::optional<at::Tensor>&, int64_t, const at::Tensor&,
                      double, const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                      double, double, const std::string&)>();
  op.call(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal, alibi_slopes,
          sliding_window, block_table, softcap, scheduler_metadata, s_aux, dynamic_causal, k_scale, v_scale,
          kv_cache_dtype);
}

// The step, if the kernel runs this call: every tensor of `dtype`, vLLM's `vec` layout with blocks
// of a multiple of `keys` tokens, query rows on 32-bit boundaries, no sequence with more queries than
// keys or more keys than its blocks hold.
inline std::optional<Step> kernels_step(const at::Tensor& query, const at::Tensor& key_cache,
                                        const at::Tensor& value_cache, const at::Tensor& output,
                                        const at::Tensor& query_start_loc, const at::Tensor& seq_lens, bool causal,
                                        const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                                        const at::Tensor& block_table, double softcap,
                                        const std::optional<at::Tensor>& s_aux,
                                        const std::optional<at::Tensor>& dynamic_causal,
                                        const std::string& kv_cache_dtype, at::ScalarType dtype, int64_t keys) {
  const int64_t head_size = query.dim() == 3 ? query.size(2) : 0;
  const auto of_dtype = [dtype](const at::Tensor& t) { return t.scalar_type() == dtype; };
  const bool ours =
      causal && !alibi_slopes.has_value() && sliding_window < 0 && softcap == 0.0 && !s_aux.has_value() &&
      !dynamic_causal.has_value() && kv_cache_dtype == "auto" && (head_size == 64 || head_size == 128) &&
      of_dtype(query) && of_dtype(key_cache) && of_dtype(value_cache) && of_dtype(output) && key_cache.dim() == 4 &&
      value_cache.dim() == 4 && key_cache.size(2) % keys == 0 && key_cache.size(3) == head_size &&
      key_cache.stride(3) == 1 && key_cache.stride(2) == head_size && value_cache.stride(3) == 1 &&
      value_cache.stride(2) == head_size && key_cache.stride(0) == value_cache.stride(0) &&
      key_cache.stride(1) == value_cache.stride(1) && query.stride(2) == 1 && query.stride(1) == head_size &&
      query.stride(0) * query.element_size() % 4 == 0 && output.dim() == 3 && output.stride(2) == 1 &&
      output.size(0) == query.size(0) && output.size(1) == query.size(1) && output.size(2) == head_size &&
      value_cache.sizes() == key_cache.sizes() && block_table.dim() == 2 &&
      query.size(1) % key_cache.size(1) == 0 && query_start_loc.scalar_type() == at::kInt &&
      seq_lens.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
      seq_lens.is_contiguous() && block_table.stride(1) == 1 && query_start_loc.numel() == seq_lens.numel() + 1 &&
      block_table.size(0) >= seq_lens.numel();
  if (!ours) return std::nullopt;
  const Step step{query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), seq_lens.numel()};
  if (step.sequences > 0 && (step.starts[0] != 0 || step.starts[step.sequences] > query.size(0))) return std::nullopt;
  for (int64_t s = 0; s < step.sequences; ++s) {
    const int64_t queries = step.starts[s + 1] - step.starts[s];
    if (queries < 0 || queries > step.lengths[s] ||
        (step.lengths[s] + keys - 1) / keys * keys > block_table.size(1) * key_cache.size(2))
      return std::nullopt;
  }
  return step;
}

// A kernel's work on a step it runs, for one head size.
using Attend = void (*)(at::Tensor& output, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const Step& step, float scale, const at::Tensor& block_table);

// The op: `Head64` or `Head128` where `kernels_step` gives the call to the kernel (`Dtype`, `Keys`),
// vLLM's kernel elsewhere.
template <at::ScalarType Dtype, int64_t Keys, Attend Head64, Attend Head128>
void prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       at::Tensor& output, const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                       bool causal, const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                       const at::Tensor& block_table, double softcap, const at::Tensor& scheduler_metadata,
                       const std::optional<at::Tensor>& s_aux, const std::optional<at::Tensor>& dynamic_causal,
                       double k_scale, double v_scale, const std::string& kv_cache_dtype) {
  const std::optional<Step> step =
      kernels_step(query, key_cache, value_cache, output, query_start_loc, seq_lens, causal, alibi_slopes,
                   sliding_window, block_table, softcap, s_aux, dynamic_causal, kv_cache_dtype, Dtype, Keys);
  if (!step) {
    return vllm_attention(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal,
                          alibi_slopes, sliding_window, block_table, softcap, scheduler_metadata, s_aux,
                          dynamic_causal, k_scale, v_scale, kv_cache_dtype);
  }
  (query.size(2) == 64 ? Head64 : Head128)(output, query, key_cache, value_cache, *step, static_cast<float>(scale),
                                           block_table);
}

// `body(std::integral_constant<int, N>())` with N = n, at most Max: a tile's row count made a
// compile-time constant, so that its accumulators stay in registers.
template <int Max, typename Body>
void with_rows(int64_t n, Body body) {
  if constexpr (Max > 1) {
    if (n < Max) return with_rows<Max - 1>(n, body);
  }
  body(std::integral_constant<int, Max>());
}

// `work(tile)` for every tile of up to `rows` queries of one head of `sequences`, handed round robin
// so that every thread gets early (short) and late (long) rows of the causal triangle alike;
// `worker()` makes each thread's `work`, with its scratch.
template <typename Worker>
void for_query_tiles(const Step& step, const std::vector<int64_t>& sequences, int64_t heads, int64_t rows,
                     Worker worker) {
  std::vector<Tile> tiles;
  for (const int64_t s : sequences) {
    const int64_t queries = step.starts[s + 1] - step.starts[s];
    for (int64_t first = step.starts[s]; first < step.starts[s + 1]; first += rows) {
      const int64_t n = std::min<int64_t>(rows, step.starts[s + 1] - first);
      const int64_t position = step.lengths[s] - queries + (first - step.starts[s]);
      for (int64_t h = 0; h < heads; ++h) tiles.push_back({s, h, first, n, position});
    }
  }
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tiles.size()));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    auto work = worker();
    for (int64_t thread = begin; thread < end; ++thread)
      for (size_t i = thread; i < tiles.size(); i += threads) work(tiles[i]);
  });
}

// One sequence's cache for one KV head, vLLM's `vec` layout: token t's keys at keys[block(t) * stride +
// d * block_size + t % block_size], its values at values[block(t) * stride + (t % block_size) * D + d].
template <typename T>
struct Cache {
  const T* keys;
  const T* values;
  int64_t stride;
  const int32_t* blocks;
  int64_t block_size;
};

// A row's softmax, unnormalized: its scores less `shift` (the largest), exponentiated, sum to `sum`.
struct Softmax {
  float shift, sum;
};

// Parts each decode's context is cut into, for every KV head: where its
// tiles (sequence by KV head) are few and do not share out evenly among the threads, as SmolLM2's
// three KV heads at batch 1 on two threads (one thread would read two thirds of the cache), enough
// parts of whole blocks that every thread reads as much; their softmaxes are merged after.
inline int64_t decode_parts(int64_t tiles, int64_t threads) {
  return tiles < 4 * threads ? threads / std::gcd(tiles, threads) : 1;
}

// One row's part of a context cut in parts (a query head of one query): its outputs over the part's
// keys, not yet divided, with its softmax.
template <int D>
struct Partial {
  Softmax softmax;
  float total[D];
};

// The outputs of a row from its parts: each part's sum and outputs scaled to the largest
// shift of all (a part with no keys weighs nothing), then divided.
template <typename T, int D>
void merge(const Partial<D>* parts, int64_t count, T* out) {
  float shift = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < count; ++p) shift = std::max(shift, parts[p].softmax.shift);
  float sum = 0, total[D] = {};
  for (int64_t p = 0; p < count; ++p) {
    if (parts[p].softmax.sum == 0) continue;
    const float weight = std::exp(parts[p].softmax.shift - shift);
    sum += weight * parts[p].softmax.sum;
    for (int j = 0; j < D; ++j) total[j] += weight * parts[p].total[j];
  }
  for (int j = 0; j < D; ++j) out[j] = static_cast<T>(total[j] / sum);
}

// The step's `decodes` (sequences of fewer than kMinQuery queries): one tile per sequence and KV
// head, whose rows are its query heads for each of the sequence's queries (query by query), `Rows`
// at a time, its context in `decode_parts` parts. `tile(rows, queries, visible, cache, first, last,
// scale, scores, widest, softmax, total)` gives `rows` (a compile-time count) rows' softmaxes and
// undivided outputs over keys [first, last), row r's over those before `visible[r]` (its causal
// mask: a part may hold none of them), `first` on a block's boundary, with `scores` as scratch (row
// stride `widest`, indexed by key); row r's query at `queries[r]`. A row's bits do not depend on the
// other rows of its tile: a verified token's outputs are those of decoding it alone, where its
// context is cut in the same parts.
template <typename T, int D, int Rows, typename DecodeTile>
void attend_decodes(at::Tensor& output, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const Step& step, const std::vector<int64_t>& decodes, float scale,
                    const at::Tensor& block_table, int64_t widest, DecodeTile tile) {
  const int64_t kv_heads = key_cache.size(1), heads = query.size(1), group = heads / kv_heads;
  const int64_t sequences = static_cast<int64_t>(decodes.size());
  const int64_t block_size = key_cache.size(2), tiles = sequences * kv_heads;
  const int64_t parts = decode_parts(tiles, at::get_num_threads()), items = tiles * parts;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  const T* const q0 = query.data_ptr<T>();
  T* const o0 = output.data_ptr<T>();
  const auto queries = [&](int64_t d) { return step.starts[decodes[d] + 1] - step.starts[decodes[d]]; };
  const auto out = [&](int64_t d, int64_t query_index, int64_t head) {
    return o0 + (step.starts[decodes[d]] + query_index) * output.stride(0) + head * output.stride(1);
  };
  std::vector<int64_t> first_row(sequences + 1, 0);  // each decode's first in `partials`, rows by query and head
  for (int64_t d = 0; d < sequences; ++d) first_row[d + 1] = first_row[d] + queries(d) * heads;
  std::vector<Partial<D>> partials(parts > 1 ? first_row[sequences] * parts : 0);  // by row, part
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(Rows * widest);
    for (int64_t thread = begin; thread < end; ++thread)
      for (int64_t i = thread; i < items; i += threads) {
        const int64_t d = i / parts / kv_heads, g = i / parts % kv_heads, part = i % parts;
        const int64_t s = decodes[d], count = step.lengths[s], rows = queries(d) * group;
        const int64_t blocks = (count + block_size - 1) / block_size;
        const int64_t first = part * blocks / parts * block_size;
        const int64_t last = std::min<int64_t>(count, (part + 1) * blocks / parts * block_size);
        const Cache<T> cache{key_cache.data_ptr<T>() + g * key_cache.stride(1),
                             value_cache.data_ptr<T>() + g * value_cache.stride(1), key_cache.stride(0),
                             block_table.data_ptr<int32_t>() + s * block_table.stride(0), block_size};
        for (int64_t r0 = 0; r0 < rows; r0 += Rows) {
          with_rows<Rows>(std::min<int64_t>(Rows, rows - r0), [&](auto n) {
            constexpr int N = decltype(n)::value;
            const T* q[N];
            int64_t visible[N], query_index[N], head[N];
            for (int r = 0; r < N; ++r) {
              query_index[r] = (r0 + r) / group, head[r] = g * group + (r0 + r) % group;
              q[r] = q0 + (step.starts[s] + query_index[r]) * query.stride(0) + head[r] * query.stride(1);
              visible[r] = count - queries(d) + 1 + query_index[r];
            }
            Softmax softmax[N];
            alignas(64) float total[N][D] = {};
            for (int r = 0; r < N; ++r) softmax[r] = {-std::numeric_limits<float>::infinity(), 0};
            if (first < last) tile(n, q, visible, cache, first, last, scale, scores.data(), widest, softmax, total);
            for (int r = 0; r < N; ++r) {
              if (parts == 1) {
                T* o = out(d, query_index[r], head[r]);
                for (int j = 0; j < D; ++j) o[j] = static_cast<T>(total[r][j] / softmax[r].sum);
                continue;
              }
              Partial<D>& partial = partials[(first_row[d] + query_index[r] * heads + head[r]) * parts + part];
              partial.softmax = softmax[r];
              std::copy(total[r], total[r] + D, partial.total);
            }
          });
        }
      }
  });
  for (int64_t d = 0; parts > 1 && d < sequences; ++d)
    for (int64_t row = 0; row < queries(d) * heads; ++row)
      merge<T, D>(&partials[(first_row[d] + row) * parts], parts, out(d, row / heads, row % heads));
}

}  // namespace llmopt_attention
