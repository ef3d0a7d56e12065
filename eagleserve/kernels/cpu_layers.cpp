// The decoder layers of a packed CPU target in one call (models/cpu_layers.py), and an EAGLE-3
// head's layer with its lm_head in another: the kernels models/llama.py's modules call one by
// one from Python, in the same order on the same tensors (rms_norm, the q4 / q8 tiles, rope_,
// the K/V store, the paged attention, silu_mul, and torch's own adds for the residual), so the
// bits are theirs. What goes is the Python between them (module calls, views, dispatch) and
// the attention's row bookkeeping, planned once for every layer of the forward.

#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_kernels.h"

namespace {

// The phases' own timers (`phase_times`), off unless a benchmark turns them on (the torch
// profiler sees only the whole call, and its cost per recorded op inflates a forward by half).
struct PhaseTimes {
  std::atomic<bool> on{false};
  std::mutex m;
  // (name, seconds, calls); a name is a string literal, found by its address (no allocation)
  std::vector<std::tuple<const char*, double, int64_t>> totals;
};
PhaseTimes phase_times_;

// Runs f as phase `name` of a layer, its wall time added to phase_times_ when they are on
// (otherwise a flag test).
template <typename F>
auto phase(const char* name, F&& f) {
  if (!phase_times_.on.load(std::memory_order_relaxed)) return f();
  struct Timer {
    const char* name;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~Timer() {
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      const std::lock_guard<std::mutex> lock(phase_times_.m);
      for (auto& [n, seconds, calls] : phase_times_.totals) {
        if (n == name) {
          seconds += dt.count();
          ++calls;
          return;
        }
      }
      phase_times_.totals.emplace_back(name, dt.count(), 1);
    }
  } timer{name};
  return f();
}

// Turns the phase timers on or off; returns (names, seconds, calls) since the last call.
std::tuple<std::vector<std::string>, std::vector<double>, std::vector<int64_t>> phase_times(
    bool on) {
  const std::lock_guard<std::mutex> lock(phase_times_.m);
  std::tuple<std::vector<std::string>, std::vector<double>, std::vector<int64_t>> out;
  for (const auto& [name, seconds, calls] : phase_times_.totals) {
    std::get<0>(out).push_back(name);
    std::get<1>(out).push_back(seconds);
    std::get<2>(out).push_back(calls);
  }
  phase_times_.totals.clear();
  phase_times_.on.store(on);
  return out;
}

// acc += y, both contiguous float32 of one shape: the residual add as torch's `h + x` computes
// it (one IEEE fp32 add a value, so the same bits), without a TensorIterator's set-up per call.
void add_into(const at::Tensor& acc, const at::Tensor& y) {
  TORCH_CHECK(acc.is_contiguous() && y.is_contiguous() && acc.sizes() == y.sizes() &&
                  acc.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "residual add: two contiguous float32 tensors of one shape");
  float* a = acc.data_ptr<float>();
  const float* b = y.data_ptr<float>();
  const int64_t n = acc.numel();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  for (; i < n; ++i) a[i] += b[i];
}

// Per layer, in order: input norm weight; q/k/v tiles (w, d, m); o tiles; post-attention norm
// weight; gate/up tiles; down tiles.
constexpr int64_t kPerLayer = 14;

// A layer's attention from its fused projection qkv [T, heads + 2 kv_heads, D] (q and k
// rotated): k and v into their slots, then every planned row attends. q, k and v are the
// projection's head ranges, read in place (row stride (heads + 2 kv_heads) * D).
at::Tensor attend_projection(const eagleserve_cpu::RowPlan& plan, const at::Tensor& qkv,
                             int64_t heads, int64_t kv_heads, const at::Tensor& k_buf,
                             const at::Tensor& v_buf, const int64_t* slots, double sm_scale) {
  using eagleserve_cpu::HeadRows;
  const int64_t T = qkv.size(0), D = qkv.size(2), row = (heads + 2 * kv_heads) * D;
  const float* base = qkv.data_ptr<float>();
  const HeadRows q{base, T, heads, D, row}, k{base + heads * D, T, kv_heads, D, row};
  const HeadRows v{base + (heads + kv_heads) * D, T, kv_heads, D, row};
  eagleserve_cpu::store_kv_rows(k_buf, v_buf, slots, k, v);
  return eagleserve_cpu::attend_rows(plan, q, k_buf, v_buf, sm_scale);
}

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& h_in, at::TensorList weights, at::IntArrayRef out_features, double eps,
    int64_t heads, int64_t kv_heads, const at::Tensor& cos, const at::Tensor& signed_sin,
    at::TensorList k_buffers, at::TensorList v_buffers, const at::Tensor& out_cache_loc,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
    const at::Tensor& prefix_lens, const at::Tensor& extend_lens, const at::Tensor& kv_lens,
    const c10::optional<at::Tensor>& tree_mask, double sm_scale, at::IntArrayRef aux_layers) {
  using namespace eagleserve_cpu;
  const int64_t layers = static_cast<int64_t>(weights.size()) / kPerLayer;
  TORCH_CHECK(layers * kPerLayer == static_cast<int64_t>(weights.size()) &&
                  static_cast<int64_t>(out_features.size()) == 4 * layers &&
                  static_cast<int64_t>(k_buffers.size()) == layers &&
                  static_cast<int64_t>(v_buffers.size()) == layers,
              "per layer: 14 weight tensors, 4 output sizes, one K and one V buffer");
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat, "h [T, hidden] float32");
  const int64_t T = h_in.size(0), D = k_buffers[0].size(2);
  const RowPlan plan = plan_rows(T, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                                 kv_lens, tree_mask);
  // The residual stream, added to in place (add_into: the same fp32 adds as `h + x`).
  at::Tensor h = h_in.clone();
  // The new rows' slots, read by every layer's K/V write.
  const at::Tensor loc = out_cache_loc.to(at::kLong).contiguous();
  TORCH_CHECK(loc.numel() == T, "one slot per new token");
  const int64_t* slots = loc.data_ptr<int64_t>();
  // The states entering aux_layers side by side, [T, aux_layers * hidden]: what the module
  // path's torch.cat builds, written here so that no op runs for it after the call.
  const int64_t hidden = h_in.size(1);
  const int64_t num_aux = static_cast<int64_t>(aux_layers.size());
  at::Tensor aux = at::empty({T, num_aux * hidden}, h_in.options());
  int64_t next_aux = 0;
  for (int64_t i = 0; i < layers; ++i) {
    if (next_aux < num_aux && aux_layers[next_aux] == i) {
      aux.narrow(1, next_aux * hidden, hidden).copy_(h);
      ++next_aux;
    }
    const at::Tensor* w = weights.data() + i * kPerLayer;
    const int64_t* n = out_features.data() + 4 * i;
    // LlamaDecoderLayer.forward: h + self_attn(input_layernorm(h)) ...
    const at::Tensor x =
        phase("decoder_layers::input_norm", [&] { return rms_norm(h, w[0], eps); });
    const at::Tensor qkv = phase("decoder_layers::qkv_proj", [&] {
      return q4_matmul(x, w[1], w[2], w[3], n[0]).view({T, heads + 2 * kv_heads, D});
    });
    phase("decoder_layers::rope", [&] { rope_(qkv, cos, signed_sin, heads + kv_heads); });
    const at::Tensor attn = phase("decoder_layers::kv_store_attention", [&] {
      return attend_projection(plan, qkv, heads, kv_heads, k_buffers[i], v_buffers[i], slots,
                               sm_scale);
    });
    phase("decoder_layers::o_proj",
          [&] { add_into(h, q4_matmul(attn.view({T, -1}), w[4], w[5], w[6], n[1])); });
    // ... then h + mlp(post_attention_layernorm(h))
    const at::Tensor x2 =
        phase("decoder_layers::post_norm", [&] { return rms_norm(h, w[7], eps); });
    const at::Tensor gate_up = phase("decoder_layers::gate_up_proj",
                                     [&] { return q4_matmul(x2, w[8], w[9], w[10], n[2]); });
    const at::Tensor act = phase("decoder_layers::silu_mul", [&] { return silu_mul(gate_up); });
    phase("decoder_layers::down_proj",
          [&] { add_into(h, q4_matmul(act, w[11], w[12], w[13], n[3])); });
  }
  TORCH_CHECK(next_aux == num_aux, "aux layers: ascending layer indices");
  return {h, aux};
}

