// Paged attention on x86 CPUs with AVX2 + FMA, fp32 arithmetic over an fp32 or fp16 K/V pool
// (F16C widens each K/V row as it is read): decode, verify and draft rows, and the causal rows
// of a prefill (extend) of a packed CPU target; a prefill's rows on AVX-512 where the CPU has
// it (cpu_attention_avx512.cpp, the same bits).
//
// Layout as kernels/torch_attention.py: K/V buffers [slots, kv_heads, head_dim] already hold
// every key a query may see; request b reads slots req_to_token[req_pool_indices[b], j] for
// j < kv_lens[b]; its extend_lens[b] queries (flattened request by request) are the last ones
// of that range. Query i sees key j when j <= its position (causal), or, with a tree_mask
// [bs, n_q, n_new], when j < prefix_lens[b] or tree_mask[b, i, j - prefix_lens[b]].
//
// Invariant: a query's result depends only on the keys it sees, in slot-position order. Its
// visible keys are compacted, scored, soft-maxed and summed by the same sequence of fp32
// operations whatever else is in the batch — so a verify row that sees the keys a decode
// would see (a chain, or a tree path in depth order) gets the decode's result bit for bit,
// without the fp64 the padded SDPA path needs for that. A prefill row at position p computes
// what a decode at p computes, so one-shot, chunked and prefix-cached prefills write the same
// KV and give the same logits. (No -ffast-math: order is the contract.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_attention_keys.h"
#include "cpu_attention_query.h"
#include "cpu_kernels.h"

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace eagleserve_cpu::attention;  // NOLINT: this file's building blocks

using Query = eagleserve_cpu::AttentionQuery;
using eagleserve_cpu::kKeyChunk;

// The AVX-512 scores and weighted sums where the CPU has them (the same bits as AVX2's);
// switched only through attention_isa.
bool use_avx512 = eagleserve_cpu::avx512_attention_supported();
constexpr int kShare = 3;  // queries per shared K or V row: their accumulators fill the registers
using Share = eagleserve_cpu::Share<kShare>;

// Queries [0, count)'s scores (times scale) into scores + i * stride, AVX2: key chunk by key
// chunk, the queries that share a chunk's rows taking each row from one load.
template <typename KV>
void score_rows(const Query* qs, int64_t count, const KV* k_buf, int64_t slot_stride, int64_t D,
                float scale, float* scores, int64_t stride, int64_t max_n) {
  // Keys [j, j1) of query i's scores, alone.
  auto score_alone = [&](int64_t i, int64_t j, int64_t j1) {
    float* s = scores + i * stride;
    const Query& x = qs[i];
    for (; j + 8 <= j1; j += 8) score_keys<8>(x.q, k_buf, slot_stride, x.slots, j, x.n, D, scale, s + j);
    for (; j < j1; ++j) score_keys<1>(x.q, k_buf, slot_stride, x.slots, j, x.n, D, scale, s + j);
  };
  for (int64_t j0 = 0; j0 < max_n; j0 += kKeyChunk) {
    for (int64_t i = 0; i < count;) {
      Share sh;
      const int64_t next = eagleserve_cpu::share_chunk(qs, count, i, j0, sh);
      int64_t j = j0;
      if (sh.m >= 2) {
        const float* q[kShare];
        float* s[kShare];
        for (int r = 0; r < sh.m; ++r) q[r] = qs[sh.member[r]].q;
        for (; j + 4 <= sh.common; j += 4) {
          for (int r = 0; r < sh.m; ++r) s[r] = scores + sh.member[r] * stride + j;
          const int64_t* slots = qs[i].slots;
          if (sh.m == 3) score_keys_shared<3>(q, k_buf, slot_stride, slots, j, sh.n, D, scale, s);
          else score_keys_shared<2>(q, k_buf, slot_stride, slots, j, sh.n, D, scale, s);
        }
      }
      for (int r = 0; r < sh.m; ++r) score_alone(sh.member[r], j, sh.end[r]);
      i = next;
    }
  }
}

