// Week 5 Day 1: a matrix-vector product over weights in MLX's affine format, as an MLX primitive.
#pragma once

#include <mlx/array.h>
#include <mlx/primitives.h>
#include <mlx/utils.h>

#include <string>

namespace kernels {

namespace mx = mlx::core;

// y [..., N] = x [..., K] @ W.T for a weight W [N, K] stored as codes [N, K * bits / 32]
// (uint32, the first code in the lowest bits) with scales and biases [N, K / group_size]:
// W[n, k] = scale[n, g] * code[n, k] + bias[n, g] for the group g = k / group_size.
// fast=false runs the plain loop (Task 1), fast=true the blocked, vectorized one (Task 2).
mx::array quantized_matvec(
    const mx::array& x,
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    bool fast);

// Raises std::invalid_argument (ValueError in Python), naming `op`, unless x [..., K], codes,
// scales and biases are one weight of that format (Day 4's kernel reads the same format).
void check_quantized_inputs(
    const std::string& op,
    const mx::array& x,
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits);

// One node of MLX's graph: it says how to compute its output from its inputs, and runs when
// the output is evaluated (mx.eval), not when the node is made.
class QuantizedMatvec : public mx::UnaryPrimitive {
 public:
  QuantizedMatvec(mx::Stream stream, int group_size, int bits, bool fast)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), fast_(fast) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "QuantizedMatvec";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
  bool fast_;
};

}  // namespace kernels
