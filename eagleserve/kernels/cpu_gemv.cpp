// y = x @ W.T for GGUF-blocked weights on x86 CPUs (AVX2 + FMA; AVX-512 VNNI in
// cpu_gemv_avx512.cpp; AMX-INT8 for each 16 rows in cpu_gemm_amx.cpp), as llama.cpp computes
// these types: each 32-block of a row of x is quantized to int8 (scale max|x| / 127), block dot
// products run in integers, and each block's sum is scaled by d_w * d_x in fp32.
//
// Weights come in column tiles (cpu_ext.pack_q4 / pack_q8 build them once at load): 16 output
// columns per tile, N padded with zero columns to a multiple of 16, and per (tile, block) the
// bytes of 4 consecutive weights of each of the 16 columns side by side, so that one vector
// instruction computes a 4-weight dot product for 8 (AVX2) or 16 (AVX-512) columns at once and
// a column's sums land in its own lane (no horizontal sums):
// - q4: uint8 [T, G, 4, 16, 4]; [t, g, q, c, i] = ggml block byte 4q + i of column 16t + c:
//       weight 4q + i in its low nibble, weight 16 + 4q + i in its high one; w = d * q + m,
//       q in 0..15 (Q4_0 is m = -8d); the m terms use the exact fp32 block sums of x;
// - q8: int8 [T, G, 8, 16, 4]; [t, g, q, c, i] = weight 4q + i of column 16t + c; w = d * q;
//       with the block sums of the weights times 128, int32 [T, G, 16] (AVX-512 reads x + 128
//       as unsigned bytes and takes them off);
// - d (and m): fp16 [T, G, 16] (ggml stores them so; read at 2 bytes, computed in fp32).
//
// Invariant: every output y[r, n] is computed by the same sequence of operations whatever M
// is, whichever row pass holds r and whichever thread runs its tile: the integer dots are
// exact, d_w * d_x is one rounded product, the block terms are summed by an fma chain in block
// order, the m terms by another, and the two are added. So a row's result does not depend on
// the batch it is computed in: a k-token verify reproduces k decodes bit for bit. The ISA is
// chosen once per process (the three sum their integer dots in different groupings but all
// exactly, so they agree bit for bit too; AMX's 16-row passes and VNNI's 4-row ones may split
// one call's rows). (Build without -ffast-math.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_kernels.h"

namespace eagleserve_cpu {  // cpu_gemv_avx512.cpp
bool avx512_vnni_supported();
void tile_dots_avx512(bool q4, int rows, const int8_t* qx, int64_t K, const float* dx,
                      const float* xsum, const uint8_t* w, const uint16_t* d, const void* extra,
                      float* out);
}  // namespace eagleserve_cpu

namespace eagleserve_cpu {  // cpu_gemm_amx.cpp
bool amx_int8_supported();
void amx_begin();
void amx_end();
void tile_dots_amx16(bool q4, const int8_t* qx, int64_t K, const float* dx, const float* xsum,
                     const uint8_t* w, const uint16_t* d, const void* extra, float* out);
}  // namespace eagleserve_cpu

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;  // columns per tile
constexpr int kRowsPerPass = 4;  // rows sharing one unpack of each weight block
// A batch-1 GEMV waits on memory, and the hardware prefetcher alone does not run far enough
// ahead to hide the extra rows' integer dots behind the weight stream: each block prefetches
// the weights this many bytes further on (the next tile's, past a tile's end: a thread's tiles
// are contiguous) and its scale tiles as many blocks ahead.
constexpr int64_t kPrefetchBytes = 1536;
constexpr int kAmxRows = 16;  // rows of one AMX pass (cpu_gemm_amx.cpp)
// The AVX-512 VNNI kernels where the CPU has them, and AMX's for 16 rows at a time where it
// has that too; switched only through gemv_isa.
bool use_avx512 = eagleserve_cpu::avx512_vnni_supported();
bool use_amx = use_avx512 && eagleserve_cpu::amx_int8_supported();

