// cpu_attention.cpp's scores and weighted sums for CPUs with AVX-512 (Skylake-SP and later
// Xeons, Zen 4 and later): twice the lanes per fma and per widening of an fp16 K/V row, for the
// units whose many queries share each K/V row (a prefill chunk's rows; cpu_attention.cpp says
// which and why).
//
// The same bits as the AVX2 kernels (cpu_attention_keys.h), which is what lets either run a
// process's rows (tests/kernels/test_cpu_attention.py): a score is each key's fma chain over
// d in steps of 8 into 8 lanes, summed ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), so
// a 512-bit register holds two keys' 8 lanes side by side (a "pair": keys 2i and 2i + 1) and
// reduces four pairs with 128-bit-lane shuffles in that order; a weighted sum is one fma chain
// per output lane over the keys in order, whatever the vector width.
//
// Only intrinsics and this file's own functions run under the AVX-512 target: an inline
// function from a shared header compiled here could be merged with, and replace, its AVX2 copy
// (so the fp16 pool is read as raw uint16_t, not at::Half).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu_attention_query.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")

namespace {

using eagleserve_cpu::AttentionQuery;
using eagleserve_cpu::kKeyChunk;
using eagleserve_cpu::kMaxWideDim;

constexpr int64_t kPrefetchKeys = 32;  // as cpu_attention_keys.h's
constexpr int kShare = 4;              // queries per shared K or V row (their accumulators)
using Share = eagleserve_cpu::Share<kShare>;

// 8 consecutive values of a K/V row as fp32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Values [d, d + 8) of rows a (lanes 0-7) and b (lanes 8-15): one widening for both.
inline __m512 load_pair(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
inline __m512 load_pair(const uint16_t* a, const uint16_t* b) {
  const __m256i both = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_cvtph_ps(both);
}
// 16 consecutive values of a V row.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename KV>
inline void prefetch_key(const KV* buf, int64_t slot_stride, const int64_t* slots, int64_t j,
                         int64_t n, int64_t D) {
  if (j + kPrefetchKeys >= n) return;
  const char* p = reinterpret_cast<const char*>(buf + slots[j + kPrefetchKeys] * slot_stride);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(KV)); b += 64)
    _mm_prefetch(p + b, _MM_HINT_T0);
}

// AVX2's _mm256_hadd_ps per 128-bit lane: [a0 + a1, a2 + a3, b0 + b1, b2 + b3].
inline __m512 hadd(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// The scores of keys 0..7 from their pairs' lanes (pair i: keys 2i, 2i + 1), each summed in
// the AVX2 order, times scale, into s[0..8).
inline void reduce8(const __m512 (&pair)[4], float scale, float* s) {
  // u's 128-bit lanes: the x0..x3 sums of keys 0, 2, 4, 6; their x4..x7 sums; the same of
  // keys 1, 3, 5, 7.
  const __m512 u = hadd(hadd(pair[0], pair[1]), hadd(pair[2], pair[3]));
  const __m128 even = _mm_add_ps(_mm512_castps512_ps128(u), _mm512_extractf32x4_ps(u, 1));
  const __m128 odd = _mm_add_ps(_mm512_extractf32x4_ps(u, 2), _mm512_extractf32x4_ps(u, 3));
  const __m128 sc = _mm_set1_ps(scale);
  _mm_storeu_ps(s, _mm_mul_ps(_mm_unpacklo_ps(even, odd), sc));
  _mm_storeu_ps(s + 4, _mm_mul_ps(_mm_unpackhi_ps(even, odd), sc));
}

// One key alone: AVX2's score_keys<1>.
template <typename KV>
inline float score_one(const float* q, const KV* k, int64_t D, float scale) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  alignas(32) float x[8];
  _mm256_store_ps(x, acc);
  return (((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]))) * scale;
}