// The EAGLE-3 head's layer and lm_head (spec/eagle_head.py, EagleHead.forward) for a head on
// the q4 kernels beside a packed target, the modules' kernels in their order: input_ids [T]
// the new tokens (their rows of `embed`, the target's embedding table), features [T, F] what
// they continue from: the target's (F wider than h: fused by the fc tiles) or a draft step's
// (F = h, as they are). Weights, in order: input norm, hidden norm, q/k/v tiles (w, d, m), o
// tiles, post-attention norm, gate/up tiles, down tiles, final norm, lm_head tiles. Returns
// (logits, the layer's output: the next draft step's features) of every row, or with
// `last_rows` (one row per request, the last of its extend) of those rows alone: every row's
// K/V is written, and only they attend and run the rest. A one-layer head's K/V of a row
// depend on its own input alone, so this is the whole extend's result at those rows, bit for
// bit.
std::tuple<at::Tensor, at::Tensor> eagle3_layer(
    const at::Tensor& input_ids, const at::Tensor& features, const at::Tensor& embed,
    at::TensorList fc, at::TensorList w, at::IntArrayRef n,
    double eps, int64_t heads, int64_t kv_heads, const at::Tensor& cos,
    const at::Tensor& signed_sin, const at::Tensor& k_buf, const at::Tensor& v_buf,
    const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
    const at::Tensor& req_pool_indices, const at::Tensor& prefix_lens,
    const at::Tensor& extend_lens, const at::Tensor& kv_lens,
    const c10::optional<at::Tensor>& tree_mask, double sm_scale,
    const c10::optional<at::Tensor>& last_rows) {
  using namespace eagleserve_cpu;
  TORCH_CHECK(w.size() == 19 && n.size() == 5, "19 weight tensors, 5 output sizes");
  TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == at::kFloat, "embed [V, hidden] float32");
  TORCH_CHECK(features.dim() == 2 && features.scalar_type() == at::kFloat &&
                  features.size(0) == input_ids.numel(),
              "features [T, F] float32, one row per input id");
  const int64_t hidden = embed.size(1);
  const at::Tensor emb = at::embedding(embed, input_ids.to(at::kLong));
  at::Tensor g = features.contiguous();
  if (features.size(1) != hidden) {  // the target's features: fc fuses them
    TORCH_CHECK(fc.size() == 3, "features wider than the hidden size need the fc tiles");
    g = q4_matmul(g, fc[0], fc[1], fc[2], hidden);
  }
  const int64_t T = emb.size(0), D = k_buf.size(2);
  const at::Tensor loc = out_cache_loc.to(at::kLong).contiguous();
  TORCH_CHECK(loc.numel() == T, "one slot per new token");
  // Eagle3MidLayer: attention over cat(input_layernorm(emb), hidden_norm(g)), residual g ...
  const at::Tensor qkv = phase("eagle3_layer::norms_qkv_proj", [&] {
    const at::Tensor attn_in = at::cat({rms_norm(emb, w[0], eps), rms_norm(g, w[1], eps)}, 1);
    return q4_matmul(attn_in, w[2], w[3], w[4], n[0]).view({T, heads + 2 * kv_heads, D});
  });
  at::Tensor residual = g;
  const at::Tensor attn = phase("eagle3_layer::rope_kv_store_attention", [&] {
    rope_(qkv, cos, signed_sin, heads + kv_heads);
    if (!last_rows.has_value()) {
      const RowPlan plan = plan_rows(T, req_to_token, req_pool_indices, prefix_lens,
                                     extend_lens, kv_lens, tree_mask);
      return attend_projection(plan, qkv, heads, kv_heads, k_buf, v_buf,
                               loc.data_ptr<int64_t>(), sm_scale);
    }
    TORCH_CHECK(!tree_mask.has_value(), "last_rows: a causal extend");
    const at::Tensor rows = last_rows->to(at::kLong).contiguous();
    TORCH_CHECK(rows.numel() == extend_lens.numel(), "last_rows: one row per request");
    const int64_t row = (heads + 2 * kv_heads) * D;
    const float* base = qkv.data_ptr<float>();
    store_kv_rows(k_buf, v_buf, loc.data_ptr<int64_t>(),
                  HeadRows{base + heads * D, T, kv_heads, D, row},
                  HeadRows{base + (heads + kv_heads) * D, T, kv_heads, D, row});
    // Each last row attends as a one-token extend after the rest of its request's rows.
    const at::Tensor ones = at::ones_like(extend_lens);
    const RowPlan plan = plan_rows(rows.numel(), req_to_token, req_pool_indices,
                                   prefix_lens + extend_lens - ones, ones, kv_lens, tree_mask);
    const at::Tensor q = qkv.index_select(0, rows);
    residual = residual.index_select(0, rows);
    return attend_rows(plan, HeadRows{q.data_ptr<float>(), q.size(0), heads, D, row}, k_buf,
                       v_buf, sm_scale);
  });
  const int64_t R = residual.size(0);
  const at::Tensor x = phase("eagle3_layer::o_proj", [&] {
    at::Tensor y = q4_matmul(attn.view({R, -1}), w[5], w[6], w[7], n[1]);
    add_into(y, residual);  // g + y (fp32 addition commutes bit for bit)
    return y;
  });
  // ... then x + mlp(post_attention_layernorm(x)); the logits read norm(out).
  const at::Tensor out = phase("eagle3_layer::mlp", [&] {
    const at::Tensor act = silu_mul(q4_matmul(rms_norm(x, w[8], eps), w[9], w[10], w[11], n[2]));
    at::Tensor y = q4_matmul(act, w[12], w[13], w[14], n[3]);
    add_into(y, x);  // x + y
    return y;
  });
  return {phase("eagle3_layer::lm_head",
                [&] { return q4_matmul(rms_norm(out, w[15], eps), w[16], w[17], w[18], n[4]); }),
          out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagleserve_cpu, lib) {
  lib.def("phase_times(bool on) -> (str[], float[], int[])", &phase_times);
  lib.def(
      "eagle3_layer(Tensor input_ids, Tensor features, Tensor embed, Tensor[] fc, "
      "Tensor[] weights, int[] out_features, float eps, "
      "int heads, int kv_heads, Tensor cos, Tensor signed_sin, Tensor k_buf, Tensor v_buf, "
      "Tensor out_cache_loc, Tensor req_to_token, Tensor req_pool_indices, Tensor prefix_lens, "
      "Tensor extend_lens, Tensor kv_lens, Tensor? tree_mask, float sm_scale, "
      "Tensor? last_rows) -> (Tensor, Tensor)",
      &eagle3_layer);
  lib.def(
      "decoder_layers(Tensor h, Tensor[] weights, int[] out_features, float eps, int heads, "
      "int kv_heads, Tensor cos, Tensor signed_sin, Tensor[] k_buffers, Tensor[] v_buffers, "
      "Tensor out_cache_loc, Tensor req_to_token, Tensor req_pool_indices, Tensor prefix_lens, "
      "Tensor extend_lens, Tensor kv_lens, Tensor? tree_mask, float sm_scale, int[] aux_layers) "
      "-> (Tensor, Tensor)",
      &decoder_layers);
}
