// Week 5: the Python module of the course's kernels. NB_DOMAIN mlx in CMakeLists.txt lets
// these functions take and return mx.array, MLX's own Python type.
#include <nanobind/nanobind.h>

#include "quantized_matvec.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(tiny_llm_ref_ext, m) {
  m.doc() = "The course's C++ kernels as MLX primitives (Week 5).";
  m.def("quantized_matvec", &kernels::quantized_matvec, "x"_a, "codes"_a, "scales"_a,
        "biases"_a, "group_size"_a, "bits"_a, "fast"_a,
        "x [..., K] @ W.T [..., N] for W [N, K] in MLX's affine format (on the CPU).");
}
