// Kiln's CPU kernels for the per-token work of a decode step around the matmuls: RMSNorm, and decode attention
// read straight from the paged KV pool. Each replaces a chain of small ATen ops (RMSNorm's pow / mean / rsqrt /
// mul; attention's two index_select gathers and SDPA) whose per-call overhead is most of a batch-1 step's
// time outside the matmuls (docs/benchmarks.md). float32 only; the Python side falls back to ATen otherwise.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

// fn(i0, i1) over [0, n) in ranges of `grain`, handed out to the intra-op threads as they come free rather than
// split evenly up front: on a host whose cores other processes also use (a server and its clients on two cores), a
// thread that is preempted does not hold every other thread at the end of the region while its fixed share
// waits. Serial inside another parallel region or with one thread; split evenly when there is a range a thread.
void dynamic_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  const int threads = at::get_num_threads();
  if (n <= grain || threads == 1 || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  if (n <= grain * threads) {  // a range or less a thread: nothing to hand out
    at::parallel_for(0, n, grain, fn);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i0; !failed && (i0 = next.fetch_add(grain)) < n;) {
      try {
        fn(i0, std::min(n, i0 + grain));
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
      }
    }
  });
  if (error) std::rethrow_exception(error);
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_i a[i] * b[i], n a multiple of 8 or not
static inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[i] += p * x[i]
static inline void axpy(float p, const float* x, float* y, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += p * x[i];
}

// the cache lines of n floats from p, fetched ahead of their use
static inline void prefetch_row(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// o[0..d) += sum over l of p[l] * V row of slot row[l] (in the layer's [S, Hk, D] pool, head h), l in order,
// entries with p[l] == 0 skipped: the same FMAs as one axpy per slot, with o kept in registers across slots
static inline void weighted_rows(const float* p, const int64_t* row, int64_t len, const float* vp, int64_t hk,
                                 int64_t h, int64_t d, float* o) {
  if (d % 8 != 0) {
    for (int64_t l = 0; l < len; ++l)
      if (p[l] != 0.f) axpy(p[l], vp + (row[l] * hk + h) * d, o, d);
    return;
  }
  for (int64_t i0 = 0; i0 < d; i0 += 64) {
    const int64_t k = std::min<int64_t>(8, (d - i0) / 8);
    __m256 acc[8];
    for (int64_t j = 0; j < k; ++j) acc[j] = _mm256_loadu_ps(o + i0 + 8 * j);
    for (int64_t l = 0; l < len; ++l) {
      if (l + 4 < len && p[l + 4] != 0.f)  // a V row four slots ahead: scattered slots miss the caches
        prefetch_row(vp + (row[l + 4] * hk + h) * d + i0, std::min<int64_t>(64, d - i0));
      if (p[l] == 0.f) continue;
      const __m256 pv = _mm256_set1_ps(p[l]);
      const float* vr = vp + (row[l] * hk + h) * d + i0;
      if (k == 8) {
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * j), acc[j]);
      } else {
        for (int64_t j = 0; j < k; ++j) acc[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * j), acc[j]);
      }
    }
    for (int64_t j = 0; j < k; ++j) _mm256_storeu_ps(o + i0 + 8 * j, acc[j]);
  }
}

// weighted_rows for G query heads of one KV head at once: o + g * d += sum over l of p[g * stride + l] * V row of
// slot row[l], l in order. Slots before `valid` are all valid (a shared prefix): every one is added, a p == 0
// adding an exact 0. From `valid` on a slot is skipped when every head's p is 0 (masked), and a scattered slot's V
// row is prefetched ahead. Each V vector is loaded once for the G heads; d a multiple of 32, in passes of 32 columns.
template <int G>
static inline void weighted_rows_heads(const float* p, int64_t stride, const int64_t* row, int64_t len,
                                       int64_t valid, const float* vp, int64_t hk, int64_t h, int64_t d, float* o) {
  for (int64_t i0 = 0; i0 < d; i0 += 32) {
    __m256 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_loadu_ps(o + g * d + i0 + 8 * j);
    auto add = [&](int64_t l) {
      const float* vr = vp + (row[l] * hk + h) * d + i0;
      __m256 pv[G];
      for (int g = 0; g < G; ++g) pv[g] = _mm256_broadcast_ss(p + g * stride + l);
      for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_loadu_ps(vr + 8 * j);
        for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(pv[g], v, acc[g][j]);
      }
    };
    for (int64_t l = 0; l < valid; ++l) add(l);
    for (int64_t l = valid; l < len; ++l) {
      if (l + 4 < len && row[l + 4] != row[l + 3] + 1)  // a scattered slot ahead misses the caches; runs stream
        prefetch_row(vp + (row[l + 4] * hk + h) * d + i0, 32);
      uint32_t bits = 0;  // p >= 0: every head's p is 0 when the OR of their bits is
      for (int g = 0; g < G; ++g) {
        uint32_t b;
        std::memcpy(&b, p + g * stride + l, sizeof b);
        bits |= b;
      }
      if (bits != 0) add(l);
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + g * d + i0 + 8 * j, acc[g][j]);
  }
}