// Queries [0, count)'s weighted sums of their probabilities (scores + i * stride), unnormalized,
// into each one's out, AVX2, chunked and shared as score_rows.
template <typename KV>
void weigh_rows(const Query* qs, int64_t count, const KV* v_buf, int64_t slot_stride, int64_t D,
                const float* scores, int64_t stride, int64_t max_n) {
  // Keys [j0, j1) of query i's weighted sum, alone.
  auto weigh_alone = [&](int64_t i, int64_t j0, int64_t j1) {
    const float* p = scores + i * stride;
    int64_t d = 0;
    for (; d + 64 <= D; d += 64)
      weigh_values<8>(p, v_buf, slot_stride, qs[i].slots, j0, j1, qs[i].n, d, j0 == 0, qs[i].out);
    for (; d < D; d += 8)
      weigh_values<1>(p, v_buf, slot_stride, qs[i].slots, j0, j1, qs[i].n, d, j0 == 0, qs[i].out);
  };
  for (int64_t j0 = 0; j0 < max_n; j0 += kKeyChunk) {
    for (int64_t i = 0; i < count;) {
      Share sh;
      const int64_t next = eagleserve_cpu::share_chunk(qs, count, i, j0, sh);
      const float* p[kShare];
      float* out[kShare];
      for (int r = 0; r < sh.m; ++r) {
        p[r] = scores + sh.member[r] * stride;
        out[r] = qs[sh.member[r]].out;
      }
      if (sh.m == 3)
        weigh_shared_rows<3>(p, v_buf, slot_stride, qs[i].slots, j0, sh.common, sh.n, D, out);
      if (sh.m == 2)
        weigh_shared_rows<2>(p, v_buf, slot_stride, qs[i].slots, j0, sh.common, sh.n, D, out);
      const int64_t from = sh.m >= 2 ? sh.common : j0;  // the keys past the shared ones, alone
      for (int r = 0; r < sh.m; ++r)
        if (from < sh.end[r]) weigh_alone(sh.member[r], from, sh.end[r]);
      i = next;
    }
  }
}

// Queries that read the same K/V head (a request's rows times the heads of one GQA group),
// walked key chunk by key chunk so a chunk loaded for the first query is in L1 for the rest.
// Each query's scores, softmax and weighted sum are the sequence of operations it would run
// alone: the chunking only interleaves queries. `wide`: the AVX-512 scores and weighted sums
// (the same bits).
template <typename KV>
void attend(const Query* qs, int64_t count, const KV* k_buf, const KV* v_buf,
            int64_t slot_stride, int64_t D, float scale, std::vector<float>& scores, bool wide) {
  int64_t max_n = 0, stride = 0;
  for (int64_t i = 0; i < count; ++i) max_n = std::max(max_n, qs[i].n);
  stride = (max_n + 7) / 8 * 8;
  scores.resize(count * stride);
  constexpr bool kHalf = std::is_same_v<KV, at::Half>;
  if (wide) {
    eagleserve_cpu::attention_scores_avx512(qs, count, k_buf, kHalf, slot_stride, D, scale,
                                            scores.data(), stride);
  } else {
    score_rows(qs, count, k_buf, slot_stride, D, scale, scores.data(), stride, max_n);
  }
  std::vector<float> inv(count);
  for (int64_t i = 0; i < count; ++i) inv[i] = softmax_(scores.data() + i * stride, qs[i].n);
  if (wide) {
    eagleserve_cpu::attention_values_avx512(qs, count, v_buf, kHalf, slot_stride, D,
                                            scores.data(), stride);
  } else {
    weigh_rows(qs, count, v_buf, slot_stride, D, scores.data(), stride, max_n);
  }
  for (int64_t i = 0; i < count; ++i) {
    const __m256 s = _mm256_set1_ps(inv[i]);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(qs[i].out + d, _mm256_mul_ps(_mm256_loadu_ps(qs[i].out + d), s));
  }
}

