// Week 5 Day 4: the kernels behind FewRowMatmul, and the ops that put one in MLX's graph.
#include "few_row_matmul.h"

#include "common.h"
#include "quantized_matvec.h"

#include <stdexcept>
#include <string>
#include <vector>

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/ops.h>

namespace kernels {

// Everything up to the primitive is this file's own (an unnamed namespace): another file's
// template of the same name and signature, such as Day 1's launch, would otherwise be merged
// with it by the linker, and one of the two called for both.
namespace {

// What one evaluation reads and writes (copied into MLX's task, as on Day 1).
template <typename T>
struct FewRow {
  const T* x;  // [M, K]
  const T* w;  // [N, K] float weights; or, when bits > 0, the packed weight:
  const uint32_t* codes;  // [N, K * bits / 32]
  const T* scales;        // [N, K / group_size]
  const T* biases;        // [N, K / group_size]
  T* y;                   // [M, N]
  int M, N, K, group_size, bits;
};

// ---------------------------------------------------------------------------------------------
// How the kernels read a weight: W[n, k] one at a time, or eight at once as a float vector,
// the same calls for either storage.

// Float weights, read where they lie.
template <typename T>
struct DenseRows {
  const T* w;
  size_t K;

  float one(int n, size_t k) const {
    return static_cast<float>(w[n * K + k]);
  }
  f32x8 eight(int n, size_t b) const {  // W[n, 8b .. 8b+7]
    return load8(w + n * K + 8 * b);
  }
  void prefetch(int n, size_t b) const {
    __builtin_prefetch(w + n * K + 8 * b);
  }
};

// Packed weights (Day 1's format): each code scaled and shifted by its group's scale and bias.
template <int BITS, typename T>
struct PackedRows {
  const uint32_t* codes;
  const T* scales;
  const T* biases;
  size_t words, groups;  // per weight row
  int group_shift;       // log2(group_size): column k is in group k >> group_shift

