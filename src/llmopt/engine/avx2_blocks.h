// What llmopt's AVX2 linear kernels (`avx2_int8_linear.cpp`, `avx2_bf16_linear.cpp`) share: weights
// packed in blocks of 16 output channels, each thread taking whole blocks; rows taken a chunk at a
// time so a chunk's inputs stay in L2 while the thread's blocks pass; and inside a chunk, tiles of
// up to 6 rows that share each weight load (12 sums, 2 weights and 1 input: 15 of the 16 vector
// registers).

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace llmopt_avx2 {

constexpr int64_t kBlockN = 16;     // output channels in one packed block: two vectors of 8 sums
constexpr int64_t kTileRows = 6;    // rows sharing one weight load
constexpr int64_t kChunkRows = 48;  // rows whose inputs stay in L2 while a thread's blocks pass

// One row's 16 outputs plus the bias, if any, stored to c: only the valid channels at the layer's edge.
inline void store_row(__m256 c0, __m256 c1, const float* bias, float* c, int64_t valid) {
  if (bias) c0 = _mm256_add_ps(c0, _mm256_loadu_ps(bias)), c1 = _mm256_add_ps(c1, _mm256_loadu_ps(bias + 8));
  if (valid == kBlockN) {
    _mm256_storeu_ps(c, c0);
    _mm256_storeu_ps(c + 8, c1);
    return;
  }
  alignas(32) float lanes[kBlockN];
  _mm256_store_ps(lanes, c0);
  _mm256_store_ps(lanes + 8, c1);
  std::memcpy(c, lanes, valid * sizeof(float));
}

// tile(std::integral_constant<int, ROWS>, first row) for each run of up to kTileRows of m rows:
// the tile's height is a constant, so its sums stay in registers.
template <class Tile>
inline void for_tiles(int64_t m, Tile&& tile) {
  for (int64_t m0 = 0; m0 < m; m0 += kTileRows) {
    switch (std::min(kTileRows, m - m0)) {
      case 1: tile(std::integral_constant<int, 1>{}, m0); break;
      case 2: tile(std::integral_constant<int, 2>{}, m0); break;
      case 3: tile(std::integral_constant<int, 3>{}, m0); break;
      case 4: tile(std::integral_constant<int, 4>{}, m0); break;
      case 5: tile(std::integral_constant<int, 5>{}, m0); break;
      default: tile(std::integral_constant<int, 6>{}, m0); break;
    }
  }
}

// block(first row, rows, first channel, valid channels) for each chunk of m rows and each block of
// n channels, the blocks shared out among the threads.
template <class Block>
inline void for_blocks(int64_t m, int64_t n, Block&& block) {
  at::parallel_for(0, (n + kBlockN - 1) / kBlockN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += kChunkRows) {
      const int64_t chunk = std::min(kChunkRows, m - m0);
      for (int64_t nb = begin; nb < end; ++nb) block(m0, chunk, nb * kBlockN, std::min(kBlockN, n - nb * kBlockN));
    }
  });
}

}  // namespace llmopt_avx2
