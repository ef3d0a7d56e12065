// SIMD helpers shared by the AVX2 kernels of this extension (included, not compiled alone).
#pragma once

#include <immintrin.h>

namespace eagleserve_cpu {

// exp(x) for x <= 0: 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r by its Taylor
// series to r^7 (truncation below fp32 rounding there); 0 below -87 (and for -inf).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 floor_x = _mm256_set1_ps(-87.f);
  const __m256 xc = _mm256_max_ps(x, floor_x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.4426950408889634f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), xc);  // ln 2, high part
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);     // ln 2, low part
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_and_ps(out, _mm256_cmp_ps(x, floor_x, _CMP_GT_OQ));
}

}  // namespace eagleserve_cpu