// The pool's K/V buffers [slots, kv_heads, D], fp32 or fp16, both of one type and shape.
void check_pool(const at::Tensor& k_buf, const at::Tensor& v_buf) {
  TORCH_CHECK((k_buf.scalar_type() == at::kFloat || k_buf.scalar_type() == at::kHalf) &&
                  v_buf.scalar_type() == k_buf.scalar_type() && k_buf.dim() == 3 &&
                  k_buf.is_contiguous() && v_buf.is_contiguous() &&
                  k_buf.sizes() == v_buf.sizes(),
              "k/v buffers [slots, kv_heads, D], float32 or float16, of one type");
}

// f(k, v) with the buffers' typed data pointers (check_pool'ed by the caller).
template <typename F>
auto with_pool(const at::Tensor& k_buf, const at::Tensor& v_buf, F&& f) {
  if (k_buf.scalar_type() == at::kHalf)
    return f(k_buf.data_ptr<at::Half>(), v_buf.data_ptr<at::Half>());
  return f(k_buf.data_ptr<float>(), v_buf.data_ptr<float>());
}

}  // namespace

namespace eagleserve_cpu {

RowPlan plan_rows(int64_t T, const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                  const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                  const at::Tensor& kv_lens, const c10::optional<at::Tensor>& tree_mask) {
  RowPlan plan;
  plan.rows = T;
  plan.req_to_token = req_to_token.to(at::kLong).contiguous();
  const at::Tensor rpi = req_pool_indices.to(at::kLong).contiguous();
  const at::Tensor pre = prefix_lens.to(at::kLong).contiguous();
  const at::Tensor ext = extend_lens.to(at::kLong).contiguous();
  const at::Tensor kvl = kv_lens.to(at::kLong).contiguous();
  const int64_t bs = rpi.size(0);
  // Which request and which query index each row is.
  std::vector<int64_t> row_idx(T);
  plan.row_req.resize(T);
  int64_t t = 0;
  for (int64_t b = 0; b < bs; ++b) {
    for (int64_t i = 0; i < ext.data_ptr<int64_t>()[b]; ++i, ++t) {
      TORCH_CHECK(t < T, "extend_lens sum past the queries");
      plan.row_req[t] = b;
      row_idx[t] = i;
    }
  }
  TORCH_CHECK(t == T, "extend_lens must sum to the number of queries");
  const bool tree = tree_mask.has_value() && tree_mask->defined();
  at::Tensor mask;
  if (tree) mask = tree_mask->to(at::kBool).contiguous();
  const int64_t* r2t_p = plan.req_to_token.data_ptr<int64_t>();
  const int64_t r2t_stride = plan.req_to_token.size(1);
  // Visible slots per row: a causal row reads its request's slot row in place (the first
  // q_abs + 1 entries: a prefill of T rows needs no T x kv copy); a tree row gathers its own.
  plan.row_slots.resize(T);
  plan.row_n.resize(T);
  plan.gathered.resize(tree ? T : 0);
  for (int64_t row = 0; row < T; ++row) {
    const int64_t b = plan.row_req[row], i = row_idx[row];
    const int64_t kv_len = kvl.data_ptr<int64_t>()[b];
    const int64_t q_abs = kv_len - ext.data_ptr<int64_t>()[b] + i;
    const int64_t* req_slots = r2t_p + rpi.data_ptr<int64_t>()[b] * r2t_stride;
    if (!tree) {
      plan.row_slots[row] = req_slots;
      plan.row_n[row] = std::min(q_abs + 1, kv_len);
    } else {
      std::vector<int64_t>& s = plan.gathered[row];
      const int64_t prefix = pre.data_ptr<int64_t>()[b];
      const int64_t nq = mask.size(1), nnew = mask.size(2);
      const bool* m = mask.data_ptr<bool>() + (b * nq + std::min(i, nq - 1)) * nnew;
      for (int64_t j = 0; j < kv_len; ++j) {
        if (j < prefix || (j - prefix < nnew && m[j - prefix])) s.push_back(req_slots[j]);
      }
      plan.row_slots[row] = s.data();
      plan.row_n[row] = static_cast<int64_t>(s.size());
    }
    TORCH_CHECK(plan.row_n[row] > 0, "a query sees no key");
  }
  return plan;
}

HeadRows head_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "[T, heads, D] float32, each row's heads contiguous");
  return {x.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.stride(0)};
}

