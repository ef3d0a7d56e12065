// The per-key arithmetic of the paged attention (cpu_attention.cpp): K/V row loads (fp32, or
// fp16 widened by F16C), scores, softmax and the weighted sum of values, for one query or for up
// to three that read the same rows. Each query's result is the same sequence of fp32 operations
// whichever of these computes it: that is the attention's row-invariance contract. Included by
// cpu_attention.cpp only, not compiled alone.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace eagleserve_cpu::attention {

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 consecutive K/V values as fp32 lanes; an fp16 pool halves the bytes a long context streams.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A new row into its slot: a copy, or fp32 -> fp16 rounded to nearest even (as torch's .half()).
inline void store_row(const float* src, int64_t n, float* dst) { std::copy_n(src, n, dst); }
inline void store_row(const float* src, int64_t n, at::Half* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = at::Half(src[i]);
}

// How far ahead of the row being read the next K or V row is prefetched, in keys. Without it
// the attention over a long context runs at a fraction of the memory bandwidth: each K/V head
// row is 2-4 cache lines of a slot that holds every KV head, at a stride the hardware
// prefetchers do not run far enough ahead of. Prefetching reads no value: the bits stay.
constexpr int64_t kPrefetchKeys = 32;

// Requests a K/V head row (D values) into the caches.
template <typename KV>
inline void prefetch_row(const KV* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(KV)); b += 64)
    _mm_prefetch(p + b, _MM_HINT_T0);
}

// Prefetches the row slices (D values from buf) kPrefetchKeys after keys [j, j + N) of
// slots, those before its end n.
template <int N, typename KV>
inline void prefetch_ahead(const KV* buf, int64_t slot_stride, const int64_t* slots, int64_t j,
                           int64_t n, int64_t D) {
  for (int i = 0; i < N && j + kPrefetchKeys + i < n; ++i)
    prefetch_row(buf + slots[j + kPrefetchKeys + i] * slot_stride, D);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Scores of keys [j, j + N) of slots (n of them): per key an fma chain over d in order into 8
// lanes x0..x7, summed as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), times scale.
// Eight keys reduce their lanes together (a transpose by hadds, a few shuffles for all eight
// where one key alone takes as many); a single key sums the same pairs in the same order, so
// each key's score is the same whichever N computes it.
template <int N, typename KV>
inline void score_keys(const float* q, const KV* k_buf, int64_t slot_stride,
                       const int64_t* slots, int64_t j, int64_t n, int64_t D, float scale,
                       float* scores) {
  static_assert(N == 1 || N == 8, "one key or eight");
  prefetch_ahead<N>(k_buf, slot_stride, slots, j, n, D);
  slots += j;
  __m256 acc[N];
  const KV* k[N];
  for (int i = 0; i < N; ++i) {
    acc[i] = _mm256_setzero_ps();
    k[i] = k_buf + slots[i] * slot_stride;
  }
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int i = 0; i < N; ++i) acc[i] = _mm256_fmadd_ps(qd, load8(k[i] + d), acc[i]);
  }
  if constexpr (N == 8) {
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),   // keys' x0..x3 sums
                                     _mm256_permute2f128_ps(u0, u1, 0x31));  // and x4..x7 sums
    _mm256_storeu_ps(scores, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
  } else {
    alignas(32) float x[8];
    _mm256_store_ps(x, acc[0]);
    scores[0] = (((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]))) * scale;
  }
}

