// y = x @ W.T for GGUF-blocked weights on x86 CPUs with AVX2 + FMA, as llama.cpp computes it:
// each 32-block of a row of x is quantized to int8 (scale max|x| / 127), block dot products
// run in integers (maddubs), and each block's sum is scaled by d_w * d_x in fp32.
//
// W [N, K] in blocks of 32 along K (ggml's layout, see model/gguf_weights.py):
// - q4: uint8 [N, K/2], byte j of a block = weight j (low nibble), weight j + 16 (high);
//       w = d * q + m, q in 0..15 (Q4_0 is m = -8d); the m terms use the exact fp32 block
//       sums of x;
// - q8: int8 [N, K]; w = d * q.
// d, m: fp32 [N, K/32].
//
// Invariant: every output y[r, n] is computed by the same sequence of operations whatever M
// is, whichever row chunk holds r and whichever thread runs n. So a row's result does not
// depend on the batch it is computed in: a k-token verify reproduces k decodes bit for bit.
// (Build without -ffast-math: the order of the adds is part of the contract.)
//
// Many rows (verify, prefill) share the weight reads: a tile of 16 weight rows stays in L1 while
// passes of up to 4 rows run over it, and within a pass each weight block is unpacked once for
// all its rows and several columns.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRowsPerPass = 4;  // rows sharing one unpack of each weight block
constexpr int64_t kColsPerTile = 16;  // a tile's weights stay in L1 across row passes

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [0, R) of the quantized x (qx int8, row stride K; dx per block) against weight rows
// [n, n + C): y[r, n + c] = hsum over lanes of the 8-lane sum, in group order, of
// cvt(int32 block dot) * (d_w * d_x). Each weight block is unpacked once for the R rows.
// Per (row, column) the fp32 operations are the same whatever R and C are: the integer dots
// are exact, d_w * d_x is one rounded product, and each lane's fma chain runs g = 0, 1, ...
template <int R, int C, bool Q4>
void micro(const int8_t* qx, const float* dx, int64_t K, const uint8_t* w, const float* d,
           float* y, int64_t ldy, int64_t n) {
  const int64_t groups = K / kBlock;
  const int64_t row_bytes = Q4 ? K / 2 : K;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wq[C];  // u8 (q4) or |w| (q8), weights 0..31 of the block in order
    __m256i ws[C];  // q8: the signed weights (their signs move onto x)
    for (int c = 0; c < C; ++c) {
      const uint8_t* wb = w + (n + c) * row_bytes;
      if constexpr (Q4) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + g * 16));
        wq[c] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b),
                                 _mm256_set1_epi8(0x0F));
      } else {
        ws[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * kBlock));
        wq[c] = _mm256_sign_epi8(ws[c], ws[c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + g * kBlock));
      const __m256 dxr = _mm256_broadcast_ss(dx + r * groups + g);
      for (int c = 0; c < C; ++c) {
        const __m256i xs = Q4 ? xq : _mm256_sign_epi8(xq, ws[c]);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wq[c], xs), ones);
        const __m256 scale = _mm256_mul_ps(_mm256_broadcast_ss(d + (n + c) * groups + g), dxr);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + n + c] = hsum(acc[r][c]);
}

// Columns per micro-kernel call for R rows: as many accumulators as the 16 ymm registers hold
// (q8 needs the signed weights too); chosen by timing the SmolLM2 shapes on an AVX2 Zen 3.
template <int R, bool Q4>
constexpr int cols_for() {
  return R == 1 ? 4 : (R == 2 ? (Q4 ? 4 : 2) : (Q4 ? 2 : 1));
}

template <int R, bool Q4>
void rows_tile(const int8_t* qx, const float* dx, int64_t K, const uint8_t* w, const float* d,
               float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int C = cols_for<R, Q4>();
  int64_t n = n0;
  for (; n + C <= n1; n += C) micro<R, C, Q4>(qx, dx, K, w, d, y, ldy, n);
  for (; n < n1; ++n) micro<R, 1, Q4>(qx, dx, K, w, d, y, ldy, n);
}

