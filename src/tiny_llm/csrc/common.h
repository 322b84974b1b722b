// Week 5: what every kernel of the course uses: eight-lane vectors and the work split over the
// cores.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <mlx/array.h>

namespace kernels {

namespace mx = mlx::core;

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

// Eight lanes of uint32, as f32x8 holds eight floats.
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// The codes of block b (codes 8b .. 8b+7) of one weight row in MLX's affine format (Day 1:
// the first code in the lowest bits), as floats.
template <int BITS>
inline f32x8 eight_codes(const uint32_t* row, size_t b) {
  constexpr uint32_t top = (1u << BITS) - 1;
  u32x8 words, shifts;
  if constexpr (BITS == 4) {  // one word holds the block
    words = u32x8{} + row[b];
    shifts = u32x8{0, 4, 8, 12, 16, 20, 24, 28};
  } else if constexpr (BITS == 8) {  // two words
    uint32_t lo = row[2 * b], hi = row[2 * b + 1];
    words = u32x8{lo, lo, lo, lo, hi, hi, hi, hi};
    shifts = u32x8{0, 8, 16, 24, 0, 8, 16, 24};
  } else {  // BITS == 2: half a word
    words = u32x8{} + (row[b / 2] >> (b % 2 * 16));
    shifts = u32x8{0, 2, 4, 6, 8, 10, 12, 14};
  }
  return __builtin_convertvector((words >> shifts) & top, f32x8);
}

// Helper threads started once per process and kept, one per core but the caller's (chapter
// 5.4): handing one work costs a wake-up where starting a thread costs tens of microseconds,
// and on a busy machine a new thread can wait a whole time slice for a core. Between rounds a
// helper spins a little before it sleeps, since a decode step calls kernels back to back.
class Helpers {
 public:
  // This process's helpers (a forked child makes its own: threads do not survive a fork).
  static Helpers& get() {
    static std::mutex guard;  // the first call may come from two threads at once
    std::lock_guard<std::mutex> lock(guard);
    static Helpers* helpers = nullptr;
    static pid_t owner = 0;
    if (helpers == nullptr || owner != getpid()) {
      helpers = new Helpers(std::max(1u, std::thread::hardware_concurrency()) - 1);  // kept
      owner = getpid();
    }
    return *helpers;
  }

  int size() const {
    return int(threads_.size());
  }

  // Runs work(t) for t in [0, count): 0 on this thread, the others on helpers, and returns once
  // every one has ended. An exception thrown by any of them is thrown again here. A second
  // caller while one runs (another thread) does all of its work itself.
  void run(int count, const std::function<void(int)>& work) {
    std::unique_lock<std::mutex> caller(caller_, std::try_to_lock);
    if (!caller.owns_lock() || count == 1) {
      for (int t = 0; t < count; ++t) {
        work(t);
      }
      return;
    }
    std::vector<std::exception_ptr> errors(count);
    {
      std::lock_guard<std::mutex> lock(m_);
      work_ = &work, errors_ = &errors, count_ = count;
      busy_.store(count - 1);
      round_.store(round_.load() + 1);
    }
    wake_.notify_all();
    try {
      work(0);
    } catch (...) {
      errors[0] = std::current_exception();
    }
    spin_while([this] { return busy_.load() > 0; });
    std::unique_lock<std::mutex> lock(m_);
    done_.wait(lock, [this] { return busy_.load() == 0; });
    for (auto& e : errors) {
      if (e) {
        std::rethrow_exception(e);
      }
    }
  }

 private:
  explicit Helpers(int n) {
    for (int t = 1; t <= n; ++t) {
      threads_.emplace_back([this, t] { serve(t); }).detach();  // they end with the process
    }
  }

  // Waits while waiting() holds, for at most about a tenth of a millisecond, without sleeping.
  template <typename F>
  static void spin_while(F waiting) {
    for (int i = 0; i < 2000 && waiting(); ++i) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }

  void serve(int t) {
    int seen = 0;
    for (;;) {
      spin_while([&] { return round_.load() == seen; });
      std::unique_lock<std::mutex> lock(m_);
      wake_.wait(lock, [&] { return round_.load() != seen; });
      seen = round_.load();
      if (t >= count_) {
        continue;  // this round needs fewer helpers
      }
      const std::function<void(int)>* work = work_;
      std::vector<std::exception_ptr>* errors = errors_;
      lock.unlock();
      try {  // an exception escaping a thread would end the process
        (*work)(t);
      } catch (...) {
        (*errors)[t] = std::current_exception();
      }
      if (busy_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> done(m_);  // the caller may be about to wait
        done_.notify_one();
      }
    }
  }

  std::vector<std::thread> threads_;
  std::mutex caller_, m_;  // caller_: one run at a time; m_: the round's fields below
  std::condition_variable wake_, done_;
  const std::function<void(int)>* work_ = nullptr;
  std::vector<std::exception_ptr>* errors_ = nullptr;
  int count_ = 0;
  std::atomic<int> busy_{0}, round_{0};  // helpers still at work; rounds handed out so far
};

// Runs work(begin, end) over [0, items) in pieces of whole blocks of `block` items, on this
// thread and on Helpers: each takes the next piece until none is left, so a helper that wakes
// late does less. `work_total` is what the kernel will do in all (weights read, multiply-adds):
// a helper joins in only for each `enough` of it, since handing work over costs time too.
template <typename F>
void over_ranges(int items, int block, size_t work_total, size_t enough, F work) {
  Helpers& helpers = Helpers::get();
  const int threads = std::clamp<size_t>(work_total / enough, 1, helpers.size() + 1);
  if (threads == 1) {
    work(0, items);
    return;
  }
  const int piece = std::max(block, (items / (8 * threads) + block - 1) / block * block);
  std::atomic<int> next{0};
  helpers.run(threads, [&](int) {
    for (int begin = next.fetch_add(piece); begin < items; begin = next.fetch_add(piece)) {
      work(begin, std::min(items, begin + piece));
    }
  });
}

// "[2, 3]": an array's shape, for error messages.
inline std::string shape_of(const mx::array& a) {
  std::string s = "[";
  for (int i = 0; i < a.ndim(); ++i) {
    s += (i ? ", " : "") + std::to_string(a.shape(i));
  }
  return s + "]";
}

}  // namespace kernels