  float one(int n, size_t k) const {
    constexpr int per_word = 32 / BITS;
    uint32_t code = (codes[n * words + k / per_word] >> (k % per_word * BITS)) & ((1u << BITS) - 1);
    size_t g = n * groups + (k >> group_shift);
    return static_cast<float>(scales[g]) * code + static_cast<float>(biases[g]);
  }
  f32x8 eight(int n, size_t b) const {  // a group holds whole blocks of eight
    size_t g = n * groups + (8 * b >> group_shift);
    return eight_codes<BITS>(codes + n * words, b) * static_cast<float>(scales[g]) +
           static_cast<float>(biases[g]);
  }
  void prefetch(int n, size_t b) const {
    __builtin_prefetch(codes + n * words + b * BITS / 4);  // block b: BITS bytes
  }
};

// ---------------------------------------------------------------------------------------------
// The plain loop: the definition. Each row of x reads the whole weight again.

template <typename Rows, typename T>
void plain(const Rows& w, const FewRow<T>& p) {
  // BEGIN TASK Week 5 Day 4, Task 1: the plain loop - every row of x against every weight row
  for (int m = 0; m < p.M; ++m) {
    for (int n = 0; n < p.N; ++n) {
      float acc = 0.0f;
      for (int k = 0; k < p.K; ++k) {
        acc += static_cast<float>(p.x[size_t(m) * p.K + k]) * w.one(n, k);
      }
      p.y[size_t(m) * p.N + n] = static_cast<T>(acc);
    }
  }
  // END TASK
}

// ---------------------------------------------------------------------------------------------
// The tiled kernel: a tile of R weight rows x MB rows of x keeps its R * MB running sums in
// registers, so each eight weights are read (and unpacked) once for MB rows of x; the rows of x
// (a few KB) stay in the cache while the weights stream past once.

// y[m0 .. m0+MB-1, n0 .. n0+R-1], with x given as floats: row m at xf + m * ldx (ldx >= K, a
// multiple of eight, so that every block of eight is one aligned load).
template <int R, int MB, typename Rows, typename T>
void tile(const Rows& w, const float* xf, size_t ldx, const FewRow<T>& p, int m0, int n0) {
  // BEGIN TASK Week 5 Day 4, Task 2: one tile - R weight rows against MB rows of x, sums in registers
  const size_t K = p.K, blocks = K / 8;
  f32x8 acc[R][MB] = {};
  for (size_t b = 0; b < blocks; ++b) {
    f32x8 wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = w.eight(n0 + r, b);
    }
    if (m0 == 0 && b % 2 == 0) {  // the next R rows' line, fetched while this one computes
      for (int r = 0; r < R; ++r) {
        w.prefetch(n0 + R + r, b);
      }
    }
    for (int m = 0; m < MB; ++m) {
      f32x8 xv = load8(xf + (m0 + m) * ldx + 8 * b);
      for (int r = 0; r < R; ++r) {
        acc[r][m] += wv[r] * xv;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MB; ++m) {
      float sum = sum_lanes(acc[r][m]);
      for (size_t k = blocks * 8; k < K; ++k) {  // the last K % 8 columns, one at a time
        sum += w.one(n0 + r, k) * xf[(m0 + m) * ldx + k];
      }
      p.y[size_t(m0 + m) * p.N + n0 + r] = static_cast<T>(sum);
    }
  }
  // END TASK
}

// Weight rows n0 .. n0+R-1 against every row of x: tiles of four rows of x, then the rest
// (R x 4 = 16 sums: x86 with AVX-512 has 32 vector registers, AVX2 16; ARM NEON 32 of half the
// width, so an f32x8 takes two).
template <int R, typename Rows, typename T>
void against_all_rows(const Rows& w, const float* xf, size_t ldx, const FewRow<T>& p, int n0) {
  int m = 0;
  for (; m + 4 <= p.M; m += 4) {
    tile<R, 4>(w, xf, ldx, p, m, n0);
  }
  switch (p.M - m) {
    case 3:
      return tile<R, 3>(w, xf, ldx, p, m, n0);
    case 2:
      return tile<R, 2>(w, xf, ldx, p, m, n0);
    case 1:
      return tile<R, 1>(w, xf, ldx, p, m, n0);
  }
}

template <typename Rows, typename T>
void tiled(const Rows& w, const FewRow<T>& p) {
  // BEGIN TASK Week 5 Day 4, Task 3: x once as floats, then blocks of weight rows over the cores
  constexpr int R = 4;  // weight rows per tile: 4 x 4 sums, 4 weight and 1 x vector in registers
  const size_t ldx = (p.K + 7) / 8 * 8;  // x's rows padded to whole, aligned blocks of eight
  std::vector<f32x8> blocks(p.M * ldx / 8);
  float* xf = reinterpret_cast<float*>(blocks.data());
  for (int m = 0; m < p.M; ++m) {
    for (int k = 0; k < p.K; ++k) {
      xf[m * ldx + k] = static_cast<float>(p.x[size_t(m) * p.K + k]);
    }
  }
  // a helper per 256k multiply-adds: handing one a range costs a wake-up (chapter 5.4)
  over_ranges(p.N, R, size_t(p.M) * p.N * p.K, 1 << 18, [&](int begin, int end) {
    int n = begin;
    for (; n + R <= end; n += R) {
      against_all_rows<R>(w, xf, ldx, p, n);
    }
    for (; n < end; ++n) {
      against_all_rows<1>(w, xf, ldx, p, n);
    }
  });
  // END TASK
}

// ---------------------------------------------------------------------------------------------
// The primitive and its ops.

template <typename Rows, typename T>
void run(const Rows& w, const FewRow<T>& p, bool fast) {
  fast ? tiled(w, p) : plain(w, p);
}

template <typename T>
void run(const FewRow<T>& p, bool fast) {
  const size_t K = p.K;
  const int shift = __builtin_ctz(std::max(p.group_size, 1));
  switch (p.bits) {
    case 0:
      return run(DenseRows<T>{p.w, K}, p, fast);
    case 2:
      return run(PackedRows<2, T>{p.codes, p.scales, p.biases, K / 16, K >> shift, shift}, p, fast);
    case 4:
      return run(PackedRows<4, T>{p.codes, p.scales, p.biases, K / 8, K >> shift, shift}, p, fast);
    default:
      return run(PackedRows<8, T>{p.codes, p.scales, p.biases, K / 4, K >> shift, shift}, p, fast);
  }
}

template <typename T>
void launch(const std::vector<mx::array>& in, mx::array& out, int group_size, int bits,
            bool fast, mx::Stream stream) {
  const int K = in[0].shape(-1), N = out.shape(-1), M = K ? in[0].size() / K : 0;
  FewRow<T> p{in[0].data<T>(), nullptr, nullptr, nullptr, nullptr, out.data<T>(),
              M, N, K, group_size, bits};
  if (bits == 0) {
    p.w = in[1].data<T>();
  } else {
    p.codes = in[1].data<uint32_t>();
    p.scales = in[2].data<T>();
    p.biases = in[3].data<T>();
  }
  mx::cpu::get_command_encoder(stream).dispatch([p, fast]() { run(p, fast); });
}

}  // namespace

void FewRowMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
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

void FewRowMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("FewRowMatmul has a CPU kernel only: run it on mx.cpu");
}