// the largest of s[0..n)
static inline float max_of(const float* s, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  r = _mm_max_ss(r, _mm_movehdup_ps(r));
  float top = _mm_cvtss_f32(r);
  for (; i < n; ++i) top = std::max(top, s[i]);
  return top;
}

// y = x * rsqrt(mean(x^2) + eps) * w over the last dimension
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: float32");
  const int64_t h = x.size(-1);
  TORCH_CHECK(w.numel() == h, "rms_norm: weight of the last dimension's size");
  x = x.contiguous();
  w = w.contiguous();
  auto y = torch::empty_like(x);
  const int64_t rows = x.numel() / h;
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * h;
      float* yr = yp + r * h;
      const float scale = 1.0f / std::sqrt(dot(xr, xr, h) / static_cast<float>(h) + static_cast<float>(eps));
      for (int64_t i = 0; i < h; ++i) yr[i] = xr[i] * scale * wp[i];
    }
  });
  return y;
}

// e^x for 8 floats (Cephes' polynomial, ~1 ulp); inputs below -88 give ~0, as masked scores need
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// s[0..n) = e^(s - top), masked entries (-inf) 0; returns the sum
static inline float exp_and_sum(float* s, int64_t n, float top) {
  const __m256 t = _mm256_set1_ps(top), ninf = _mm256_set1_ps(-INFINITY);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(s + i);
    const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(v, t)));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum(acc);
  for (; i < n; ++i) {
    s[i] = s[i] == -INFINITY ? 0.f : std::exp(s[i] - top);
    total += s[i];
  }
  return total;
}

// the dot products q_g . rows[j] of G query heads (q + g * d) and 4 K rows, d a multiple of 8, as 4 floats per head
// in out[g]: each K vector is loaded once for the G heads (4 x G accumulators, G <= 3 with the loads in registers).
// Each product: 8 lanes accumulated over d in order, then lanes summed by one fixed tree (hadd, hadd, halves).
template <int G>
static inline void dot4(const float* q, int64_t d, const float* const* rows, __m128* out) {
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 qv[G];
    for (int g = 0; g < G; ++g) qv[g] = _mm256_loadu_ps(q + g * d + i);
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = _mm256_loadu_ps(rows[j] + i);
      for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(qv[g], kv, acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
    out[g] = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  }
}

// scores of G heads against a full tile of 8 rows: s[g * stride + j] = (q_g . rows[j]) * sc
template <int G>
static inline void score_full_tile(const float* q, int64_t d, const float* const* rows, float sc, float* s,
                                   int64_t stride) {
  const __m128 scv = _mm_set1_ps(sc);
  for (int half = 0; half < 2; ++half) {
    __m128 r[G];
    dot4<G>(q, d, rows + 4 * half, r);
    for (int g = 0; g < G; ++g) _mm_storeu_ps(s + g * stride + 4 * half, _mm_mul_ps(r[g], scv));
  }
}

// One tile of up to eight slots of a table row: their K rows (masked or out-of-pool entries point at row 0 and are
// skipped); the query heads' scaled dot products go to s[g * stride + j], skipped slots -inf. Full tiles take the
// query heads three at a time (score_full_tile), a K row loaded once for the three.
static inline void score_tile(const float* qv, int64_t group, int64_t d, const float* const* rows,
                              const bool* skip, int64_t n, float sc, float* s, int64_t stride) {
  if (n == 8 && d % 8 == 0) {
    int64_t g = 0;
    for (; g + 3 <= group; g += 3) score_full_tile<3>(qv + g * d, d, rows, sc, s + g * stride, stride);
    for (; g < group; ++g) score_full_tile<1>(qv + g * d, d, rows, sc, s + g * stride, stride);
  } else {
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < n; ++j) s[g * stride + j] = dot(qv + g * d, rows[j], d) * sc;
  }
  for (int64_t j = 0; j < n; ++j)
    if (skip[j])
      for (int64_t g = 0; g < group; ++g) s[g * stride + j] = -INFINITY;
}

