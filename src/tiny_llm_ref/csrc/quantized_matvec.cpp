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
  // BEGIN TASK Week 5 Day 1, Task 1: the plain loop - unpack each code, scale it, add the bias
  const int per_word = 32 / p.bits;         // codes in one uint32
  const uint32_t top = (1u << p.bits) - 1;  // the mask of one code
  const size_t words = p.K / per_word, groups = p.K / p.group_size;
  for (int m = 0; m < p.M; ++m) {
    for (int n = 0; n < p.N; ++n) {
      float acc = 0.0f;
      for (int k = 0; k < p.K; ++k) {
        uint32_t word = p.codes[n * words + k / per_word];
        uint32_t code = (word >> (k % per_word * p.bits)) & top;
        size_t g = n * groups + k / p.group_size;
        float w = static_cast<float>(p.scales[g]) * code + static_cast<float>(p.biases[g]);
        acc += static_cast<float>(p.x[size_t(m) * p.K + k]) * w;
      }
      p.y[size_t(m) * p.N + n] = static_cast<T>(acc);
    }
  }
  // END TASK
}

// ---------------------------------------------------------------------------------------------
// The fast kernel: eight codes at a time in SIMD lanes, R weight rows per pass over x, the
// bias taken out of the inner loop, the next rows' codes prefetched, a large product shared
// among the cores.

// y[n0 .. n0+R-1] for one row of x, given as float blocks x [K / 8] and the sum of each of its
// groups, xsum [K / group_size].
template <int BITS, int R, typename T>
void rows_at_once(const Matvec<T>& p, const f32x8* x, const float* xsum, int n0, T* y) {
  // BEGIN TASK Week 5 Day 1, Task 2: R weight rows at once, eight codes per vector operation
  // Over a group, sum_k x_k (s q_k + b) = s * sum_k x_k q_k + b * sum_k x_k: the inner loop
  // only multiplies codes, and the bias costs one multiply per group.
  const size_t words = size_t(p.K) * BITS / 32, groups = p.K / p.group_size;
  const int blocks = p.group_size / 8;  // blocks of eight codes in a group
  f32x8 acc[R] = {};                    // scale * sum(x * code), lane by lane
  float bias_part[R] = {};
  for (size_t g = 0; g < groups; ++g) {
    f32x8 dot[R] = {};
    for (size_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      for (int r = 0; r < R; ++r) {  // x[b] is loaded once for R rows
        dot[r] += x[b] * eight_codes<BITS>(p.codes + (n0 + r) * words, b);
      }
    }
    for (int r = 0; r < R; ++r) {
      // ask for the same group of the next R rows now: it arrives while this one is computed
      // (a prefetch past the last row is harmless: it never faults)
      __builtin_prefetch(p.codes + (n0 + R + r) * words + g * p.group_size * BITS / 32);
      size_t i = (n0 + r) * groups + g;
      acc[r] += static_cast<float>(p.scales[i]) * dot[r];
      bias_part[r] += static_cast<float>(p.biases[i]) * xsum[g];
    }
  }
  for (int r = 0; r < R; ++r) {
    y[n0 + r] = static_cast<T>(sum_lanes(acc[r]) + bias_part[r]);
  }
  // END TASK
}

template <int BITS, typename T>
void matvec_fast_bits(const Matvec<T>& p) {
  // BEGIN TASK Week 5 Day 1, Task 3: x as float blocks and group sums, then rows over the cores
  constexpr int R = 8;  // weight rows per pass over x: eight streams of codes in flight
  const int groups = p.K / p.group_size;
  std::vector<f32x8> x(p.K / 8);
  std::vector<float> xsum(groups);
  for (int m = 0; m < p.M; ++m) {
    float* xf = reinterpret_cast<float*>(x.data());
    for (int k = 0; k < p.K; ++k) {
      xf[k] = static_cast<float>(p.x[size_t(m) * p.K + k]);
    }
    for (int g = 0; g < groups; ++g) {
      xsum[g] = std::accumulate(xf + g * p.group_size, xf + (g + 1) * p.group_size, 0.0f);
    }
    T* y = p.y + size_t(m) * p.N;
    over_ranges(p.N, R, size_t(p.N) * p.K, 1 << 22, [&](int begin, int end) {
      int n = begin;
      for (; n + R <= end; n += R) {
        rows_at_once<BITS, R>(p, x.data(), xsum.data(), n, y);
      }
      for (; n < end; ++n) {
        rows_at_once<BITS, 1>(p, x.data(), xsum.data(), n, y);
      }
    });
  }
  // END TASK
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
