// Week 5 Day 3: the kernels behind GroupedMatmul, and the op that puts one in MLX's graph.
#include "grouped_matmul.h"

#include "common.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/ops.h>

namespace kernels {

// What one evaluation reads and writes, copied into the task MLX runs later (as in Day 1).
template <typename T>
struct Grouped {
  const T* x;              // [M, K], the rows (one per (token, expert) pair)
  const T* w;              // [E, N, K], the experts' weights stacked
  const int32_t* experts;  // [M], the expert of each row, sorted ascending
  T* y;                    // [M, N]
  int M, N, K, E;
};

// The expert of row i, or -1 when it is outside [0, E): that row's output is NaN.
template <typename T>
int expert_of(const Grouped<T>& p, int i) {
  int e = p.experts[i];
  return e >= 0 && e < p.E ? e : -1;
}

template <typename T>
void fill_nan(const Grouped<T>& p, int i) {
  std::fill(p.y + size_t(i) * p.N, p.y + size_t(i + 1) * p.N,
            static_cast<T>(std::numeric_limits<float>::quiet_NaN()));
}

// ---------------------------------------------------------------------------------------------
// The plain loop: the definition, one dot product at a time.

template <typename T>
void grouped_plain(const Grouped<T>& p) {
  throw std::runtime_error("Week 5 Day 3, Task 1: the plain loop - one dot product per row and weight row");
}

// ---------------------------------------------------------------------------------------------
// The fast kernel: the rows of one run (rows sharing an expert) multiplied together, a tile of
// R rows x C weight rows in registers, eight values of K per vector operation, the weight rows
// shared among the cores.

// y[i0 .. i0+R-1, n0 .. n0+C-1] for R rows of one run, x [R, K] from row i0, and C rows of their
// expert's weight, w_e [N, K] from row n0: R x C dot products over K at once. Each weight vector
// is loaded once for the R rows and each x vector once for the C weight rows.
template <int R, int C, typename T>
void tile(const Grouped<T>& p, const T* w_e, int i0, int n0) {
  throw std::runtime_error("Week 5 Day 3, Task 2: a tile of R run rows x C weight rows, 8 values of K at once");
}

constexpr int TILE_ROWS = 4;    // R: rows of a run per tile
constexpr int TILE_WEIGHTS = 4;  // C: weight rows per tile (R x C accumulators in registers)

// Weight rows n .. n+C-1 of expert e against every row of one run [begin, end): whole tiles of
// R rows, then the rows left over one at a time.
template <int C, typename T>
void run_against(const Grouped<T>& p, int e, int begin, int end, int n) {
  const T* w_e = p.w + size_t(e) * p.N * p.K;  // [N, K]
  int i = begin;
  for (; i + TILE_ROWS <= end; i += TILE_ROWS) {
    tile<TILE_ROWS, C>(p, w_e, i, n);
  }
  for (; i < end; ++i) {
    tile<1, C>(p, w_e, i, n);
  }
}

template <typename T>
void grouped_fast(const Grouped<T>& p) {
  throw std::runtime_error("Week 5 Day 3, Task 3: the runs of rows sharing an expert, weight rows over the cores");
}

// ---------------------------------------------------------------------------------------------
// The primitive and its op.

template <typename T>
void launch(const std::vector<mx::array>& in, mx::array& out, bool fast, mx::Stream stream) {
  Grouped<T> p{in[0].data<T>(), in[1].data<T>(), in[2].data<int32_t>(), out.data<T>(),
               int(in[0].shape(0)), int(in[1].shape(1)), int(in[0].shape(1)),
               int(in[1].shape(0))};
  mx::cpu::get_command_encoder(stream).dispatch([p, fast]() {
    if (fast) {
      grouped_fast(p);
    } else {
      grouped_plain(p);
    }
  });
}

void GroupedMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  switch (out.dtype()) {
    case mx::float32:
      return launch<float>(inputs, out, fast_, stream());
    case mx::float16:
      return launch<mx::float16_t>(inputs, out, fast_, stream());
    default:
      return launch<mx::bfloat16_t>(inputs, out, fast_, stream());
  }
}

void GroupedMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("GroupedMatmul has a CPU kernel only: run it on mx.cpu");
}

bool GroupedMatmul::is_equivalent(const mx::Primitive& other) const {
  return fast_ == static_cast<const GroupedMatmul&>(other).fast_;
}

namespace {

// Every check before the node is made: a bad call fails here, with the shapes it got.
void check_inputs(const mx::array& x, const mx::array& w, const mx::array& experts) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("grouped_matmul: " + what);
  };
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    fail("x must be float32, float16 or bfloat16");
  }
  if (x.ndim() != 2) {
    fail("x must be a matrix [M, K], got " + shape_of(x));
  }
  if (w.ndim() != 3 || w.shape(2) != x.shape(1)) {
    fail("w must be the experts' weights [E, N, K] with x's K = " + std::to_string(x.shape(1)) +
         ", got " + shape_of(w));
  }
  if (w.dtype() != x.dtype()) {
    fail("w must have x's dtype");
  }
  if (experts.dtype() != mx::int32 || experts.ndim() != 1 || experts.shape(0) != x.shape(0)) {
    fail("experts must be int32 [M] with x's M = " + std::to_string(x.shape(0)) + ", got " +
         shape_of(experts));
  }
}

// As in Day 1: each kernel first runs here, once, on a small problem, so a kernel that throws
// (a task not written yet) fails where Python sees it, not later on MLX's thread.
void try_kernel(bool fast) {
  static bool tried[2] = {false, false};
  if (tried[fast]) {
    return;
  }
  // 7 rows, K = 11, 3 experts of N = 5 weight rows: runs of 5 and 2 rows, expert 1 unused
  std::vector<float> x(7 * 11, 1.0f), w(3 * 5 * 11, 1.0f), y(7 * 5);
  std::vector<int32_t> experts = {0, 0, 0, 0, 0, 2, 2};
  Grouped<float> p{x.data(), w.data(), experts.data(), y.data(), 7, 5, 11, 3};
  fast ? grouped_fast(p) : grouped_plain(p);
  tried[fast] = true;
}

}  // namespace

mx::array grouped_matmul(const mx::array& x, const mx::array& w, const mx::array& experts,
                         bool fast) {
  check_inputs(x, w, experts);
  try_kernel(fast);
  mx::Stream stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      {x.shape(0), w.shape(1)}, x.dtype(), std::make_shared<GroupedMatmul>(stream, fast),
      {mx::contiguous(x, false, stream), mx::contiguous(w, false, stream),
       mx::contiguous(experts, false, stream)});
}

}  // namespace kernels
