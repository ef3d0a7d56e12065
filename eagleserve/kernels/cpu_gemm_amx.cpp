// cpu_gemv.cpp's tile dots for 16 rows at once on CPUs with AMX-INT8 (Sapphire Rapids and
// later Xeons): a prefill chunk's rows, a batch's decodes, a batched verify. One tile multiply
// per 32-block gives the 16 x 16 int32 dots that AVX-512 VNNI needs 8 vpdpbusd a row for; the
// fp32 operations per (row, column) after it are cpu_gemv_avx512.cpp's, in the same block
// order, so a row's bits do not depend on which of the three ISAs computed it
// (tests/kernels/test_cpu_gemv.py). The weights stay in cpu_gemv.cpp's column tiles: a q8
// block's tile is already AMX's B layout (4 consecutive weights of each of 16 columns per
// 64-byte row), a q4 block's nibbles are unpacked into it once for the 16 rows.
//
// AMX needs the kernel's permission (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, once per process)
// and a tile configuration on each thread that runs it (amx_begin / amx_end around a thread's
// share of a call: other libraries, oneDNN among them, load their own and release it).

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

// A compiler without AMX intrinsics (GCC before 11) builds the rest of the kernels and this
// file's answer that AMX is not there.
#if defined(__has_include) && __has_include(<amxtileintrin.h>)
#define EAGLESERVE_AMX 1
#endif

#ifdef EAGLESERVE_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;  // columns per tile; also the rows of one AMX pass
constexpr int64_t kChunk = 8;  // blocks whose int32 dots are held before the fp32 chains
// Tiles: 0-3 C, 4 and 6 A, 5 and 7 B (GCC's _tile_* macros take the register number as a
// literal, hence a macro).
#define AMX_BLOCK(C, A, B, j)                                   \
  do {                                                          \
    _tile_zero(C);                                              \
    _tile_loadd(A, a0 + (j) * kBlock, K);                       \
    _tile_loadd(B, b0 + (j) * kBStride, 64);                    \
    if constexpr (Q4) _tile_dpbsud(C, A, B);                    \
    else _tile_dpbusd(C, A, B);                                 \
  } while (0)

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C: 16 rows of 16 int32; A: 16 rows of one 32-byte block of x; B: the block's 8 rows of
// 4 weights x 16 columns.
TileConfig make_config() {
  TileConfig cfg;
  for (int c = 0; c < 4; ++c) cfg.rows[c] = 16, cfg.colsb[c] = 64;
  for (int a = 4; a < 8; a += 2) cfg.rows[a] = 16, cfg.colsb[a] = kBlock;
  for (int b = 5; b < 8; b += 2) cfg.rows[b] = 8, cfg.colsb[b] = 64;
  return cfg;
}

// out[r * 16 + c] for 16 rows: per block g, in block order, acc = fma(cvt(dot), d_w * d_x,
// acc) and (q4) off = fma(m, xsum, off); then acc + off. q4: x (s8) against the nibbles (u8);
// q8: x + 128 (u8, the caller's) against the weights (s8), less 128 * the weight sums.
// A chunk's blocks are multiplied four at a time on four C tiles (a multiply need not wait
// for the last one's result to be stored), then its fp32 chains run from the stored dots.
// The fp32 steps of `n` stored blocks (g0 on) for each of the 16 rows, carried on from acc and
// off (from zero for the first chunk). `n` is a constant for a whole chunk, so that loop unrolls.
template <bool Q4, typename Count>
inline void fp32_chains(Count n, int64_t g0, int64_t groups, const int32_t (*dots)[kTile][kTile],
                        const __m512* dw, const __m512* m, const __m512i* bias, const float* dx,
                        const float* xsum, float (*acc)[kTile], float (*off)[kTile]) {
  for (int r = 0; r < kTile; ++r) {
    __m512 a = _mm512_setzero_ps(), o = _mm512_setzero_ps();
    if (g0 > 0) a = _mm512_load_ps(acc[r]), o = _mm512_load_ps(off[r]);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t g = g0 + j;
      __m512i s = _mm512_load_si512(dots[j][r]);
      if constexpr (!Q4) s = _mm512_sub_epi32(s, bias[j]);
      const __m512 scale = _mm512_mul_ps(dw[j], _mm512_set1_ps(dx[r * groups + g]));
      a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, a);
      if constexpr (Q4) o = _mm512_fmadd_ps(m[j], _mm512_set1_ps(xsum[r * groups + g]), o);
    }
    _mm512_store_ps(acc[r], a);
    _mm512_store_ps(off[r], o);
  }
}

