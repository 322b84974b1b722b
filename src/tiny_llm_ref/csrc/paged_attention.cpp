// Week 5 Day 2: the kernels behind PagedDecodeAttention, and the op that puts one in MLX's graph.
#include "paged_attention.h"

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/ops.h>
#include <mlx/transforms.h>

namespace kernels {

// What one evaluation reads and writes (pointers and sizes, copied into MLX's task).
template <typename T>
struct PagedDecode {
  const T* q;               // [B, H_q, D]
  const T* keys;            // [num_pages, H_kv, P, D]
  const T* values;          // [num_pages, H_kv, P, D]
  const int32_t* table;     // [B, W]
  const int32_t* lengths;   // [B]
  T* out;                   // [B, H_q, D]
  int B, H_q, H_kv, P, D, W;
  float scale;

  // Where the D numbers of position s of row b, KV head kv start in keys / values.
  size_t at(int b, int kv, int s) const {
    size_t page = table[size_t(b) * W + s / P];
    return ((page * H_kv + kv) * P + s % P) * D;
  }
};

// ---------------------------------------------------------------------------------------------
// The plain walk: the definition, one query head and one position at a time.

template <typename T>
void decode_plain(const PagedDecode<T>& p) {
  // BEGIN TASK Week 5 Day 2, Task 1: the plain walk - every position of one query head online
  const int group = p.H_q / p.H_kv;  // query heads per KV head
  std::vector<float> acc(p.D);       // sum of exp(score - m) * value, not yet divided by l
  for (int b = 0; b < p.B; ++b) {
    for (int h = 0; h < p.H_q; ++h) {
      const T* q = p.q + (size_t(b) * p.H_q + h) * p.D;
      const int kv = h / group;
      float m = -INFINITY, l = 0.0f;  // the largest score so far, sum of exp(score - m)
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int s = 0; s < p.lengths[b]; ++s) {
        const T* k = p.keys + p.at(b, kv, s);
        const T* v = p.values + p.at(b, kv, s);
        float score = 0.0f;
        for (int d = 0; d < p.D; ++d) {
          score += static_cast<float>(q[d]) * static_cast<float>(k[d]);
        }
        score *= p.scale;
        const float m_new = std::max(m, score);
        const float c = std::exp(m - m_new), w = std::exp(score - m_new);  // c: 0 at first
        l = l * c + w;
        for (int d = 0; d < p.D; ++d) {
          acc[d] = acc[d] * c + w * static_cast<float>(v[d]);
        }
        m = m_new;
      }
      T* out = p.out + (size_t(b) * p.H_q + h) * p.D;
      for (int d = 0; d < p.D; ++d) {
        out[d] = static_cast<T>(acc[d] / l);
      }
    }
  }
  // END TASK
}

// ---------------------------------------------------------------------------------------------
// The fast walk: one (row, KV head) at a time with its whole group of query heads, so each key
// and value is read once for the group; a page at a time; eight lanes of D per operation.

// Working memory of one thread, sized for a group of G query heads and pages of P slots.
struct Scratch {
  std::vector<f32x8> q, acc, row;  // [G, D / 8], [G, D / 8], [D / 8]
  std::vector<float> m, l, scores;  // [G], [G], [G, P]
  Scratch(int G, int D, int P)
      : q(G * D / 8), acc(G * D / 8), row(D / 8), m(G), l(G), scores(G * P) {}
};