// Keys [j, j + 8) of slots for Q queries at once; qq[r] is query r's q with each 8 values
// repeated (lanes 0-7 and 8-15 of a 512-bit load), so one fma serves both keys of a pair.
template <int Q, typename KV>
inline void score8(const float* const* qq, const KV* k_buf, int64_t slot_stride,
                   const int64_t* slots, int64_t j, int64_t n, int64_t D, float scale,
                   float* const* s) {
  for (int i = 0; i < 8; ++i) prefetch_key(k_buf, slot_stride, slots, j + i, n, D);
  const KV* k[8];
  for (int i = 0; i < 8; ++i) k[i] = k_buf + slots[j + i] * slot_stride;
  __m512 acc[Q][4];
  for (int r = 0; r < Q; ++r)
    for (int p = 0; p < 4; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m512 kp[4];
    for (int p = 0; p < 4; ++p) kp[p] = load_pair(k[2 * p] + d, k[2 * p + 1] + d);
    for (int r = 0; r < Q; ++r) {
      const __m512 qd = _mm512_loadu_ps(qq[r] + 2 * d);
      for (int p = 0; p < 4; ++p) acc[r][p] = _mm512_fmadd_ps(qd, kp[p], acc[r][p]);
    }
  }
  for (int r = 0; r < Q; ++r) reduce8(acc[r], scale, s[r] + j);
}

template <int Q, typename KV>
void score_shared(const float* const* qq, const KV* k_buf, int64_t slot_stride,
                  const int64_t* slots, int64_t j, int64_t j1, int64_t n, int64_t D, float scale,
                  float* const* s) {
  for (; j + 8 <= j1; j += 8) score8<Q>(qq, k_buf, slot_stride, slots, j, n, D, scale, s);
}

template <typename KV>
void scores(const AttentionQuery* qs, int64_t count, const KV* k_buf, int64_t slot_stride,
            int64_t D, float scale, float* out, int64_t stride) {
  alignas(64) float qq[kShare][2 * kMaxWideDim];
  int64_t max_n = 0;
  for (int64_t i = 0; i < count; ++i) max_n = std::max(max_n, qs[i].n);
  for (int64_t j0 = 0; j0 < max_n; j0 += kKeyChunk) {
    for (int64_t i = 0; i < count;) {
      Share sh;
      const int64_t next = eagleserve_cpu::share_chunk(qs, count, i, j0, sh);
      const int64_t* slots = qs[i].slots;
      const float* qp[kShare];
      float* s[kShare];
      for (int r = 0; r < sh.m; ++r) {
        const float* q = qs[sh.member[r]].q;
        for (int64_t d = 0; d < D; d += 8) {
          std::copy_n(q + d, 8, qq[r] + 2 * d);
          std::copy_n(q + d, 8, qq[r] + 2 * d + 8);
        }
        qp[r] = qq[r];
        s[r] = out + sh.member[r] * stride;
      }
      // The keys all members see, 8 at a time for all of them; then each one's rest alone.
      const int64_t shared_end = j0 + (sh.common - j0) / 8 * 8;
      switch (sh.m) {
        case 4: score_shared<4>(qp, k_buf, slot_stride, slots, j0, shared_end, sh.n, D, scale, s); break;
        case 3: score_shared<3>(qp, k_buf, slot_stride, slots, j0, shared_end, sh.n, D, scale, s); break;
        case 2: score_shared<2>(qp, k_buf, slot_stride, slots, j0, shared_end, sh.n, D, scale, s); break;
        case 1: score_shared<1>(qp, k_buf, slot_stride, slots, j0, shared_end, sh.n, D, scale, s); break;
        default: break;
      }
      for (int r = 0; r < sh.m; ++r) {
        const AttentionQuery& x = qs[sh.member[r]];
        int64_t j = shared_end;
        for (; j + 8 <= sh.end[r]; j += 8)
          score8<1>(qp + r, k_buf, slot_stride, x.slots, j, x.n, D, scale, s + r);
        for (; j < sh.end[r]; ++j) {
          prefetch_key(k_buf, slot_stride, x.slots, j, x.n, D);
          s[r][j] = score_one(x.q, k_buf + x.slots[j] * slot_stride, D, scale);
        }
      }
      i = next;
    }
  }
}

// out[q][d0, d0 + 16C) += sum over keys [j0, j1) in order of p_j * v_j for Q queries, each V
// row loaded (and widened) once for all of them; one fma chain per lane, carried across calls
// through `out` (an exact fp32 store and load).
template <int Q, int C, typename KV>
inline void weigh16(const float* const* p, const KV* v_buf, int64_t slot_stride,
                    const int64_t* slots, int64_t j0, int64_t j1, int64_t n, int64_t d0,
                    bool first, float* const* out) {
  __m512 acc[Q][C];
  for (int r = 0; r < Q; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out[r] + d0 + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    prefetch_key(v_buf + d0, slot_stride, slots, j, n, 16 * C);
    const KV* v = v_buf + slots[j] * slot_stride + d0;
    __m512 vc[C];
    for (int c = 0; c < C; ++c) vc[c] = load16(v + 16 * c);
    for (int r = 0; r < Q; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r][j]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(pj, vc[c], acc[r][c]);
    }
  }
  for (int r = 0; r < Q; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[r] + d0 + 16 * c, acc[r][c]);
}