// x bytes [4q, 4q + 4) of a block, in every 32-bit lane.
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Block g's weights (wb), d and extra tiles: each stream kPrefetchBytes / tile_bytes blocks on.
template <bool Q4>
inline void prefetch_ahead(const uint8_t* wb, const uint16_t* d, const void* extra) {
  constexpr int64_t kTileBytes = Q4 ? 256 : 512, kAhead = kPrefetchBytes / kTileBytes;
  for (int64_t b = 0; b < kTileBytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + b), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(d + kAhead * kTile), _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(extra) + kAhead * kTile * (Q4 ? 2 : 4), _MM_HINT_T0);
}

inline __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Block sums of R rows against the 16 columns of one tile, lanes = columns: out[r * 16 + c] =
// fma chain over blocks g of cvt(int32 dot) * (d_w * d_x). AVX2: 8 columns per vector, the
// dots as maddubs pairs (summed in int16 for q4: at most 8 * 2 * 15 * 127 < 2^15) and madd.
template <int R, bool Q4>
void tile_dots_avx2(const int8_t* qx, int64_t K, const float* dx, const uint8_t* w,
                    const uint16_t* d, const void* extra, float* out) {
  const int64_t groups = K / kBlock;
  constexpr int64_t kTileBytes = Q4 ? 256 : 512;  // per block
  const __m256i ones = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(0x0F);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wb = w + g * kTileBytes + half * 32;
      if (half == 0)  // the second half reads the tile again, from L1
        prefetch_ahead<Q4>(wb, d + g * kTile,
                           static_cast<const char*>(extra) + g * kTile * (Q4 ? 2 : 4));
      const __m256 dw = load_half8(d + g * kTile + half * 8);
      if constexpr (Q4) {
        __m256i lo[4], hi[4];
        for (int q = 0; q < 4; ++q) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + q * 64));
          lo[q] = _mm256_and_si256(b, lo4);
          hi[q] = _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = qx + r * K + g * kBlock;
          __m256i s = _mm256_maddubs_epi16(lo[0], bcast4(xb));
          for (int q = 1; q < 4; ++q)
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[q], bcast4(xb + 4 * q)));
          for (int q = 0; q < 4; ++q)
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[q], bcast4(xb + 16 + 4 * q)));
          const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
          const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * groups + g]));
          acc[r] = _mm256_fmadd_ps(p, scale, acc[r]);
        }
      } else {
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = qx + r * K + g * kBlock;
          __m256i s = _mm256_setzero_si256();
          for (int q = 0; q < 8; ++q) {  // |w| against x with w's sign (maddubs: u8 x s8)
            const __m256i ws = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + q * 64));
            const __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(ws, ws),
                                                      _mm256_sign_epi8(bcast4(xb + 4 * q), ws));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(prod, ones));
          }
          const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * groups + g]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kTile + half * 8, acc[r]);
  }
}

// q4: adds to dots[r * 16 + c] the fma chain over blocks of m[c, g] * xsum[r, g].
void add_offsets(const float* xsum, int rows, int64_t groups, const uint16_t* m, float* dots) {
  for (int r = 0; r < rows; ++r) {
    for (int half = 0; half < 2; ++half) {
      __m256 off = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g)
        off = _mm256_fmadd_ps(load_half8(m + g * kTile + half * 8),
                              _mm256_set1_ps(xsum[r * groups + g]), off);
      float* o = dots + r * kTile + half * 8;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), off));
    }
  }
}

// One tile's outputs for `rows` rows: dots, plus (q4) the m offsets, which the AVX-512 kernel
// sums in its own pass over the blocks.
template <bool Q4>
void tile_dots(bool wide, int rows, const int8_t* qx, int64_t K, const float* dx,
               const float* xsum, const uint8_t* w, const uint16_t* d, const void* extra,
               float* out) {
  if (wide)
    return eagleserve_cpu::tile_dots_avx512(Q4, rows, qx, K, dx, xsum, w, d, extra, out);
  switch (rows) {
    case 4: tile_dots_avx2<4, Q4>(qx, K, dx, w, d, extra, out); break;
    case 3: tile_dots_avx2<3, Q4>(qx, K, dx, w, d, extra, out); break;
    case 2: tile_dots_avx2<2, Q4>(qx, K, dx, w, d, extra, out); break;
    default: tile_dots_avx2<1, Q4>(qx, K, dx, w, d, extra, out);
  }
  if constexpr (Q4) add_offsets(xsum, rows, K / kBlock, static_cast<const uint16_t*>(extra), out);
}