bool FewRowMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const FewRowMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && fast_ == o.fast_;
}

namespace {

void check_float_inputs(const mx::array& x, const mx::array& w) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("few_row_matmul: " + what);
  };
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    fail("x must be float32, float16 or bfloat16");
  }
  if (w.ndim() != 2 || w.dtype() != x.dtype()) {
    fail("w must be a matrix [N, K] of x's dtype, got " + shape_of(w));
  }
  if (x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    fail("x " + shape_of(x) + " must end in w's K = " + std::to_string(w.shape(1)));
  }
}

// Each kernel runs once here, on a small problem, before its first node is made: a task not
// written yet fails where Python sees it (see try_kernel of Day 1).
void try_kernel(bool fast) {
  static bool tried[2] = {false, false};
  if (tried[fast]) {
    return;
  }
  // five rows of x against three weight rows of K = 35: a full tile, a left-over row of x
  // and of w, and a K not a multiple of eight; then the same x's first 32 columns against
  // three packed 4-bit rows
  std::vector<float> x(5 * 35, 1.0f), w(3 * 35, 1.0f), y(5 * 3), scales(3, 1.0f), biases(3);
  std::vector<uint32_t> codes(3 * 4, 0x76543210u);
  run(FewRow<float>{x.data(), w.data(), nullptr, nullptr, nullptr, y.data(), 5, 3, 35, 0, 0},
      fast);
  run(FewRow<float>{x.data(), nullptr, codes.data(), scales.data(), biases.data(), y.data(), 5,
                    3, 32, 32, 4},
      fast);
  tried[fast] = true;
}

mx::array make(const mx::array& x, int n, int group_size, int bits, bool fast,
               const std::vector<mx::array>& weights) {
  try_kernel(fast);
  mx::Stream stream = mx::default_stream(mx::Device::cpu);
  mx::Shape shape = x.shape();
  shape.back() = n;
  // The kernels index plain row-major memory: contiguous() copies only when an input is not.
  std::vector<mx::array> inputs = {mx::contiguous(x, false, stream)};
  for (const auto& a : weights) {
    inputs.push_back(mx::contiguous(a, false, stream));
  }
  return mx::array(shape, x.dtype(),
                   std::make_shared<FewRowMatmul>(stream, group_size, bits, fast), inputs);
}

}  // namespace

mx::array few_row_matmul(const mx::array& x, const mx::array& w, bool fast) {
  check_float_inputs(x, w);
  return make(x, w.shape(0), 0, 0, fast, {w});
}

mx::array few_row_quantized_matmul(const mx::array& x, const mx::array& codes,
                                   const mx::array& scales, const mx::array& biases,
                                   int group_size, int bits, bool fast) {
  check_quantized_inputs("few_row_quantized_matmul", x, codes, scales, biases, group_size, bits);
  return make(x, codes.shape(0), group_size, bits, fast, {codes, scales, biases});
}

}  // namespace kernels
