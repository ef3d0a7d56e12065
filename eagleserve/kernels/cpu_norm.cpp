// RMSNorm of fp32 rows on x86 CPUs with AVX2 + FMA: y = w * (x * 1 / sqrt(mean(x^2) + eps)).
//
// One call instead of the five ops the composite takes, for the forwards of a packed CPU target
// (at batch 1 each op's dispatch costs more than its arithmetic). Each row is
// reduced in the same fixed order whatever the number of rows (the batch-invariance the other
// kernels of this extension keep).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_kernels.h"

namespace eagleserve_cpu {

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "float32");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t K = x.size(-1), M = x.numel() / K;
  TORCH_CHECK(w.numel() == K && K % 8 == 0, "weight [K], K a multiple of 8");
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows split over threads (a prefill's many rows); each row alone decides its result.
  at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * K;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 8) {
        const __m256 v = _mm256_loadu_ps(xr + k);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      const float inv = 1.f / std::sqrt(_mm_cvtss_f32(s) / static_cast<float>(K) +
                                        static_cast<float>(eps));
      const __m256 vinv = _mm256_set1_ps(inv);
      for (int64_t k = 0; k < K; k += 8) {
        const __m256 n = _mm256_mul_ps(_mm256_loadu_ps(xr + k), vinv);
        _mm256_storeu_ps(yp + r * K + k, _mm256_mul_ps(_mm256_loadu_ps(wp + k), n));
      }
    }
  });
  return y;
}

}  // namespace eagleserve_cpu

TORCH_LIBRARY_FRAGMENT(eagleserve_cpu, lib) {
  lib.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &eagleserve_cpu::rms_norm);
}
