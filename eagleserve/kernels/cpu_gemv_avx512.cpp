// cpu_gemv.cpp's tile dots for CPUs with AVX-512 VNNI (Ice Lake and later Xeons, Zen 4 and
// later): 16 columns per vector, and one vpdpbusd per 4 weights of a block where AVX2 needs a
// maddubs and its sums. The integer dots are exact, and the fp32 operations per (row, column)
// are AVX2's, so both ISAs give the same bits (tests/kernels/test_cpu_gemv.py).
//
// Only intrinsics and this file's own functions run under the AVX-512 target: an inline
// function from a header compiled here could be merged with, and replace, its AVX2 copy.

#include <immintrin.h>

#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;
constexpr int64_t kPrefetchBytes = 1536;  // as cpu_gemv.cpp's

// As cpu_gemv.cpp's: block g's weights (wb), d and extra tiles, each stream
// kPrefetchBytes / tile bytes blocks on.
template <bool Q4>
inline void prefetch_ahead(const uint8_t* wb, const uint16_t* d, const void* extra) {
  constexpr int64_t kTileBytes = Q4 ? 256 : 512, kAhead = kPrefetchBytes / kTileBytes;
  for (int64_t b = 0; b < kTileBytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + b), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(d + kAhead * kTile), _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(extra) + kAhead * kTile * (Q4 ? 2 : 4), _MM_HINT_T0);
}

// x bytes [4q, 4q + 4) of a block, in every 32-bit lane.
inline __m512i bcast4(const int8_t* p) {
  return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

// As cpu_gemv.cpp's tile_dots_avx2: out[r * 16 + c] = fma chain over blocks of
// cvt(int32 dot) * (d_w * d_x). q4: the nibbles (u8) against x (s8), plus add_offsets' fma
// chain over blocks of m * xsum (its m tiles are `extra`; each lane's operations are
// add_offsets' 8-lane ones, so the bits are too), computed here in the same pass; q8: x + 128
// (u8, the caller's) against the weights (s8), less 128 * the block's weight sum (`extra`).
template <int R, bool Q4>
void tile_dots(const int8_t* qx, int64_t K, const float* dx, const float* xsum, const uint8_t* w,
               const uint16_t* d, const void* extra, float* out) {
  const int64_t groups = K / kBlock;
  constexpr int64_t kTileBytes = Q4 ? 256 : 512;  // per block
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wb = w + g * kTileBytes;
    prefetch_ahead<Q4>(wb, d + g * kTile,
                       static_cast<const char*>(extra) + g * kTile * (Q4 ? 2 : 4));
    const __m512 dw =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * kTile)));
    if constexpr (Q4) {
      __m512i lo[4], hi[4];
      for (int q = 0; q < 4; ++q) {
        const __m512i b = _mm512_loadu_si512(wb + q * 64);
        lo[q] = _mm512_and_si512(b, lo4);
        hi[q] = _mm512_and_si512(_mm512_srli_epi16(b, 4), lo4);
      }
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(extra) + g * kTile)));
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = qx + r * K + g * kBlock;
        __m512i s = _mm512_setzero_si512();
        for (int q = 0; q < 4; ++q) s = _mm512_dpbusd_epi32(s, lo[q], bcast4(xb + 4 * q));
        for (int q = 0; q < 4; ++q) s = _mm512_dpbusd_epi32(s, hi[q], bcast4(xb + 16 + 4 * q));
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * groups + g]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
        off[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * groups + g]), off[r]);
      }
    } else {
      const __m512i bias = _mm512_loadu_si512(static_cast<const int32_t*>(extra) + g * kTile);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = qx + r * K + g * kBlock;
        __m512i s = _mm512_setzero_si512();
        for (int q = 0; q < 8; ++q) {
          const __m512i ws = _mm512_loadu_si512(wb + q * 64);
          s = _mm512_dpbusd_epi32(s, bcast4(xb + 4 * q), ws);
        }
        s = _mm512_sub_epi32(s, bias);
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * groups + g]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(out + r * kTile, Q4 ? _mm512_add_ps(acc[r], off[r]) : acc[r]);
}

}  // namespace

namespace eagleserve_cpu {

bool avx512_vnni_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

void tile_dots_avx512(bool q4, int rows, const int8_t* qx, int64_t K, const float* dx,
                      const float* xsum, const uint8_t* w, const uint16_t* d, const void* extra,
                      float* out) {
  if (q4) {
    switch (rows) {
      case 4: return tile_dots<4, true>(qx, K, dx, xsum, w, d, extra, out);
      case 3: return tile_dots<3, true>(qx, K, dx, xsum, w, d, extra, out);
      case 2: return tile_dots<2, true>(qx, K, dx, xsum, w, d, extra, out);
      default: return tile_dots<1, true>(qx, K, dx, xsum, w, d, extra, out);
    }
  }
  switch (rows) {
    case 4: return tile_dots<4, false>(qx, K, dx, xsum, w, d, extra, out);
    case 3: return tile_dots<3, false>(qx, K, dx, xsum, w, d, extra, out);
    case 2: return tile_dots<2, false>(qx, K, dx, xsum, w, d, extra, out);
    default: return tile_dots<1, false>(qx, K, dx, xsum, w, d, extra, out);
  }
}

}  // namespace eagleserve_cpu

#pragma GCC pop_options
