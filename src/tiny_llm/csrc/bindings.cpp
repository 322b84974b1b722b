// Week 5: the Python module of the course's kernels. NB_DOMAIN mlx in CMakeLists.txt lets
// these functions take and return mx.array, MLX's own Python type.
#include <nanobind/nanobind.h>

#include "quantized_matvec.h"
#include "grouped_matmul.h"
#include "paged_attention.h"
#include "few_row_matmul.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(tiny_llm_ext, m) {
  m.doc() = "The course's C++ kernels as MLX primitives (Week 5).";
  m.def("quantized_matvec", &kernels::quantized_matvec, "x"_a, "codes"_a, "scales"_a,
        "biases"_a, "group_size"_a, "bits"_a, "fast"_a,
        "x [..., K] @ W.T [..., N] for W [N, K] in MLX's affine format (on the CPU).");
  m.def("paged_decode_attention", &kernels::paged_decode_attention, "q"_a, "key_pages"_a,
        "value_pages"_a, "page_table"_a, "lengths"_a, "scale"_a, "fast"_a,
        "Decode attention [B, H_q, D] over page tables into a KV pool (on the CPU).");
  m.def("grouped_matmul", &kernels::grouped_matmul, "x"_a, "w"_a, "experts"_a, "fast"_a,
        "y [M, N] with y[i] = x[i] @ w[experts[i]].T, for x [M, K], w [E, N, K] and experts "
        "[M] int32 sorted ascending (on the CPU).");
  m.def("few_row_matmul", &kernels::few_row_matmul, "x"_a, "w"_a, "fast"_a,
        "x [..., K] @ w.T [..., N] for a float weight w [N, K], made for a few rows of x "
        "(on the CPU).");
  m.def("few_row_quantized_matmul", &kernels::few_row_quantized_matmul, "x"_a, "codes"_a,
        "scales"_a, "biases"_a, "group_size"_a, "bits"_a, "fast"_a,
        "x [..., K] @ W.T [..., N] for W [N, K] in MLX's affine format, made for a few rows "
        "of x (on the CPU).");
}
