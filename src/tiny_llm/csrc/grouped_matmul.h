// Week 5 Day 3: the experts' matmul of a mixture of experts, rows grouped by expert, as an MLX
// primitive.
#pragma once

#include <mlx/array.h>
#include <mlx/primitives.h>
#include <mlx/utils.h>

namespace kernels {

namespace mx = mlx::core;

// y [M, N] with y[i] = x[i] @ w[experts[i]].T, for x [M, K], the experts' weights stacked
// w [E, N, K] and experts [M] (int32, sorted ascending for speed: the rows of one expert form a
// run, and a run reads its expert's weights once). Any order gives the same result; a row whose
// expert is outside [0, E) comes out as NaN. fast=false runs the plain loop (Task 1), fast=true
// the tiled one (Tasks 2 and 3).
mx::array grouped_matmul(
    const mx::array& x, const mx::array& w, const mx::array& experts, bool fast);

class GroupedMatmul : public mx::UnaryPrimitive {
 public:
  GroupedMatmul(mx::Stream stream, bool fast) : mx::UnaryPrimitive(stream), fast_(fast) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "GroupedMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  bool fast_;
};

}  // namespace kernels
