// Week 5 Day 1: the kernels behind QuantizedMatvec, and the op that puts one in MLX's graph.
#include "quantized_matvec.h"

#include "common.h"

#include <algorithm>
#include <exception>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/ops.h>

namespace kernels {

// What one evaluation reads and writes. MLX runs the kernel later, on its own thread, so the
// task copies this (pointers and sizes), never a reference to the op's locals.
template <typename T>
struct Matvec {
  const T* x;             // [M, K]
  const uint32_t* codes;  // [N, K * bits / 32]
  const T* scales;        // [N, K / group_size]
  const T* biases;        // [N, K / group_size]
  T* y;                   // [M, N]
  int M, N, K, group_size, bits;
};

// ---------------------------------------------------------------------------------------------
// The plain loop: the definition, one weight at a time.

template <typename T>
void matvec_plain(const Matvec<T>& p) {
  throw std::runtime_error("Week 5 Day 1, Task 1: the plain loop - unpack each code, scale it, add the bias");
}

// ---------------------------------------------------------------------------------------------
// The fast kernel: eight codes at a time in SIMD lanes, R weight rows per pass over x, the
// bias taken out of the inner loop, the next rows' codes prefetched, a large product shared
// among the cores.

// y[n0 .. n0+R-1] for one row of x, given as float blocks x [K / 8] and the sum of each of its
// groups, xsum [K / group_size].
template <int BITS, int R, typename T>
void rows_at_once(const Matvec<T>& p, const f32x8* x, const float* xsum, int n0, T* y) {
  throw std::runtime_error("Week 5 Day 1, Task 2: R weight rows at once, eight codes per vector operation");
}

template <int BITS, typename T>
void matvec_fast_bits(const Matvec<T>& p) {
  throw std::runtime_error("Week 5 Day 1, Task 3: x as float blocks and group sums, then rows over the cores");
}

template <typename T>
void matvec_fast(const Matvec<T>& p) {
  switch (p.bits) {
    case 2:
      return matvec_fast_bits<2>(p);
    case 4:
      return matvec_fast_bits<4>(p);
    default:
      return matvec_fast_bits<8>(p);
  }
}

// ---------------------------------------------------------------------------------------------
// The primitive and its op.

template <typename T>
void launch(const std::vector<mx::array>& in, mx::array& out, int group_size, int bits,
            bool fast, mx::Stream stream) {
  const int K = in[0].shape(-1), N = in[1].shape(0);
  Matvec<T> p{in[0].data<T>(), in[1].data<uint32_t>(), in[2].data<T>(), in[3].data<T>(),
              out.data<T>(), int(in[0].size() / K), N, K, group_size, bits};
  mx::cpu::get_command_encoder(stream).dispatch([p, fast]() {
    if (fast) {
      matvec_fast(p);
    } else {
      matvec_plain(p);
    }
  });
}

void QuantizedMatvec::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  switch (out.dtype()) {
    case mx::float32:
      return launch<float>(inputs, out, group_size_, bits_, fast_, stream());
    case mx::float16:
      return launch<mx::float16_t>(inputs, out, group_size_, bits_, fast_, stream());
    default:
      return launch<mx::bfloat16_t>(inputs, out, group_size_, bits_, fast_, stream());
  }
}

void QuantizedMatvec::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("QuantizedMatvec has a CPU kernel only: run it on mx.cpu");
}

bool QuantizedMatvec::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantizedMatvec&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && fast_ == o.fast_;
}

// Every check before the node is made: a bad call fails here, with the shapes it got.
void check_quantized_inputs(const std::string& op, const mx::array& x, const mx::array& codes,
                            const mx::array& scales, const mx::array& biases, int group_size,
                            int bits) {
  auto fail = [&op](const std::string& what) { throw std::invalid_argument(op + ": " + what); };
  if (bits != 2 && bits != 4 && bits != 8) {
    fail("bits must be 2, 4 or 8, got " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    fail("x must be float32, float16 or bfloat16");
  }
  if (codes.dtype() != mx::uint32 || codes.ndim() != 2) {
    fail("codes must be a uint32 matrix [N, K * bits / 32], got " + shape_of(codes));
  }
  const int N = codes.shape(0), K = codes.shape(1) * 32 / bits;
  if (x.ndim() < 1 || x.shape(-1) != K) {
    fail("x " + shape_of(x) + " must end in K = " + std::to_string(K) + " (codes " +
         shape_of(codes) + " at " + std::to_string(bits) + " bits)");
  }
  const mx::Shape groups = {N, K / group_size};
  if (scales.shape() != groups || biases.shape() != groups) {
    fail("scales " + shape_of(scales) + " and biases " + shape_of(biases) + " must be [" +
         std::to_string(N) + ", " + std::to_string(K / group_size) + "] for group_size " +
         std::to_string(group_size));
  }
  if (scales.dtype() != x.dtype() || biases.dtype() != x.dtype()) {
    fail("scales and biases must have x's dtype");
  }
}

namespace {

// A kernel that throws (a task not written yet) must fail where Python sees it. Thrown on
// MLX's thread, an exception reaches Python once at best, and later evaluations read whatever
// the output's memory held. So each kernel first runs here, once, on a small problem.
void try_kernel(bool fast) {
  static bool tried[2] = {false, false};
  if (tried[fast]) {
    return;
  }
  // nine weight rows of 32 codes at 4 bits: a block of eight rows and one left over
  std::vector<float> x(32, 1.0f), scales(9, 1.0f), biases(9, 0.0f), y(9);
  std::vector<uint32_t> codes(9 * 4, 0x76543210u);
  Matvec<float> p{x.data(), codes.data(), scales.data(), biases.data(), y.data(), 1, 9, 32, 32, 4};
  fast ? matvec_fast(p) : matvec_plain(p);
  tried[fast] = true;
}

}  // namespace

mx::array quantized_matvec(const mx::array& x, const mx::array& codes, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, bool fast) {
  check_quantized_inputs("quantized_matvec", x, codes, scales, biases, group_size, bits);
  try_kernel(fast);
  mx::Stream stream = mx::default_stream(mx::Device::cpu);
  mx::Shape shape = x.shape();
  shape.back() = codes.shape(0);
  // The kernels index plain row-major memory: contiguous() copies only when an input is not.
  return mx::array(
      shape, x.dtype(), std::make_shared<QuantizedMatvec>(stream, group_size, bits, fast),
      {mx::contiguous(x, false, stream), mx::contiguous(codes, false, stream),
       mx::contiguous(scales, false, stream), mx::contiguous(biases, false, stream)});
}

}  // namespace kernels