template <bool Q4>
void dots16(const int8_t* qx, int64_t K, const float* dx, const float* xsum, const uint8_t* w,
            const uint16_t* d, const void* extra, float* out) {
  const int64_t groups = K / kBlock;
  constexpr int64_t kTileBytes = Q4 ? 256 : 512;  // per block
  constexpr int64_t kBStride = Q4 ? 512 : kTileBytes;
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  alignas(64) int32_t dots[kChunk][kTile][kTile];
  alignas(64) uint8_t unpacked[kChunk][8][64];  // q4: the chunk's B tiles
  alignas(64) float acc[kTile][kTile], off[kTile][kTile];
  for (int64_t g0 = 0; g0 < groups; g0 += kChunk) {
    const int64_t n = std::min(kChunk, groups - g0);
    __m512 dw[kChunk], m[kChunk];
    __m512i bias[kChunk];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t g = g0 + j;
      if constexpr (Q4) {
        for (int q = 0; q < 4; ++q) {
          const __m512i b = _mm512_loadu_si512(w + g * kTileBytes + q * 64);
          _mm512_store_si512(unpacked[j][q], _mm512_and_si512(b, lo4));
          _mm512_store_si512(unpacked[j][4 + q],
                             _mm512_and_si512(_mm512_srli_epi16(b, 4), lo4));
        }
        m[j] = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(extra) + g * kTile)));
      } else {
        bias[j] = _mm512_loadu_si512(static_cast<const int32_t*>(extra) + g * kTile);
      }
      dw[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * kTile)));
    }
    const int8_t* a0 = qx + g0 * kBlock;
    const uint8_t* b0 = Q4 ? unpacked[0][0] : w + g0 * kTileBytes;
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      AMX_BLOCK(0, 4, 5, j);
      AMX_BLOCK(1, 6, 7, j + 1);
      AMX_BLOCK(2, 4, 5, j + 2);
      AMX_BLOCK(3, 6, 7, j + 3);
      _tile_stored(0, dots[j], 64);
      _tile_stored(1, dots[j + 1], 64);
      _tile_stored(2, dots[j + 2], 64);
      _tile_stored(3, dots[j + 3], 64);
    }
    for (; j < n; ++j) {
      AMX_BLOCK(0, 4, 5, j);
      _tile_stored(0, dots[j], 64);
    }
    if (n == kChunk)
      fp32_chains<Q4>(std::integral_constant<int64_t, kChunk>(), g0, groups, dots, dw, m, bias,
                      dx, xsum, acc, off);
    else
      fp32_chains<Q4>(n, g0, groups, dots, dw, m, bias, dx, xsum, acc, off);
  }
  for (int r = 0; r < kTile; ++r) {
    const __m512 a = _mm512_load_ps(acc[r]);
    _mm512_storeu_ps(out + r * kTile, Q4 ? _mm512_add_ps(a, _mm512_load_ps(off[r])) : a);
  }
}

}  // namespace

namespace eagleserve_cpu {

bool amx_int8_supported() {
  static const bool ok = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = edx & (1u << 24), int8 = edx & (1u << 25);
    if (!tile || !int8) return false;
    // Linux keeps AMX's 8 KB of tile state off until a process asks for it.
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

void amx_begin() {
  static const TileConfig cfg = make_config();
  _tile_loadconfig(&cfg);
}

void amx_end() { _tile_release(); }

void tile_dots_amx16(bool q4, const int8_t* qx, int64_t K, const float* dx, const float* xsum,
                     const uint8_t* w, const uint16_t* d, const void* extra, float* out) {
  if (q4) return dots16<true>(qx, K, dx, xsum, w, d, extra, out);
  dots16<false>(qx, K, dx, xsum, w, d, extra, out);
}

}  // namespace eagleserve_cpu

#pragma GCC pop_options

#else  // no AMX intrinsics

namespace eagleserve_cpu {

bool amx_int8_supported() { return false; }
void amx_begin() {}
void amx_end() {}
void tile_dots_amx16(bool, const int8_t*, int64_t, const float*, const float*, const uint8_t*,
                     const uint16_t*, const void*, float*) {}

}  // namespace eagleserve_cpu

#endif