// out[b, kv * G .. kv * G + G - 1] for the G query heads that share KV head kv.
template <typename T>
void decode_group(const PagedDecode<T>& p, int b, int kv, Scratch& s) {
  // BEGIN TASK Week 5 Day 2, Task 2: one KV head with its query group, a page at a time
  const int G = p.H_q / p.H_kv, blocks = p.D / 8;
  const T* q0 = p.q + (size_t(b) * p.H_q + size_t(kv) * G) * p.D;  // [G, D]
  for (int i = 0; i < G * blocks; ++i) {
    s.q[i] = load8(q0 + 8 * i) * p.scale;  // the scale applied once, to the query
    s.acc[i] = f32x8{};
  }
  std::fill(s.m.begin(), s.m.end(), -INFINITY);
  std::fill(s.l.begin(), s.l.end(), 0.0f);
  const int length = p.lengths[b];
  for (int first = 0; first < length; first += p.P) {
    const int n = std::min(p.P, length - first);  // the last page may be partly filled
    const T* k = p.keys + p.at(b, kv, first);       // [n, D] of this page, this KV head
    const T* v = p.values + p.at(b, kv, first);
    for (int j = 0; j < n; ++j) {  // scores [G, n]: each key read once for the group
      for (int i = 0; i < blocks; ++i) {
        s.row[i] = load8(k + size_t(j) * p.D + 8 * i);
      }
      for (int g = 0; g < G; ++g) {
        f32x8 dot[4] = {};  // four sums in flight, not one chain of dependent adds
        for (int i = 0; i < blocks; ++i) {
          dot[i % 4] += s.q[g * blocks + i] * s.row[i];
        }
        s.scores[g * p.P + j] = sum_lanes((dot[0] + dot[1]) + (dot[2] + dot[3]));
      }
    }
    for (int g = 0; g < G; ++g) {  // the online softmax, a page at a time
      float* w = s.scores.data() + g * p.P;
      const float m_new = std::max(s.m[g], *std::max_element(w, w + n));
      const float c = std::exp(s.m[g] - m_new);  // the old sums, moved to the new max
      s.l[g] *= c;
      for (int i = 0; i < blocks; ++i) {
        s.acc[g * blocks + i] *= c;
      }
      for (int j = 0; j < n; ++j) {
        w[j] = std::exp(w[j] - m_new);
        s.l[g] += w[j];
      }
      s.m[g] = m_new;
    }
    for (int j = 0; j < n; ++j) {  // acc [G, D] += weights [G, n] @ values [n, D]
      for (int i = 0; i < blocks; ++i) {
        s.row[i] = load8(v + size_t(j) * p.D + 8 * i);
      }
      for (int g = 0; g < G; ++g) {
        const float w = s.scores[g * p.P + j];
        for (int i = 0; i < blocks; ++i) {
          s.acc[g * blocks + i] += w * s.row[i];
        }
      }
    }
  }
  T* out = p.out + (size_t(b) * p.H_q + size_t(kv) * G) * p.D;  // [G, D]
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < blocks; ++i) {
      f32x8 o = s.acc[g * blocks + i] / s.l[g];
      for (int lane = 0; lane < 8; ++lane) {
        out[g * p.D + 8 * i + lane] = static_cast<T>(o[lane]);
      }
    }
  }
  // END TASK
}

template <typename T>
void decode_fast(const PagedDecode<T>& p) {
  // BEGIN TASK Week 5 Day 2, Task 3: every (row, KV head) pair, the pairs shared among the cores
  size_t positions = 0;
  for (int b = 0; b < p.B; ++b) {
    positions += p.lengths[b];
  }
  const size_t work = positions * p.H_kv * p.D * 2;  // keys and values read
  over_ranges(p.B * p.H_kv, 1, work, 1 << 21, [&](int begin, int end) {
    Scratch s(p.H_q / p.H_kv, p.D, p.P);  // one per thread
    for (int pair = begin; pair < end; ++pair) {
      decode_group(p, pair / p.H_kv, pair % p.H_kv, s);
    }
  });
  // END TASK
}

// ---------------------------------------------------------------------------------------------
// The primitive and its op.

template <typename T>
void launch(const std::vector<mx::array>& in, mx::array& out, float scale, bool fast,
            mx::Stream stream) {
  PagedDecode<T> p{in[0].data<T>(),       in[1].data<T>(),      in[2].data<T>(),
                   in[3].data<int32_t>(), in[4].data<int32_t>(), out.data<T>(),
                   in[0].shape(0),        in[0].shape(1),       in[1].shape(1),
                   in[1].shape(2),        in[1].shape(3),       in[3].shape(1),
                   scale};
  mx::cpu::get_command_encoder(stream).dispatch([p, fast]() {
    if (fast) {
      decode_fast(p);
    } else {
      decode_plain(p);
    }
  });
}

void PagedDecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  switch (out.dtype()) {
    case mx::float32:
      return launch<float>(inputs, out, scale_, fast_, stream());
    case mx::float16:
      return launch<mx::float16_t>(inputs, out, scale_, fast_, stream());
    default:
      return launch<mx::bfloat16_t>(inputs, out, scale_, fast_, stream());
  }
}

void PagedDecodeAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("PagedDecodeAttention has a CPU kernel only: run it on mx.cpu");
}

bool PagedDecodeAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const PagedDecodeAttention&>(other);
  return scale_ == o.scale_ && fast_ == o.fast_;
}

