// A sampled row's token from its fp32 logits in one call (a CPU engine's sampled rows):
// temperature, top-k, top-p and min-p, then the exponential race on the noise of (seed,
// position). The same rule as sampling/sampler.py's torch ops (`logits_to_probs`, then `draw`
// on seeded_noise.py's noise), without sorting the vocabulary:
//
// - weights w = exp(x - max x), x = logits / temperature: the softmax unnormalized, so the
//   most likely token weighs exactly 1 and min-p keeps w >= min_p;
// - top-k / top-p: a histogram of the weights by their leading bits (exponent and 4 mantissa
//   bits; a positive float's bits order as its value) gives the bucket where the k-th token or
//   the top_p mass is crossed; only that bucket's tokens are sorted. As in the torch rule, top-p
//   keeps a token while the mass of the more likely ones is below top_p of the whole
//   distribution (not of what top-k left), and always keeps the most likely token;
// - the draw: the kept token with the least E_t / w_t (the lowest id on a tie), E_t = -log(1 -
//   W_t) and W_t the uniform of (the row's position hash, t). A token can only beat the best
//   key k so far if W_t < k * w_t (E_t >= W_t): eight tokens' uniforms are hashed and compared
//   at a time, and only the few that pass have their logarithm taken.
//
// The torch ops round differently (normalized fp32 probabilities, a top-p cut by sorted fp32
// sums), so the two agree except where two keys or a top-p cut fall within rounding of each
// other. Each row alone decides its token (the batch invariance of this extension's kernels).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_simd.h"

namespace eagleserve_cpu {

namespace {

constexpr uint64_t kMask32 = 0xFFFFFFFFull;
constexpr uint64_t kMixMul = 0x45D9F3Bull;  // seeded_noise.py's mixer constant
constexpr uint64_t kGolden = 0x9E3779B9ull;  // seeded_noise.py's token multiplier
constexpr int kKeyShift = 19;              // bucket: the float's bits >> 19
constexpr uint32_t kOneBits = 0x3F800000u;  // 1.0f, the largest weight
constexpr int kBuckets = static_cast<int>(kOneBits >> kKeyShift) + 1;

uint64_t mix32(uint64_t x) {
  x ^= x >> 16;
  x = (x * kMixMul) & kMask32;
  x ^= x >> 16;
  x = (x * kMixMul) & kMask32;
  return x ^ (x >> 16);
}

// seeded_noise.py `position_hashes` for one (seed, position).
uint32_t position_hash(int64_t seed, int64_t position) {
  const uint64_t s = static_cast<uint64_t>(seed);
  uint64_t h = mix32(static_cast<uint64_t>(position) & kMask32);
  h = mix32(h ^ (s & kMask32));
  return static_cast<uint32_t>(mix32(h ^ (s >> 32)));
}

// seeded_noise.py `token_uniforms` of token t in the row of hash h: an odd multiple of 2**-24,
// exact in fp32.
float token_uniform(uint32_t h, int64_t t) {
  const uint64_t x = mix32(((static_cast<uint64_t>(t) * kGolden) & kMask32) ^ h);
  return static_cast<float>((x >> 9) * 2 + 1) * (1.f / 16777216.f);
}

// The same for the tokens of columns i0 .. i0 + 7 (`columns`: each column's token id, nullptr:
// the index; 32-bit lanes: the low half of each product, as & kMask32).
__m256 token_uniforms8(uint32_t h, int64_t i0, const int32_t* columns) {
  const __m256i mul = _mm256_set1_epi32(static_cast<int32_t>(kMixMul));
  const __m256i t =
      columns != nullptr
          ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(columns + i0))
          : _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i0)),
                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i x = _mm256_xor_si256(
      _mm256_mullo_epi32(t, _mm256_set1_epi32(static_cast<int32_t>(kGolden))),
      _mm256_set1_epi32(static_cast<int32_t>(h)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, mul);
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, mul);
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  const __m256i odd = _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(x, 9), 1),
                                       _mm256_set1_epi32(1));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(odd), _mm256_set1_ps(1.f / 16777216.f));
}

// A token's key in the race: its exponential over its weight (+inf at weight 0).
double race_key(float uniform, float w) { return -std::log1p(-static_cast<double>(uniform)) / w; }

// A weight's histogram bucket (weights are in [0, 1]; clamped all the same, as an index).
int bucket_of(float w) {
  uint32_t b;
  std::memcpy(&b, &w, sizeof b);
  return std::min(static_cast<int>(b >> kKeyShift), kBuckets - 1);
}