// The same over 8 lanes: a head dim that is not a multiple of 16.
template <typename KV>
inline void weigh8(const float* p, const KV* v_buf, int64_t slot_stride, const int64_t* slots,
                   int64_t j0, int64_t j1, int64_t d0, bool first, float* out) {
  __m256 acc = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + d0);
  for (int64_t j = j0; j < j1; ++j)
    acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v_buf + slots[j] * slot_stride + d0), acc);
  _mm256_storeu_ps(out + d0, acc);
}

template <int Q, typename KV>
void weigh_rows(const float* const* p, const KV* v_buf, int64_t slot_stride,
                const int64_t* slots, int64_t j0, int64_t j1, int64_t n, int64_t D,
                float* const* out) {
  if (j1 <= j0) return;
  const bool first = j0 == 0;
  int64_t d = 0;
  for (; d + 64 <= D; d += 64)
    weigh16<Q, 4>(p, v_buf, slot_stride, slots, j0, j1, n, d, first, out);
  for (; d + 16 <= D; d += 16)
    weigh16<Q, 1>(p, v_buf, slot_stride, slots, j0, j1, n, d, first, out);
  for (; d < D; d += 8)
    for (int r = 0; r < Q; ++r) weigh8(p[r], v_buf, slot_stride, slots, j0, j1, d, first, out[r]);
}

template <typename KV>
void values(const AttentionQuery* qs, int64_t count, const KV* v_buf, int64_t slot_stride,
            int64_t D, const float* probs, int64_t stride) {
  int64_t max_n = 0;
  for (int64_t i = 0; i < count; ++i) max_n = std::max(max_n, qs[i].n);
  for (int64_t j0 = 0; j0 < max_n; j0 += kKeyChunk) {
    for (int64_t i = 0; i < count;) {
      Share sh;
      const int64_t next = eagleserve_cpu::share_chunk(qs, count, i, j0, sh);
      const float* p[kShare];
      float* out[kShare];
      for (int r = 0; r < sh.m; ++r) {
        p[r] = probs + sh.member[r] * stride;
        out[r] = qs[sh.member[r]].out;
      }
      const int64_t* slots = qs[i].slots;
      switch (sh.m) {
        case 4: weigh_rows<4>(p, v_buf, slot_stride, slots, j0, sh.common, sh.n, D, out); break;
        case 3: weigh_rows<3>(p, v_buf, slot_stride, slots, j0, sh.common, sh.n, D, out); break;
        case 2: weigh_rows<2>(p, v_buf, slot_stride, slots, j0, sh.common, sh.n, D, out); break;
        case 1: weigh_rows<1>(p, v_buf, slot_stride, slots, j0, sh.common, sh.n, D, out); break;
        default: break;
      }
      for (int r = 0; r < sh.m; ++r)  // the keys past the shared ones, alone
        weigh_rows<1>(p + r, v_buf, slot_stride, qs[sh.member[r]].slots, sh.common, sh.end[r],
                      qs[sh.member[r]].n, D, out + r);
      i = next;
    }
  }
}

}  // namespace

namespace eagleserve_cpu {

bool avx512_attention_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

void attention_scores_avx512(const AttentionQuery* qs, int64_t count, const void* k_buf,
                             bool half, int64_t slot_stride, int64_t D, float scale,
                             float* scores_out, int64_t stride) {
  if (half)
    scores(qs, count, static_cast<const uint16_t*>(k_buf), slot_stride, D, scale, scores_out, stride);
  else
    scores(qs, count, static_cast<const float*>(k_buf), slot_stride, D, scale, scores_out, stride);
}

void attention_values_avx512(const AttentionQuery* qs, int64_t count, const void* v_buf,
                             bool half, int64_t slot_stride, int64_t D, const float* probs,
                             int64_t stride) {
  if (half)
    values(qs, count, static_cast<const uint16_t*>(v_buf), slot_stride, D, probs, stride);
  else
    values(qs, count, static_cast<const float*>(v_buf), slot_stride, D, probs, stride);
}

}  // namespace eagleserve_cpu

#pragma GCC pop_options
