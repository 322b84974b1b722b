// Week 5 Day 4: x @ W.T for the few rows of a decode step, each weight read once for all of
// them, as an MLX primitive.
#pragma once

#include <mlx/array.h>
#include <mlx/primitives.h>
#include <mlx/utils.h>

namespace kernels {

namespace mx = mlx::core;

// y [..., N] = x [..., K] @ W.T for a float weight W [N, K] of x's dtype. Any number of rows
// is right; the kernel is made for a few (1 to 16): it reads W once for all of them.
// fast=false runs the plain loop (Task 1), fast=true the tiled one (Tasks 2 and 3).
mx::array few_row_matmul(const mx::array& x, const mx::array& w, bool fast);

// The same for W in MLX's affine format (Day 1): codes [N, K * bits / 32] uint32, scales and
// biases [N, K / group_size] in x's dtype.
mx::array few_row_quantized_matmul(
    const mx::array& x,
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    bool fast);

// Its node in MLX's graph: inputs (x, w) for float weights (bits == 0), or
// (x, codes, scales, biases).
class FewRowMatmul : public mx::UnaryPrimitive {
 public:
  FewRowMatmul(mx::Stream stream, int group_size, int bits, bool fast)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), fast_(fast) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "FewRowMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;  // 0: float weights
  bool fast_;
};

}  // namespace kernels