// q4 offsets: y[r, n] += sum_g m[n, g] * xsum[r, g], the sum an fma chain in group order
// (fmaf per column, the same rounding in a vector lane); 8 columns per vector, m transposed
// for the tile into mt [groups, 16].
void add_offsets(const float* xsum, int64_t rows, int64_t groups, const float* m, float* mt,
                 float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  for (int64_t c = 0; c < width; ++c)
    for (int64_t g = 0; g < groups; ++g) mt[g * kColsPerTile + c] = m[(n0 + c) * groups + g];
  for (int64_t r = 0; r < rows; ++r) {
    const float* xs = xsum + r * groups;
    float* yr = y + r * ldy + n0;
    int64_t c = 0;
    for (; c + 8 <= width; c += 8) {
      __m256 off = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g)
        off = _mm256_fmadd_ps(_mm256_loadu_ps(mt + g * kColsPerTile + c), _mm256_set1_ps(xs[g]),
                              off);
      _mm256_storeu_ps(yr + c, _mm256_add_ps(_mm256_loadu_ps(yr + c), off));
    }
    for (; c < width; ++c) {
      float off = 0.f;
      for (int64_t g = 0; g < groups; ++g) off = std::fmaf(mt[g * kColsPerTile + c], xs[g], off);
      yr[c] += off;
    }
  }
}

template <bool Q4>
void rows_pass(int rows, const int8_t* qx, const float* dx, int64_t K, const uint8_t* w,
               const float* d, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  switch (rows) {
    case 4: return rows_tile<4, Q4>(qx, dx, K, w, d, y, ldy, n0, n1);
    case 3: return rows_tile<3, Q4>(qx, dx, K, w, d, y, ldy, n0, n1);
    case 2: return rows_tile<2, Q4>(qx, dx, K, w, d, y, ldy, n0, n1);
    default: return rows_tile<1, Q4>(qx, dx, K, w, d, y, ldy, n0, n1);
  }
}

// Per 32-block of each row: q = round(x / dx) in -127..127 with dx = max|x| / 127, and the
// block's fp32 sum (summed in order) for the q4 offsets.
void quantize_rows(const float* x, int64_t blocks, int8_t* qx, float* dx, float* xsum) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f, s = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      s += xb[j];
    }
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      qx[b * kBlock + j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
    }
    dx[b] = scale;
    xsum[b] = s;
  }
}

template <bool Q4>
at::Tensor blocked_matmul(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& d,
                          const c10::optional<at::Tensor>& m_opt) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x: [M, K] float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.is_contiguous() && w.size(1) == (Q4 ? K / 2 : K), "weight shape");
  TORCH_CHECK(d.is_contiguous() && d.size(0) == N && d.size(1) == K / kBlock, "scale shape");
  const int64_t groups = K / kBlock;
  const float* mp = nullptr;
  if constexpr (Q4) {
    TORCH_CHECK(m_opt.has_value() && m_opt->is_contiguous(), "q4 needs m");
    mp = m_opt->data_ptr<float>();
  }
  std::vector<int8_t> qx(M * K);
  std::vector<float> dx(M * groups), xsum(M * groups);
  const float* xp = x.data_ptr<float>();
  // Rows are quantized independently (a row's blocks in order), so splitting rows over
  // threads changes nothing in them.
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    quantize_rows(xp + r0 * K, (r1 - r0) * groups, qx.data() + r0 * K, dx.data() + r0 * groups,
                  xsum.data() + r0 * groups);
  });
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const float* dp = d.data_ptr<float>();
  at::parallel_for(0, (N + kColsPerTile - 1) / kColsPerTile, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> mt(Q4 ? groups * kColsPerTile : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kColsPerTile, n1 = std::min(N, n0 + kColsPerTile);
      for (int64_t r0 = 0; r0 < M; r0 += kRowsPerPass) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsPerPass, M - r0));
        rows_pass<Q4>(rows, qx.data() + r0 * K, dx.data() + r0 * groups, K, wp, dp, yp + r0 * N,
                      N, n0, n1);
      }
      if constexpr (Q4) add_offsets(xsum.data(), M, groups, mp, mt.data(), yp, N, n0, n1);
    }
  });
  return y;
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d,
                     const at::Tensor& m) {
  TORCH_CHECK(w.scalar_type() == at::kByte, "q4 weight: uint8");
  return blocked_matmul<true>(x, w, d, m);
}

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "q8 weight: int8");
  return blocked_matmul<false>(x, w, d, c10::nullopt);
}

}  // namespace

TORCH_LIBRARY(eagleserve_cpu, lib) {
  lib.def("q4_matmul(Tensor x, Tensor w, Tensor d, Tensor m) -> Tensor", &q4_matmul);
  lib.def("q8_matmul(Tensor x, Tensor w, Tensor d) -> Tensor", &q8_matmul);
}