at::Tensor attend_rows(const RowPlan& plan, const HeadRows& q, const at::Tensor& k_buf,
                       const at::Tensor& v_buf, double sm_scale) {
  // q may be a slice of a fused q/k/v projection: its heads contiguous, any row stride.
  TORCH_CHECK(q.rows == plan.rows, "one query row per planned row");
  check_pool(k_buf, v_buf);
  const int64_t T = q.rows, H = q.heads, D = q.dim, Hkv = k_buf.size(1);
  TORCH_CHECK(D % 8 == 0 && H % Hkv == 0 && k_buf.size(2) == D, "head shapes");
  at::Tensor out = at::empty({T, H, D}, k_buf.options().dtype(at::kFloat));
  const int64_t q_row = q.row_stride;
  const float* qp = q.data;
  float* op = out.data_ptr<float>();
  const int64_t group = H / Hkv, slot_stride = Hkv * D;
  // Units: the queries of one run of a request's rows (at most kRowGroup, so a prefill's
  // scores stay small) that read one K/V head, i.e. the rows times the GQA group's heads. Each
  // thread takes a contiguous share of all queries, cut where the key counts seen so far reach
  // its fraction of the total: the threads do about the same work (a share may end inside a
  // unit, two threads then read that K/V head) and each reads only its share's heads. Within
  // a share, attend() takes at most kMaxQueries of a unit at a time. Which thread or call runs
  // a query changes nothing in it.
  //
  // A unit of at least kWideRows rows on one slot list (a prefill chunk's, a long chain
  // verify's) runs the AVX-512 kernels where the CPU has them: its queries share each K/V row,
  // so the rows come from the caches and the arithmetic sets the time. A decode's or a short
  // verify's few queries per row wait on the rows streaming from memory, which the AVX-512
  // loops read slower (docs/design.md). Both give the same bits.
  constexpr int64_t kRowGroup = 8, kMaxQueries = 16, kWideRows = 5;
  std::vector<Query> queries;
  std::vector<int64_t> unit_start, unit_head;
  std::vector<bool> unit_wide;
  const bool avx512 = use_avx512 && D <= eagleserve_cpu::kMaxWideDim;  // one ISA for the call
  queries.reserve(T * H);
  auto row_end = [&](int64_t r0) {
    int64_t r = r0 + 1;
    while (r < T && plan.row_req[r] == plan.row_req[r0] && r - r0 < kRowGroup) ++r;
    return r;
  };
  for (int64_t r0 = 0; r0 < T; r0 = row_end(r0)) {
    const int64_t r1 = row_end(r0);
    bool wide = avx512 && r1 - r0 >= kWideRows;
    for (int64_t row = r0 + 1; row < r1 && wide; ++row)
      wide = plan.row_slots[row] == plan.row_slots[r0];
    for (int64_t g = 0; g < Hkv; ++g) {
      unit_start.push_back(static_cast<int64_t>(queries.size()));
      unit_head.push_back(g);
      unit_wide.push_back(wide);
      for (int64_t row = r0; row < r1; ++row) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h)
          queries.push_back({qp + row * q_row + h * D, op + (row * H + h) * D,
                             plan.row_slots[row], plan.row_n[row]});
      }
    }
  }
  const int64_t nq = static_cast<int64_t>(queries.size());
  unit_start.push_back(nq);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), nq);
  // prefix[i]: the keys queries [0, i) see; share t starts at the query boundary nearest
  // t / threads of the total.
  std::vector<int64_t> prefix(nq + 1, 0), cut(threads + 1, nq);
  for (int64_t i = 0; i < nq; ++i) prefix[i + 1] = prefix[i] + queries[i].n;
  cut[0] = 0;
  for (int64_t t = 1; t < threads; ++t) {
    const double target = static_cast<double>(prefix[nq]) * t / threads;
    int64_t i = std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin();
    if (i > 0 && target - prefix[i - 1] < prefix[i] - target) --i;
    cut[t] = std::max(i, cut[t - 1]);
  }
  with_pool(k_buf, v_buf, [&](const auto* kp, const auto* vp) {
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> scores;
      for (int64_t t = t0; t < t1; ++t) {
        int64_t i = cut[t];
        int64_t u = std::upper_bound(unit_start.begin(), unit_start.end(), i) - unit_start.begin();
        --u;  // the unit holding query i
        for (; i < cut[t + 1]; ++u) {
          const int64_t end = std::min(cut[t + 1], unit_start[u + 1]), g = unit_head[u];
          while (i < end) {
            const int64_t count = std::min(kMaxQueries, end - i);
            attend(queries.data() + i, count, kp + g * D, vp + g * D, slot_stride, D,
                   static_cast<float>(sm_scale), scores, unit_wide[u]);
            i += count;
          }
        }
      }
    });
  });
  return out;
}

