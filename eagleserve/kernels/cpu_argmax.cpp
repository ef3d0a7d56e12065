// argmax over the last dim of fp32 rows (greedy sampling and the greedy verify of a packed CPU
// target), AVX2: one pass for each row's maximum, one for its first position; a chain
// verify's greedy walk over them, and a chain draft's top-1 with its probability.
//
// torch.argmax's answer exactly: the first index of the maximum; a row holding a NaN answers
// its first NaN (torch propagates NaN as the maximum); a row of -inf answers 0. Each row alone
// decides its result (the batch invariance the other kernels of this extension keep).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_simd.h"

namespace eagleserve_cpu {

namespace {

// The first i in [0, n) with x[i] == target (the caller knows there is one), or with x[i]
// NaN when find_nan.
int64_t first_index(const float* x, int64_t n, float target, bool find_nan) {
  const __m256 t = _mm256_set1_ps(target);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 hit = find_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, t, _CMP_EQ_OQ);
    const int mask = _mm256_movemask_ps(hit);
    if (mask != 0) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; i < n; ++i) {
    if (find_nan ? std::isnan(x[i]) : x[i] == target) return i;
  }
  return 0;
}

int64_t argmax_row(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, best);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < n; ++i) {
    has_nan = has_nan || std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  return first_index(x, n, m, has_nan);
}

}  // namespace

// logits [..., V] fp32 -> int64 [...].
at::Tensor argmax_rows(const at::Tensor& logits_in) {
  TORCH_CHECK(logits_in.scalar_type() == at::kFloat && logits_in.dim() >= 1, "float32 [..., V]");
  const at::Tensor x = logits_in.contiguous();
  const int64_t V = x.size(-1), rows = V ? x.numel() / V : 0;
  TORCH_CHECK(V > 0, "argmax over an empty dimension");
  std::vector<int64_t> shape = x.sizes().vec();
  shape.pop_back();
  at::Tensor out = at::empty(shape, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// The greedy acceptance of a chain verify in one call (spec/accept.py's verify_greedy_chain of
// the rows' argmax, packed as packed_walk packs it): tokens [bs, n] the drafted nodes, logits
// [bs * n, V] the target's after each node. Node i + 1 is accepted while every node up to it
// carries the argmax after the node before, so a request commits the argmax at nodes
// 0 .. len - 1, the last one its bonus. Returns int64 [bs, 2n + 2]: accept_index (node i, or
// -1 past len), output_tokens (the argmax, or -1 past len), len, bonus.
at::Tensor greedy_chain_walk(const at::Tensor& tokens_in, const at::Tensor& logits_in) {
  TORCH_CHECK(tokens_in.dim() == 2, "tokens [bs, n]");
  const at::Tensor tokens = tokens_in.to(at::kLong).contiguous();
  const int64_t bs = tokens.size(0), n = tokens.size(1);
  const at::Tensor predict = argmax_rows(logits_in);
  TORCH_CHECK(predict.dim() == 1 && predict.size(0) == bs * n, "logits [bs * n, V]");
  at::Tensor out = at::empty({bs, 2 * n + 2}, tokens.options());
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* pred = predict.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < bs; ++b, tok += n, pred += n, o += 2 * n + 2) {
    int64_t len = 1;
    while (len < n && tok[len] == pred[len - 1]) ++len;
    for (int64_t i = 0; i < n; ++i) {
      o[i] = i < len ? i : -1;
      o[n + i] = i < len ? pred[i] : -1;
    }
    o[2 * n] = len;
    o[2 * n + 1] = pred[len - 1];
  }
  return out;
}

// A chain draft's candidate of each row of head logits [R, V] fp32 (spec/draft_extend.py's
// seed_from_logits, topk 1): the argmax (argmax_rows' answer), mapped through id_map [V] int64
// (the draft-to-target vocabulary map) where given, and its softmax probability 1 / sum of
// exp(x - max) (fp32, exp_nonpositive's rounding: within a few ulp of torch.softmax's).
// Returns (p [R, 1] fp32, ids [R, 1] int64).
std::tuple<at::Tensor, at::Tensor> top1_rows(const at::Tensor& logits_in,
                                             const c10::optional<at::Tensor>& id_map) {
  TORCH_CHECK(logits_in.scalar_type() == at::kFloat && logits_in.dim() == 2, "float32 [R, V]");
  const at::Tensor x = logits_in.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "top-1 over an empty row");
  at::Tensor map;
  if (id_map.has_value()) {
    map = id_map->to(at::kLong).contiguous();
    TORCH_CHECK(map.numel() == V, "id_map: one id per column");
  }
  at::Tensor p = at::empty({R, 1}, x.options());
  at::Tensor ids = at::empty({R, 1}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const float* row = xp + r * V;
    const int64_t best = argmax_row(row, V);
    const __m256 top = _mm256_set1_ps(row[best]);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8)
      acc = _mm256_add_ps(acc, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + i), top)));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float total = 0.f;
    for (float lane : lanes) total += lane;
    for (; i < V; ++i) total += std::exp(row[i] - row[best]);
    p.data_ptr<float>()[r] = 1.f / total;
    ids.data_ptr<int64_t>()[r] = map.defined() ? map.data_ptr<int64_t>()[best] : best;
  }
  return {p, ids};
}

}  // namespace eagleserve_cpu

TORCH_LIBRARY_FRAGMENT(eagleserve_cpu, lib) {
  lib.def("argmax_rows(Tensor logits) -> Tensor", &eagleserve_cpu::argmax_rows);
  lib.def("greedy_chain_walk(Tensor tokens, Tensor logits) -> Tensor",
          &eagleserve_cpu::greedy_chain_walk);
  lib.def("top1_rows(Tensor logits, Tensor? id_map) -> (Tensor, Tensor)",
          &eagleserve_cpu::top1_rows);
}
