// Week 5 Day 2: decode attention that walks page tables over the KV pool, as an MLX primitive.
#pragma once

#include <mlx/array.h>
#include <mlx/primitives.h>
#include <mlx/utils.h>

namespace kernels {

namespace mx = mlx::core;

// out [B, H_q, D]: row b's one query q[b] [H_q, D] attends to the first lengths[b] positions
// of its request, stored in the pages page_table[b, 0 ..] of key_pages / value_pages
// [num_pages, H_kv, P, D] (position s in page page_table[b, s / P], slot s % P). Query head h
// reads KV head h / (H_q / H_kv). A table is padded past its row's last page (any page number:
// it is never read). The softmax and the sums run in float32 whatever the inputs' dtype.
// fast=false runs the plain walk (Task 1), fast=true the grouped, vectorized one (Tasks 2, 3).
mx::array paged_decode_attention(
    const mx::array& q,
    const mx::array& key_pages,
    const mx::array& value_pages,
    const mx::array& page_table,
    const mx::array& lengths,
    float scale,
    bool fast);

class PagedDecodeAttention : public mx::UnaryPrimitive {
 public:
  PagedDecodeAttention(mx::Stream stream, float scale, bool fast)
      : mx::UnaryPrimitive(stream), scale_(scale), fast_(fast) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "PagedDecodeAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  bool fast_;
};

}  // namespace kernels