namespace {

std::string shape_str(const mx::array& a) {
  std::string s = "[";
  for (int i = 0; i < a.ndim(); ++i) {
    s += (i ? ", " : "") + std::to_string(a.shape(i));
  }
  return s + "]";
}

// Every check before the node is made: a bad call fails here, with the shapes it got.
void check_inputs(const mx::array& q, const mx::array& key_pages, const mx::array& value_pages,
                  const mx::array& page_table, const mx::array& lengths, float scale) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("paged_decode_attention: " + what);
  };
  if (q.dtype() != mx::float32 && q.dtype() != mx::float16 && q.dtype() != mx::bfloat16) {
    fail("q must be float32, float16 or bfloat16");
  }
  if (key_pages.ndim() != 4 || key_pages.shape() != value_pages.shape()) {
    fail("key_pages " + shape_str(key_pages) + " and value_pages " + shape_str(value_pages) +
         " must both be [num_pages, H_kv, P, D]");
  }
  if (key_pages.dtype() != q.dtype() || value_pages.dtype() != q.dtype()) {
    fail("key_pages and value_pages must have q's dtype");
  }
  const int h_kv = key_pages.shape(1), d = key_pages.shape(3);
  if (q.ndim() != 3 || q.shape(2) != d || q.shape(1) % h_kv != 0) {
    fail("q " + shape_str(q) + " must be [B, H_q, " + std::to_string(d) +
         "] with H_q a multiple of H_kv = " + std::to_string(h_kv));
  }
  if (d % 8 != 0) {
    fail("the head dim must be a multiple of 8, got " + std::to_string(d));
  }
  const int b = q.shape(0);
  if (page_table.dtype() != mx::int32 || page_table.ndim() != 2 || page_table.shape(0) != b ||
      page_table.shape(1) < 1) {
    fail("page_table must be int32 [" + std::to_string(b) + ", W >= 1], got " +
         shape_str(page_table));
  }
  if (lengths.dtype() != mx::int32 || lengths.shape() != mx::Shape{b}) {
    fail("lengths must be int32 [" + std::to_string(b) + "], got " + shape_str(lengths));
  }
  if (!std::isfinite(scale)) {
    fail("scale must be finite");
  }
  // The values, where they are known already (arrays made from Python lists are): a length
  // past the table, or a page past the pool, would read memory the pool does not own.
  if (page_table.is_available() && lengths.is_available()) {
    const int w = page_table.shape(1), p = key_pages.shape(2), pages = key_pages.shape(0);
    auto table = mx::contiguous(page_table), length = mx::contiguous(lengths);
    mx::eval({table, length});
    for (int row = 0; row < b; ++row) {
      const int n = length.data<int32_t>()[row];
      if (n < 1 || n > w * p) {
        fail("row " + std::to_string(row) + " has length " + std::to_string(n) +
             ": it must be 1 .. W * P = " + std::to_string(w * p));
      }
      for (int i = 0; i < (n + p - 1) / p; ++i) {
        const int page = table.data<int32_t>()[row * w + i];
        if (page < 0 || page >= pages) {
          fail("row " + std::to_string(row) + " reads page " + std::to_string(page) +
               " of a pool of " + std::to_string(pages));
        }
      }
    }
  }
}

// A kernel that throws (a task not written yet) must fail where Python sees it, not on MLX's
// thread (see try_kernel of Day 1). So each kernel first runs here, once, on a small problem.
void try_kernel(bool fast) {
  static bool tried[2] = {false, false};
  if (tried[fast]) {
    return;
  }
  // one row, two query heads over one KV head, three positions in two pages of two slots
  std::vector<float> q(2 * 8, 1.0f), keys(2 * 2 * 8, 0.5f), values(2 * 2 * 8, 1.0f), out(2 * 8);
  std::vector<int32_t> table = {1, 0}, lengths = {3};
  PagedDecode<float> p{q.data(),    keys.data(), values.data(), table.data(), lengths.data(),
                       out.data(),  1,           2,             1,            2,
                       8,           2,           1.0f};
  fast ? decode_fast(p) : decode_plain(p);
  tried[fast] = true;
}

}  // namespace

mx::array paged_decode_attention(const mx::array& q, const mx::array& key_pages,
                                 const mx::array& value_pages, const mx::array& page_table,
                                 const mx::array& lengths, float scale, bool fast) {
  check_inputs(q, key_pages, value_pages, page_table, lengths, scale);
  try_kernel(fast);
  mx::Stream stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      q.shape(), q.dtype(), std::make_shared<PagedDecodeAttention>(stream, scale, fast),
      {mx::contiguous(q, false, stream), mx::contiguous(key_pages, false, stream),
       mx::contiguous(value_pages, false, stream), mx::contiguous(page_table, false, stream),
       mx::contiguous(lengths, false, stream)});
}

}  // namespace kernels
