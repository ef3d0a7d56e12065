// The per-element steps of a packed CPU target's layer, one call each where torch takes
// several ops (at batch 1 each op's dispatch from Python costs more than its arithmetic):
//
// - rope_: rotates the q and k heads of a fused q/k/v projection in place,
//   x * cos + rotate_half(x) * sin, as model/llama.py's BoundRotary computes it (the same
//   fp32 multiplies and add, so the same bits);
// - silu_mul: silu(gate) * up from a fused [gate | up] projection.
//
// Each row is computed alone, by the same operations whatever the number of rows (the batch
// invariance the other kernels of this extension keep). (No -ffast-math.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <vector>

#include "cpu_kernels.h"
#include "cpu_simd.h"

namespace eagleserve_cpu {

// qkv [T, heads, D] fp32, rows contiguous; cos, signed_sin [T, 1, D] (signed_sin is sin with
// its first half negated, so rotate_half(x) * sin == roll(x, D / 2) * signed_sin).
void rope_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
           int64_t rotated_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "qkv [T, heads, D] contiguous float32");
  const int64_t T = qkv.size(0), heads = qkv.size(1), D = qkv.size(2), half = D / 2;
  TORCH_CHECK(rotated_heads <= heads && half % 8 == 0, "rotated heads, D a multiple of 16");
  const at::Tensor c = cos.contiguous(), s = signed_sin.contiguous();
  TORCH_CHECK(c.scalar_type() == at::kFloat && c.numel() == T * D && s.numel() == T * D,
              "cos / sin [T, 1, D] float32");
  float* xp = qkv.data_ptr<float>();
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *ct = cp + t * D, *st = sp + t * D;
      for (int64_t h = 0; h < rotated_heads; ++h) {
        float* x = xp + (t * heads + h) * D;
        for (int64_t d = 0; d < half; d += 8) {
          const __m256 lo = _mm256_loadu_ps(x + d), hi = _mm256_loadu_ps(x + half + d);
          // out[d] = x[d] cos[d] + x[d + D/2] ss[d]; out[d + D/2] = x[d + D/2] cos + x[d] ss
          const __m256 new_lo = _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(ct + d)),
                                              _mm256_mul_ps(hi, _mm256_loadu_ps(st + d)));
          const __m256 new_hi =
              _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(ct + half + d)),
                            _mm256_mul_ps(lo, _mm256_loadu_ps(st + half + d)));
          _mm256_storeu_ps(x + d, new_lo);
          _mm256_storeu_ps(x + half + d, new_hi);
        }
      }
    }
  });
}

// gate_up [T, 2I] fp32 -> silu(gate) * up [T, I]. silu(g) = g / (1 + e^-g), taken as
// g * e / (1 + e) with e = e^g for g < 0 so that the exponential never overflows.
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  TORCH_CHECK(gate_up_in.scalar_type() == at::kFloat, "float32");
  const at::Tensor gu = gate_up_in.contiguous();
  const int64_t I = gu.size(-1) / 2, T = gu.numel() / (2 * I);
  TORCH_CHECK(I % 8 == 0, "the half width must be a multiple of 8");
  std::vector<int64_t> shape = gu.sizes().vec();
  shape.back() = I;
  at::Tensor out = at::empty(shape, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *g = gp + t * 2 * I, *u = g + I;
      for (int64_t i = 0; i < I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));  // e^-|g|
        const __m256 neg = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 num = _mm256_blendv_ps(gv, _mm256_mul_ps(gv, e), neg);
        const __m256 silu = _mm256_div_ps(num, _mm256_add_ps(one, e));
        _mm256_storeu_ps(op + t * I + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
      }
    }
  });
  return out;
}

}  // namespace eagleserve_cpu

TORCH_LIBRARY_FRAGMENT(eagleserve_cpu, lib) {
  lib.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor signed_sin, int rotated_heads) -> ()",
          &eagleserve_cpu::rope_);
  lib.def("silu_mul(Tensor gate_up) -> Tensor", &eagleserve_cpu::silu_mul);
}