// x = logits / temperature into w, then w = exp(x - max x) (a NaN logit weighs 0); returns
// false for a row without a finite maximum (all -inf or NaN, or a +inf), which has none.
bool weights(const float* logits, int64_t V, float temperature, float* w) {
  const __m256 t = _mm256_set1_ps(temperature);
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(logits + i), t);
    _mm256_storeu_ps(w + i, x);
    mx = _mm256_max_ps(x, mx);  // a NaN x gives the second operand: NaNs are skipped
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, mx);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  for (; i < V; ++i) {
    w[i] = logits[i] / temperature;
    m = std::max(m, w[i]);
  }
  if (!std::isfinite(m)) return false;
  const __m256 mv = _mm256_set1_ps(m);
  for (i = 0; i + 8 <= V; i += 8) {
    _mm256_storeu_ps(w + i, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(w + i), mv)));
  }
  for (; i < V; ++i) {
    float x[8] = {w[i] - m, 0, 0, 0, 0, 0, 0, 0};
    _mm256_storeu_ps(x, exp_nonpositive(_mm256_loadu_ps(x)));
    w[i] = x[0];
  }
  return true;
}

// Which tokens top-k, top-p and min-p keep: w[i] >= floor, and w[i] above `w_cut`, or equal to
// it at an index at most `i_cut` (the (weight descending, index ascending) order's cut).
struct Cut {
  float floor = 0.f;
  float w_cut = -1.f;  // below every weight: no top-k / top-p cut
  int64_t i_cut = 0;

  bool keeps(float wi, int64_t i) const {
    return wi >= floor && (wi > w_cut || (wi == w_cut && i <= i_cut));
  }
};

Cut top_k_top_p(const float* w, int64_t V, int64_t top_k, double top_p) {
  thread_local std::vector<int64_t> count;
  thread_local std::vector<double> mass;
  count.assign(kBuckets, 0);
  mass.assign(kBuckets, 0.0);
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    const int key = bucket_of(w[i]);
    count[key] += 1;
    mass[key] += w[i];
  }
  for (int b = 0; b < kBuckets; ++b) total += mass[b];
  const bool filter_p = top_p < 1.0;
  const double p_mass = top_p * total;
  int64_t rank = 0;  // tokens in the buckets above
  double before = 0.0;  // their mass
  int bucket = -1;  // the first bucket not kept whole
  for (int b = kBuckets - 1; b >= 0; --b) {
    if (count[b] == 0) continue;
    if (rank + count[b] > top_k || (filter_p && before + mass[b] >= p_mass)) {
      bucket = b;
      break;
    }
    rank += count[b];
    before += mass[b];
  }
  Cut cut;
  if (bucket < 0) return cut;
  // None of the bucket kept: every weight in the buckets above (at least its upper bound).
  const uint32_t above = static_cast<uint32_t>(bucket + 1) << kKeyShift;
  std::memcpy(&cut.w_cut, &above, sizeof above);
  cut.i_cut = V;
  thread_local std::vector<std::pair<float, int64_t>> members;
  members.clear();
  for (int64_t i = 0; i < V; ++i) {
    if (bucket_of(w[i]) == bucket) members.emplace_back(w[i], i);
  }
  std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  for (const auto& [wi, i] : members) {
    const bool kept = rank < top_k && (!filter_p || before < p_mass || rank == 0);
    if (!kept) break;
    cut.w_cut = wi;
    cut.i_cut = i;
    rank += 1;
    before += wi;
  }
  return cut;
}

