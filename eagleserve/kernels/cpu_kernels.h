// The kernels of this extension that cpu_layers.cpp composes, callable from C++ (each file
// registers its own op as well). Included, not compiled alone.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace eagleserve_cpu {

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d,
                     const at::Tensor& m, int64_t n);
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d,
                     const at::Tensor& wsum, int64_t n);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
void rope_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
           int64_t rotated_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);
void store_kv_(const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& loc,
               const at::Tensor& k, const at::Tensor& v);

// Rows of heads [rows, heads, dim] read through a raw pointer: each row's heads contiguous,
// rows `row_stride` floats apart (a slice of a fused q/k/v projection, taken without the
// dispatcher calls a tensor view costs on every layer).
struct HeadRows {
  const float* data = nullptr;
  int64_t rows = 0, heads = 0, dim = 0, row_stride = 0;
};
HeadRows head_rows(const at::Tensor& x);  // checks the layout of a [T, H, D] float32 tensor
// The new rows' K/V into their slots; loc int64 contiguous, one slot per row.
void store_kv_rows(const at::Tensor& k_buf, const at::Tensor& v_buf, const int64_t* loc,
                   const HeadRows& k, const HeadRows& v);

// Which keys each query row of a batch sees: host-side, from the batch's lengths alone, so one
// plan serves every layer of a forward.
struct RowPlan {
  int64_t rows = 0;
  std::vector<int64_t> row_req;              // the request of each row
  std::vector<const int64_t*> row_slots;     // its visible key slots, in position order
  std::vector<int64_t> row_n;                // how many
  std::vector<std::vector<int64_t>> gathered;  // a tree row's own slot list
  at::Tensor req_to_token;                   // int64, what causal rows' slots point into
};

RowPlan plan_rows(int64_t rows, const at::Tensor& req_to_token,
                  const at::Tensor& req_pool_indices, const at::Tensor& prefix_lens,
                  const at::Tensor& extend_lens, const at::Tensor& kv_lens,
                  const c10::optional<at::Tensor>& tree_mask);
at::Tensor attend_rows(const RowPlan& plan, const HeadRows& q, const at::Tensor& k_buf,
                       const at::Tensor& v_buf, double sm_scale);

}  // namespace eagleserve_cpu
