// What the paged attention's AVX2 (cpu_attention.cpp) and AVX-512 (cpu_attention_avx512.cpp)
// kernels share: a query, and which queries share each loaded K/V row. Its functions are
// static: each file compiles its own copy under its own target (an inline one could be merged
// into a single copy, AVX-512 instructions and all). Included, not compiled alone.
#pragma once

#include <algorithm>
#include <cstdint>

namespace eagleserve_cpu {

// A query's q and out rows [D] and its visible key slots [0, n), in position order.
struct AttentionQuery {
  const float* q;
  float* out;
  const int64_t* slots;
  int64_t n;
};

constexpr int64_t kKeyChunk = 32;  // keys whose K (or V) rows stay in L1 across the queries

// Up to S queries that read the same K/V rows in one key chunk (a GQA group's heads, one
// request's rows): who they are, the end of each one's keys in the chunk, the keys all of
// them have, [j0, common), and the most keys any of them sees, n.
template <int S>
struct Share {
  int m = 0;
  int64_t member[S], end[S], common = 0, n = 0;
};

// The queries from i on with the slots of i and keys in chunk [j0, j0 + kKeyChunk), up to S
// of them, into sh; returns the query after them.
template <int S>
static int64_t share_chunk(const AttentionQuery* qs, int64_t count, int64_t i, int64_t j0,
                           Share<S>& sh) {
  sh.m = 0;
  sh.common = j0 + kKeyChunk;
  sh.n = 0;
  int64_t next = i;
  for (; next < count && sh.m < S && qs[next].slots == qs[i].slots; ++next) {
    const int64_t j1 = std::min(j0 + kKeyChunk, qs[next].n);
    if (j1 <= j0) continue;
    sh.member[sh.m] = next;
    sh.end[sh.m++] = j1;
    sh.n = std::max(sh.n, qs[next].n);
    sh.common = std::min(sh.common, j1);
  }
  return next;
}

// cpu_attention_avx512.cpp: the AVX2 kernels' scores (times scale, query i's at
// scores + i * stride) and weighted sums (of the probabilities there, unnormalized, into each
// query's out), bit for bit, over an fp32 or fp16 (`half`) pool; head dims up to 256.
constexpr int64_t kMaxWideDim = 256;
bool avx512_attention_supported();
void attention_scores_avx512(const AttentionQuery* qs, int64_t count, const void* k_buf,
                             bool half, int64_t slot_stride, int64_t D, float scale,
                             float* scores, int64_t stride);
void attention_values_avx512(const AttentionQuery* qs, int64_t count, const void* v_buf,
                             bool half, int64_t slot_stride, int64_t D, const float* probs,
                             int64_t stride);

}  // namespace eagleserve_cpu