int64_t sample_row(const float* logits, int64_t V, float temperature, int64_t top_k,
                   float top_p, float min_p, uint32_t h, const int32_t* columns) {
  thread_local std::vector<float> buf;
  buf.resize(V);
  float* w = buf.data();
  if (!weights(logits, V, temperature, w)) return V - 1;  // no mass: as the torch draw
  Cut cut = top_k < V || top_p < 1.f ? top_k_top_p(w, V, top_k, top_p) : Cut{};
  cut.floor = min_p;  // the most likely token weighs 1
  // A token can beat the best key k so far only where its uniform W_t < k * w_t (E_t >= W_t),
  // and no uniform is below 2**-24: a chunk of eight whose kept weights all give k * w under
  // that is skipped before its uniforms are hashed. The bound is tested with a margin for the
  // product's rounding; the first kept tokens pass it (k starts infinite) until k settles.
  auto token = [&](int64_t i) -> int64_t { return columns != nullptr ? columns[i] : i; };
  int64_t best = -1;
  double best_key = std::numeric_limits<double>::infinity();
  auto challenge = [&](int64_t i, float uniform) {
    if (!cut.keeps(w[i], i)) return;
    const double key = race_key(uniform, w[i]);
    if (key < best_key || (key == best_key && i < best)) best = i, best_key = key;
  };
  // Every kept token of some weight is at least this (a token of weight 0 never wins).
  const __m256 lower = _mm256_set1_ps(std::max({cut.floor, cut.w_cut, 1e-45f}));
  const __m256 least_uniform = _mm256_set1_ps(1.f / 16777216.f);
  const int64_t body = V - V % 8;
  for (int64_t i0 = 0; i0 < body; i0 += 8) {
    const __m256 x = _mm256_loadu_ps(w + i0);
    const __m256 bound = _mm256_mul_ps(x, _mm256_set1_ps(static_cast<float>(best_key * 1.0001)));
    const __m256 viable = _mm256_and_ps(_mm256_cmp_ps(x, lower, _CMP_GE_OQ),
                                        _mm256_cmp_ps(bound, least_uniform, _CMP_GE_OQ));
    if (_mm256_movemask_ps(viable) == 0) continue;
    const __m256 u = token_uniforms8(h, i0, columns);
    int mask = _mm256_movemask_ps(_mm256_and_ps(viable, _mm256_cmp_ps(u, bound, _CMP_LE_OQ)));
    if (mask == 0) continue;
    float lanes[8];
    _mm256_storeu_ps(lanes, u);
    for (; mask != 0; mask &= mask - 1) {
      const int j = __builtin_ctz(mask);
      challenge(i0 + j, lanes[j]);
    }
  }
  for (int64_t i = body; i < V; ++i) {
    if (w[i] <= 0.f) continue;
    const float u = token_uniform(h, token(i));
    if (u <= static_cast<float>(best_key * 1.0001) * w[i]) challenge(i, u);
  }
  // The most likely token (weight 1) is kept by every filter: some token has a finite key.
  return best;
}

}  // namespace

// logits [m, V] fp32; temperatures [m] (or [m, 1]) fp32 > 0; top_ks [m] int64 (V: off);
// top_ps, min_ps [m] fp32; seeds [m] int64 in [0, 2**63); positions [m] int64 >= 0 (where each
// drawn token will sit); columns [V] int64 token ids below 2**31 (the noise's key of each
// column; None: its index) -> column indices [m] int64.
at::Tensor sample_rows(const at::Tensor& logits_in, const at::Tensor& temperatures,
                       const at::Tensor& top_ks, const at::Tensor& top_ps,
                       const at::Tensor& min_ps, const at::Tensor& seeds,
                       const at::Tensor& positions, const c10::optional<at::Tensor>& columns) {
  TORCH_CHECK(logits_in.scalar_type() == at::kFloat && logits_in.dim() == 2, "float32 [m, V]");
  const at::Tensor x = logits_in.contiguous();
  const int64_t m = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "sampling over an empty vocabulary");
  const at::Tensor t = temperatures.to(at::kFloat).reshape({-1}).contiguous();
  const at::Tensor k = top_ks.to(at::kLong).contiguous(), s = seeds.to(at::kLong).contiguous();
  const at::Tensor p = top_ps.to(at::kFloat).contiguous(), mp = min_ps.to(at::kFloat).contiguous();
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  for (const at::Tensor* a : {&t, &k, &p, &mp, &s, &pos}) {
    TORCH_CHECK(a->numel() == m, "one sampling parameter per row");
  }
  at::Tensor cols;
  if (columns.has_value()) {
    cols = columns->to(at::kInt).contiguous();
    TORCH_CHECK(cols.numel() == V, "one token id per column");
  }
  const int32_t* colp = columns.has_value() ? cols.data_ptr<int32_t>() : nullptr;
  at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const float *tp = t.data_ptr<float>(), *pp = p.data_ptr<float>(), *mpp = mp.data_ptr<float>();
  const int64_t *kp = k.data_ptr<int64_t>(), *sp = s.data_ptr<int64_t>();
  const int64_t* posp = pos.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint32_t h = position_hash(sp[r], posp[r]);
      op[r] = sample_row(xp + r * V, V, tp[r], std::min(kp[r], V), pp[r], mpp[r], h, colp);
    }
  });
  return out;
}

}  // namespace eagleserve_cpu

TORCH_LIBRARY_FRAGMENT(eagleserve_cpu, lib) {
  lib.def(
      "sample_rows(Tensor logits, Tensor temperatures, Tensor top_ks, Tensor top_ps, "
      "Tensor min_ps, Tensor seeds, Tensor positions, Tensor? columns=None) -> Tensor",
      &eagleserve_cpu::sample_rows);
}
