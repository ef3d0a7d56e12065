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

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRowsPerPass = 4;  // rows sharing one unpack of the weights (registers bound it)
constexpr int64_t kColsPerTile = 16;  // a tile's weights stay in L1 across row passes

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [0, R) of the quantized x (qx int8, row stride K; dx, xsum per block) against weight
// rows [n0, n1); y row stride ldy.
template <int R, bool Q4>
void tile(const int8_t* qx, const float* dx, const float* xsum, int64_t K, const uint8_t* w,
          const float* d, const float* m, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t groups = K / kBlock;
  const int64_t row_bytes = Q4 ? K / 2 : K;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * row_bytes;
    const float* dn = d + n * groups;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i wq;  // u8 (q4) or |w| (q8), weights 0..31 of the block in order
      __m256i wsign;
      if constexpr (Q4) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + g * 16));
        wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low4);
      } else {
        wsign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + g * kBlock));
        wq = _mm256_sign_epi8(wsign, wsign);
      }
      for (int r = 0; r < R; ++r) {
        __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + g * kBlock));
        if constexpr (!Q4) xq = _mm256_sign_epi8(xq, wsign);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones);
        const __m256 scale = _mm256_set1_ps(dn[g] * dx[r * groups + g]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float v = hsum(acc[r]);
      if constexpr (Q4) {  // + sum_g m[n, g] * sum(x block g): the offsets, in group order
        const float* mn = m + n * groups;
        const float* xs = xsum + r * groups;
        float off = 0.f;
        for (int64_t g = 0; g < groups; ++g) off = std::fmaf(mn[g], xs[g], off);
        v += off;
      }
      y[r * ldy + n] = v;
    }
  }
}

template <bool Q4>
void rows_pass(int rows, const int8_t* qx, const float* dx, const float* xsum, int64_t K,
               const uint8_t* w, const float* d, const float* m, float* y, int64_t ldy,
               int64_t n0, int64_t n1) {
  switch (rows) {
    case 4: return tile<4, Q4>(qx, dx, xsum, K, w, d, m, y, ldy, n0, n1);
    case 3: return tile<3, Q4>(qx, dx, xsum, K, w, d, m, y, ldy, n0, n1);
    case 2: return tile<2, Q4>(qx, dx, xsum, K, w, d, m, y, ldy, n0, n1);
    default: return tile<1, Q4>(qx, dx, xsum, K, w, d, m, y, ldy, n0, n1);
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
  quantize_rows(x.data_ptr<float>(), M * groups, qx.data(), dx.data(), xsum.data());
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const float* dp = d.data_ptr<float>();
  at::parallel_for(0, (N + kColsPerTile - 1) / kColsPerTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kColsPerTile, n1 = std::min(N, n0 + kColsPerTile);
      for (int64_t r0 = 0; r0 < M; r0 += kRowsPerPass) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsPerPass, M - r0));
        rows_pass<Q4>(rows, qx.data() + r0 * K, dx.data() + r0 * groups,
                      xsum.data() + r0 * groups, K, wp, dp, mp, yp + r0 * N, N, n0, n1);
      }
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