// One new token per request against its KV slots in the pool: out[b, head] = softmax(q . K[slots] * scale) V[slots]
// q [B, Hq, D]; k_cache, v_cache [S, Hk, D] (one layer of the pool); table [B, L] slots; mask [B, L] (or an empty
// tensor: every slot valid). Heads are grouped (Hq / Hk query heads share a KV head), as in the model: each K and V
// row is read once for its group. `shared`: the table's first `shared` columns (a multiple of 8) are the same valid
// slots in every row, a common prefix: each of those K and V rows is then read once for a chunk of requests, from
// L1, instead of once per request. The arithmetic per request is the same either way (same tiles, same order).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                               torch::Tensor mask, double scale, int64_t shared) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "decode_attention: float32 q and KV");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && table.dim() == 2 && table.size(0) == q.size(0),
              "decode_attention: q [B, Hq, D], cache [S, Hk, D], table [B, L]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: contiguous KV pool");
  TORCH_CHECK(shared >= 0 && shared % 8 == 0 && shared <= table.size(1), "decode_attention: shared % 8 == 0");
  q = q.contiguous();
  table = table.to(at::kLong).contiguous();
  const bool masked = mask.numel() > 0;
  if (masked) mask = mask.reshape({table.size(0), table.size(1)}).to(at::kBool).contiguous();
  const int64_t b_size = q.size(0), hq = q.size(1), d = q.size(2), hk = k_cache.size(1), len = table.size(1);
  TORCH_CHECK(hq % hk == 0 && k_cache.size(2) == d, "decode_attention: head shapes");
  const int64_t group = hq / hk, slots = k_cache.size(0);
  const int64_t chunk = shared > 0 ? 8 : 1;  // requests per work item
  const int64_t chunks = (b_size + chunk - 1) / chunk;
  auto out = torch::zeros_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const bool* mp = masked ? mask.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  std::atomic<bool> bad_slot{false};
  // a tile of row b from column l0: its K rows and which to skip; returns how many slots it holds
  auto tile = [&](int64_t b, int64_t h, int64_t l0, const float** rows, bool* skip) {
    const int64_t* row = tp + b * len;
    const bool* valid = masked ? mp + b * len : nullptr;
    const int64_t n = std::min<int64_t>(8, len - l0);
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t l = l0 + std::min(j, n - 1);
      const bool invalid = valid && !valid[l];
      const bool outside = !invalid && (row[l] < 0 || row[l] >= slots);
      if (outside) bad_slot = true;
      skip[j] = invalid || outside;
      rows[j] = kp + ((skip[j] ? 0 : row[l]) * hk + h) * d;
    }
    for (int64_t l = l0 + 8; l < std::min<int64_t>(l0 + 16, len); ++l)  // the next tile's K rows, ahead
      if (row[l] >= 0 && row[l] < slots) prefetch_row(kp + (row[l] * hk + h) * d, d);
    return n;
  };
  dynamic_for(chunks * hk, 1, [&](int64_t w0, int64_t w1) {
    thread_local std::vector<float> scores;  // every entry is written before it is read
    if (scores.size() < static_cast<size_t>(chunk * group * len)) scores.resize(chunk * group * len);
    const float* rows[8];
    bool skip[8];
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t h = w % hk, b0 = (w / hk) * chunk, b1 = std::min(b_size, b0 + chunk);
      const int64_t per_req = group * len;
      for (int64_t l0 = 0; l0 < shared; l0 += 8) {  // the common prefix: a tile's rows serve every request
        const int64_t n = tile(b0, h, l0, rows, skip);
        for (int64_t b = b0; b < b1; ++b)
          score_tile(qp + (b * hq + h * group) * d, group, d, rows, skip, n, sc,
                     scores.data() + (b - b0) * per_req + l0, len);
      }
      for (int64_t b = b0; b < b1; ++b)  // each request's own slots, eight at a time
        for (int64_t l0 = shared; l0 < len; l0 += 8) {
          const int64_t n = tile(b, h, l0, rows, skip);
          score_tile(qp + (b * hq + h * group) * d, group, d, rows, skip, n, sc,
                     scores.data() + (b - b0) * per_req + l0, len);
        }
      for (int64_t i = 0; i < (b1 - b0) * group; ++i) {
        float* s = scores.data() + i * len;
        const float top = max_of(s, len);
        if (top == -INFINITY) {  // no valid slot (a padding row): zeros
          std::fill(s, s + len, 0.f);
          continue;
        }
        const float inv = 1.f / exp_and_sum(s, len, top);
        for (int64_t l = 0; l < len; ++l) s[l] *= inv;
      }
      for (int64_t b = b0; b < b1; ++b)  // the chunk's requests one after another: prefix V rows stay in cache
        for (int64_t g = 0; g < group;) {
          const float* p = scores.data() + (b - b0) * per_req + g * len;
          float* o = op + (b * hq + h * group + g) * d;
          if (d % 32 == 0 && g + 3 <= group) {
            weighted_rows_heads<3>(p, len, tp + b * len, len, shared, vp, hk, h, d, o);
            g += 3;
          } else {
            weighted_rows(p, tp + b * len, len, vp, hk, h, d, o);
            g += 1;
          }
        }
    }
  });
  TORCH_CHECK(!bad_slot, "decode_attention: a valid entry of the table is outside the KV pool");
  return out;
}