// k_buf[loc[i]] = k[i] and v_buf[loc[i]] = v[i]: the new tokens' fp32 K/V into the pool (fp32
// or fp16) in one call (k and v may be views of a fused projection: heads contiguous, any row
// stride). Prefill, decode and verify rows all store through here, so a key's pool bits do not
// depend on which kind of forward wrote it.
void store_kv_rows(const at::Tensor& k_buf, const at::Tensor& v_buf, const int64_t* loc,
                   const HeadRows& k, const HeadRows& v) {
  check_pool(k_buf, v_buf);
  const int64_t T = k.rows, width = k_buf.size(1) * k_buf.size(2), slots = k_buf.size(0);
  TORCH_CHECK(v.rows == T && k.heads * k.dim == width && v.heads * v.dim == width,
              "k, v [T, kv_heads, D] as the buffers' rows");
  with_pool(k_buf, v_buf, [&](auto* kb, auto* vb) {
    for (int64_t i = 0; i < T; ++i) {
      TORCH_CHECK(loc[i] >= 0 && loc[i] < slots, "slot out of range");
      store_row(k.data + i * k.row_stride, width, kb + loc[i] * width);
      store_row(v.data + i * v.row_stride, width, vb + loc[i] * width);
    }
  });
}

void store_kv_(const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& loc_in,
               const at::Tensor& k, const at::Tensor& v) {
  const at::Tensor loc = loc_in.to(at::kLong).contiguous();
  TORCH_CHECK(loc.numel() == k.size(0), "one slot per new token");
  store_kv_rows(k_buf, v_buf, loc.data_ptr<int64_t>(), head_rows(k), head_rows(v));
}

}  // namespace eagleserve_cpu

namespace {

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                           const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                           const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                           const at::Tensor& kv_lens, const c10::optional<at::Tensor>& tree_mask,
                           double sm_scale) {
  const eagleserve_cpu::RowPlan plan = eagleserve_cpu::plan_rows(
      q.size(0), req_to_token, req_pool_indices, prefix_lens, extend_lens, kv_lens, tree_mask);
  return eagleserve_cpu::attend_rows(plan, eagleserve_cpu::head_rows(q), k_buf, v_buf, sm_scale);
}

// "avx2" or "avx512" (where the CPU has it) for every later call, "auto" the best here, "" to
// ask; returns the ISA now in use.
std::string attention_isa(const std::string& isa) {
  if (isa == "auto") {
    use_avx512 = eagleserve_cpu::avx512_attention_supported();
  } else if (isa == "avx2") {
    use_avx512 = false;
  } else if (isa == "avx512") {
    TORCH_CHECK(eagleserve_cpu::avx512_attention_supported(), "this CPU has no AVX-512");
    use_avx512 = true;
  } else {
    TORCH_CHECK(isa.empty(), "isa: auto, avx2 or avx512 (or '' to ask), not ", isa);
  }
  return use_avx512 ? "avx512" : "avx2";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagleserve_cpu, lib) {
  lib.def("attention_isa(str isa) -> str", &attention_isa);
  lib.def("store_kv_(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc, Tensor k, Tensor v) -> ()",
          &eagleserve_cpu::store_kv_);
  lib.def(
      "paged_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor prefix_lens, Tensor extend_lens, Tensor kv_lens, "
      "Tensor? tree_mask, float sm_scale) -> Tensor",
      &paged_attention);
}