// score_keys for Q queries that read the same four keys, [j, j + 4): each K row is loaded (and
// widened) once for all Q; a key's lanes are summed in score_keys' order, so the same bits.
template <int Q, typename KV>
inline void score_keys_shared(const float* const* q, const KV* k_buf, int64_t slot_stride,
                              const int64_t* slots, int64_t j, int64_t n, int64_t D,
                              float scale, float* const* scores) {
  prefetch_ahead<4>(k_buf, slot_stride, slots, j, n, D);
  slots += j;
  __m256 acc[Q][4];
  const KV* k[4];
  for (int i = 0; i < 4; ++i) k[i] = k_buf + slots[i] * slot_stride;
  for (int r = 0; r < Q; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qd[Q];
    for (int r = 0; r < Q; ++r) qd[r] = _mm256_loadu_ps(q[r] + d);
    for (int i = 0; i < 4; ++i) {
      const __m256 kd = load8(k[i] + d);
      for (int r = 0; r < Q; ++r) acc[r][i] = _mm256_fmadd_ps(qd[r], kd, acc[r][i]);
    }
  }
  for (int r = 0; r < Q; ++r) {
    // [k0 x0..3, k1 x0..3, k2 x0..3, k3 x0..3 | the same of x4..7], as score_keys<8>'s u0
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]),
                                    _mm256_hadd_ps(acc[r][2], acc[r][3]));
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    _mm_storeu_ps(scores[r], _mm_mul_ps(sum, _mm_set1_ps(scale)));
  }
}

// out[d0, d0 + 8C) += sum over keys j in [j0, j1) in order of p_j * v_j, one fma chain per
// lane carried across calls through `out` (an exact fp32 store and load); C chains in flight,
// each lane's order the same whatever C is and however the keys are split into calls.
template <int C, typename KV>
inline void weigh_values(const float* p, const KV* v_buf, int64_t slot_stride,
                         const int64_t* slots, int64_t j0, int64_t j1, int64_t n, int64_t d0,
                         bool first, float* out) {
  __m256 acc[C];
  for (int c = 0; c < C; ++c)
    acc[c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + d0 + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    prefetch_ahead<1>(v_buf + d0, slot_stride, slots, j, n, 8 * C);
    const __m256 pj = _mm256_set1_ps(p[j]);
    const KV* v = v_buf + slots[j] * slot_stride + d0;
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(pj, load8(v + 8 * c), acc[c]);
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + d0 + 8 * c, acc[c]);
}

// weigh_values for Q queries that read the same keys (one request's rows, a GQA group's heads):
// each V row is loaded (and widened) once for all Q, where each query alone would load it again;
// each query's lanes run the fma chain they run in weigh_values, so the same bits.
template <int Q, int C, typename KV>
inline void weigh_values_shared(const float* const* p, const KV* v_buf, int64_t slot_stride,
                                const int64_t* slots, int64_t j0, int64_t j1, int64_t n,
                                int64_t d0, bool first, float* const* out) {
  __m256 acc[Q][C];
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < C; ++c)
      acc[q][c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out[q] + d0 + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    prefetch_ahead<1>(v_buf + d0, slot_stride, slots, j, n, 8 * C);
    const KV* v = v_buf + slots[j] * slot_stride + d0;
    __m256 pj[Q];
    for (int q = 0; q < Q; ++q) pj[q] = _mm256_set1_ps(p[q][j]);
    for (int c = 0; c < C; ++c) {
      const __m256 vc = load8(v + 8 * c);
      for (int q = 0; q < Q; ++q) acc[q][c] = _mm256_fmadd_ps(pj[q], vc, acc[q][c]);
    }
  }
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[q] + d0 + 8 * c, acc[q][c]);
}

template <int Q, typename KV>
inline void weigh_shared_rows(const float* const* p, const KV* v_buf, int64_t slot_stride,
                              const int64_t* slots, int64_t j0, int64_t j1, int64_t n,
                              int64_t D, float* const* out) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32)
    weigh_values_shared<Q, 4>(p, v_buf, slot_stride, slots, j0, j1, n, d, j0 == 0, out);
  for (; d < D; d += 8)
    weigh_values_shared<Q, 1>(p, v_buf, slot_stride, slots, j0, j1, n, d, j0 == 0, out);
}

// Scores -> probabilities in place (padded with zeros to a multiple of 8); returns 1 / their sum.
inline float softmax_(float* scores, int64_t n) {
  const int64_t padded = (n + 7) / 8 * 8;
  for (int64_t j = n; j < padded; ++j) scores[j] = -std::numeric_limits<float>::infinity();
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < padded; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(scores + j));
  const __m256 mx = _mm256_set1_ps(hmax8(vmax));
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mx));
    _mm256_storeu_ps(scores + j, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  return 1.f / hsum8(vsum);
}

}  // namespace eagleserve_cpu::attention