// Per 32-block of each row: q = round(x / dx) in -127..127 with dx = max|x| / 127, and the
// block's fp32 sum (summed in order) for the q4 offsets.
void quantize_block(const float* xb, int8_t* qx, float* dx, float* xsum) {
  float amax = 0.f, s = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) {
    amax = std::max(amax, std::fabs(xb[j]));
    s += xb[j];
  }
  const float scale = amax / 127.f;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t j = 0; j < kBlock; ++j) qx[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
  *dx = scale;
  *xsum = s;
}

// r[j] lane i <- r[i] lane j.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// quantize_block for 8 consecutive blocks, the same bits: lane b of each vector is block b,
// so its sum runs over the block's elements in order (read through 8 x 8 transposes) while
// eight blocks' sums advance at once.
void quantize_blocks8(const float* x, int8_t* qx, float* dx, float* xsum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps(), s = _mm256_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    __m256 r[8];
    for (int b = 0; b < 8; ++b) r[b] = _mm256_loadu_ps(x + b * kBlock + c * 8);
    transpose8(r);
    for (int j = 0; j < 8; ++j) {
      // max_ps returns its second operand where one is NaN, as std::max(amax, |x|) keeps amax
      amax = _mm256_max_ps(_mm256_and_ps(r[j], abs_mask), amax);
      s = _mm256_add_ps(s, r[j]);
    }
  }
  const __m256 scale = _mm256_div_ps(amax, _mm256_set1_ps(127.f));
  const __m256 inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.f), scale),
                                   _mm256_cmp_ps(scale, _mm256_setzero_ps(), _CMP_GT_OQ));
  _mm256_storeu_ps(dx, scale);
  _mm256_storeu_ps(xsum, s);
  alignas(32) float invs[8];
  _mm256_store_ps(invs, inv);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int b = 0; b < 8; ++b) {
    const __m256 v = _mm256_set1_ps(invs[b]);
    __m256i q[4];
    for (int c = 0; c < 4; ++c) {
      const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + b * kBlock + c * 8), v);
      q[c] = _mm256_cvtps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // packs work within 128-bit lanes: the permute puts the 32 bytes back in order.
    const __m256i q16a = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + b * kBlock), q8);
  }
}

void quantize_rows(const float* x, int64_t blocks, int8_t* qx, float* dx, float* xsum) {
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8)
    quantize_blocks8(x + b * kBlock, qx + b * kBlock, dx + b, xsum + b);
  for (; b < blocks; ++b) quantize_block(x + b * kBlock, qx + b * kBlock, dx + b, xsum + b);
}

