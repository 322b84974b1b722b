// Week 5: what every kernel of the course uses: eight-lane vectors and the work split over the
// cores.
#pragma once

#include <algorithm>
#include <cstring>
#include <exception>
#include <thread>
#include <type_traits>
#include <vector>

namespace kernels {

// Eight lanes of float: GCC and Clang compile arithmetic on these to vector instructions (one
// AVX2 register on x86, two NEON registers on ARM).
typedef float f32x8 __attribute__((vector_size(32)));

// Eight numbers from p[0 .. 7] as floats (p need not be aligned: memcpy is one unaligned load);
// float16 and bfloat16 are converted lane by lane, and everything after is float arithmetic.
template <typename T>
inline f32x8 load8(const T* p) {
  f32x8 v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else {
    for (int i = 0; i < 8; ++i) {
      v[i] = static_cast<float>(p[i]);
    }
  }
  return v;
}

inline float sum_lanes(f32x8 v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) {
    s += v[i];
  }
  return s;
}

// Runs work(begin, end) over [0, items) cut into one range per core (whole blocks of `block`
// items), the last range on this thread. `work_total` is what the kernel will do in all (weights
// read, multiply-adds); a thread starts only for each `enough` of it, since starting one costs
// about what a layer's product takes on one core (measured in chapter 5.1). An exception in a
// helper thread is thrown again here, after every thread has ended (escaping a std::thread, it
// would end the process).
template <typename F>
void over_ranges(int items, int block, size_t work_total, size_t enough, F work) {
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  const int threads = std::clamp<size_t>(work_total / enough, 1, cores);
  const int per_thread = ((items + threads - 1) / threads + block - 1) / block * block;
  std::vector<std::exception_ptr> errors(threads);
  auto run = [&](int t, int begin, int end) {
    try {
      work(begin, end);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  std::vector<std::thread> helpers;
  int begin = 0;
  for (; begin + per_thread < items; begin += per_thread) {
    helpers.emplace_back(run, int(helpers.size()), begin, begin + per_thread);
  }
  run(helpers.size(), begin, items);
  for (auto& t : helpers) {
    t.join();
  }
  for (auto& e : errors) {
    if (e) {
      std::rethrow_exception(e);
    }
  }
}

}  // namespace kernels