template <bool Q4>
at::Tensor tiled_matmul(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& d,
                        const at::Tensor& extra, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x: [M, K] float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), groups = K / kBlock;
  const int64_t tiles = (N + kTile - 1) / kTile;
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.is_contiguous() && w.dim() == 5 && w.size(0) == tiles && w.size(1) == groups &&
                  w.size(2) == (Q4 ? 4 : 8),
              "weight tiles: [T, K/32, ", Q4 ? 4 : 8, ", 16, 4] for T = ceil(N/16)");
  TORCH_CHECK(d.is_contiguous() && d.numel() == tiles * groups * kTile &&
                  d.scalar_type() == at::kHalf,
              "scale tiles: fp16 [T, K/32, 16]");
  TORCH_CHECK(extra.is_contiguous() && extra.numel() == tiles * groups * kTile,
              Q4 ? "m tiles" : "weight sum tiles");
  std::vector<int8_t> qx(M * K);
  std::vector<float> dx(M * groups), xsum(M * groups);
  const float* xp = x.data_ptr<float>();
  // Rows are quantized independently (a row's blocks in order), so splitting rows over
  // threads changes nothing in them.
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    quantize_rows(xp + r0 * K, (r1 - r0) * groups, qx.data() + r0 * K, dx.data() + r0 * groups,
                  xsum.data() + r0 * groups);
  });
  const bool wide = use_avx512, amx = use_amx && M >= kAmxRows;  // one ISA for the whole call
  if (!Q4 && wide) {
    for (int8_t& v : qx) v = static_cast<int8_t>(v ^ 0x80);  // AVX-512 q8 reads x + 128 as u8
  }
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const uint16_t* dp = static_cast<const uint16_t*>(d.data_ptr());
  const char* ep = static_cast<const char*>(extra.data_ptr());
  const int64_t extra_bytes = Q4 ? 2 : 4;  // m: fp16; the weight sums: int32
  const int64_t tile_bytes = groups * (Q4 ? 256 : 512), tile_scales = groups * kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    float dots[kAmxRows * kTile];
    if (amx) eagleserve_cpu::amx_begin();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile, cols = std::min(N, n0 + kTile) - n0;
      const void* et = ep + t * tile_scales * extra_bytes;
      for (int64_t r0 = 0; r0 < M;) {
        const int rows = static_cast<int>(
            std::min<int64_t>(amx && M - r0 >= kAmxRows ? kAmxRows : kRowsPerPass, M - r0));
        if (rows == kAmxRows)
          eagleserve_cpu::tile_dots_amx16(Q4, qx.data() + r0 * K, K, dx.data() + r0 * groups,
                                          xsum.data() + r0 * groups, wp + t * tile_bytes,
                                          dp + t * tile_scales, et, dots);
        else
          tile_dots<Q4>(wide, rows, qx.data() + r0 * K, K, dx.data() + r0 * groups,
                        xsum.data() + r0 * groups, wp + t * tile_bytes, dp + t * tile_scales, et,
                        dots);
        for (int r = 0; r < rows; ++r)
          std::copy(dots + r * kTile, dots + r * kTile + cols, yp + (r0 + r) * N + n0);
        r0 += rows;
      }
    }
    if (amx) eagleserve_cpu::amx_end();
  });
  return y;
}

}  // namespace

namespace eagleserve_cpu {

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d,
                     const at::Tensor& m, int64_t n) {
  TORCH_CHECK(w.scalar_type() == at::kByte && m.scalar_type() == at::kHalf, "q4 tiles");
  return tiled_matmul<true>(x, w, d, m, n);
}

}  // namespace eagleserve_cpu

namespace eagleserve_cpu {

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d,
                     const at::Tensor& wsum, int64_t n) {
  TORCH_CHECK(w.scalar_type() == at::kChar && wsum.scalar_type() == at::kInt, "q8 tiles");
  return tiled_matmul<false>(x, w, d, wsum, n);
}

}  // namespace eagleserve_cpu

namespace {

// "avx2", "avx512_vnni" or "amx" (AVX-512 VNNI with AMX-INT8 for passes of 16 rows; each
// where the CPU has it) for every later call, "auto" the best here, "" to ask; returns the ISA
// now in use.
std::string gemv_isa(const std::string& isa) {
  if (isa == "auto") {
    use_avx512 = eagleserve_cpu::avx512_vnni_supported();
    use_amx = use_avx512 && eagleserve_cpu::amx_int8_supported();
  } else if (isa == "avx2") {
    use_avx512 = use_amx = false;
  } else if (isa == "avx512_vnni" || isa == "amx") {
    TORCH_CHECK(eagleserve_cpu::avx512_vnni_supported(), "this CPU has no AVX-512 VNNI");
    TORCH_CHECK(isa != "amx" || eagleserve_cpu::amx_int8_supported(),
                "this CPU (or its kernel) offers no AMX-INT8");
    use_avx512 = true;
    use_amx = isa == "amx";
  } else {
    TORCH_CHECK(isa.empty(), "isa: auto, avx2, avx512_vnni or amx (or '' to ask), not ", isa);
  }
  return use_amx ? "amx" : use_avx512 ? "avx512_vnni" : "avx2";
}

}  // namespace

TORCH_LIBRARY(eagleserve_cpu, lib) {
  lib.def("gemv_isa(str isa) -> str", &gemv_isa);
  lib.def("q4_matmul(Tensor x, Tensor w, Tensor d, Tensor m, int n) -> Tensor",
          &eagleserve_cpu::q4_matmul);
  lib.def("q8_matmul(Tensor x, Tensor w, Tensor d, Tensor wsum, int n) -> Tensor",
          &eagleserve_cpu::q8_matmul);
}
