// Kiln's CPU kernels for the per-token work of a decode step around the matmuls: RMSNorm, and decode attention
// read straight from the paged KV pool. Each replaces a chain of small ATen ops (RMSNorm's pow / mean / rsqrt /
// mul; attention's two index_select gathers and SDPA) whose per-call overhead is most of a batch-1 step's
// time outside the matmuls (docs/benchmarks.md). float32 queries and arithmetic; the KV pool is float32, bfloat16,
// float16 or fp8 (e4m3fn / e5m2), each element converted to float32 in registers as it is read, so a narrower pool
// is read at its own width and never copied out in float32. The Python side falls back to ATen otherwise.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
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

// The element types of a KV pool, by their bits. Each converts to float32 exactly: bfloat16 is float32's upper half
// (a shift); float16 converts with F16C; an fp8 byte widens to the float16 of the same value, up to a power of two,
// and a single byte reads a 256-entry table of the format's values.
struct Bf16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};

// the float32 value of every byte of an fp8 format with `exponent` exponent bits (the rest mantissa, no scale):
// e4m3fn has no infinities and one NaN per sign (all bits set); e5m2 keeps IEEE's infinities and NaNs
static std::array<float, 256> fp8_values(int exponent) {
  const int mantissa = 7 - exponent, bias = (1 << (exponent - 1)) - 1, top = (1 << exponent) - 1;
  std::array<float, 256> values{};
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> mantissa) & top, m = b & ((1 << mantissa) - 1);
    const float sign = (b & 0x80) ? -1.f : 1.f;
    float v;
    if (exponent == 4 && e == top && m == (1 << mantissa) - 1)
      v = NAN;
    else if (exponent == 5 && e == top)
      v = m == 0 ? INFINITY : NAN;
    else if (e == 0)
      v = std::ldexp(static_cast<float>(m), 1 - bias - mantissa);
    else
      v = std::ldexp(static_cast<float>(m + (1 << mantissa)), e - bias - mantissa);
    values[b] = sign * v;
  }
  return values;
}

static const std::array<float, 256> kE4m3Values = fp8_values(4), kE5m2Values = fp8_values(5);

// eight fp8 bytes from p, each the upper byte of a 16-bit lane
static inline __m128i fp8_in_upper_bytes(const void* p) {
  return _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(static_cast<const __m128i*>(p)));
}

// e5m2 is float16's upper byte: the byte in a lane's upper half is the float16 of its value, infinities and NaNs
// included
struct E5m2 {
  uint8_t bits;
  static __m256 eight(const E5m2* p) { return _mm256_cvtph_ps(fp8_in_upper_bytes(p)); }
  static float one(const E5m2* p) { return kE5m2Values[p->bits]; }
};

// e4m3fn's bits shifted one place into float16's (the sign kept in place, an arithmetic shift's copy of it cleared)
// read as a float16 2^8 times too small, its subnormals included (they land on float16 subnormals of the same
// digits); the byte of all ones but the sign is NaN
struct E4m3 {
  uint8_t bits;
  static __m256 eight(const E4m3* p) {
    const __m128i half = _mm_and_si128(_mm_srai_epi16(fp8_in_upper_bytes(p), 1), _mm_set1_epi16(-0x4001));
    const __m256 value = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(half, _mm_set1_epi16(0x7FFF)), _mm_set1_epi16(0x3F80));
    return _mm256_blendv_ps(value, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
  }
  static float one(const E4m3* p) { return kE4m3Values[p->bits]; }
};

// eight and one element(s) of a KV row as float32
template <typename T>
struct Kv {  // fp8: the format's own conversions
  static __m256 eight(const T* p) { return T::eight(p); }
  static float one(const T* p) { return T::one(p); }
};
template <>
struct Kv<float> {
  static __m256 eight(const float* p) { return _mm256_loadu_ps(p); }
  static float one(const float* p) { return *p; }
};
template <>
struct Kv<Half> {
  static __m256 eight(const Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static float one(const Half* p) { return _cvtsh_ss(p->bits); }
};
template <>
struct Kv<Bf16> {
  static __m256 eight(const Bf16* p) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
  }
  static float one(const Bf16* p) {
    const uint32_t u = static_cast<uint32_t>(p->bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};

// sum_i a[i] * b[i], n a multiple of 8 or not
template <typename T>
static inline float dot(const float* a, const T* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), Kv<T>::eight(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * Kv<T>::one(b + i);
  return s;
}

// y[i] += p * x[i]
template <typename T>
static inline void axpy(float p, const T* x, float* y, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, Kv<T>::eight(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += p * Kv<T>::one(x + i);
}

// the cache lines of n elements from p, fetched ahead of their use
template <typename T>
static inline void prefetch_row(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(bytes + i, _MM_HINT_T0);
}

// o[0..d) += sum over l of p[l] * V row of slot row[l] (in the layer's [S, Hk, D] pool, head h), l in order,
// entries with p[l] == 0 skipped: the same FMAs as one axpy per slot, with o kept in registers across slots
template <typename T>
static inline void weighted_rows(const float* p, const int64_t* row, int64_t len, const T* vp, int64_t hk,
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
      const T* vr = vp + (row[l] * hk + h) * d + i0;
      if (k == 8) {
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(pv, Kv<T>::eight(vr + 8 * j), acc[j]);
      } else {
        for (int64_t j = 0; j < k; ++j) acc[j] = _mm256_fmadd_ps(pv, Kv<T>::eight(vr + 8 * j), acc[j]);
      }
    }
    for (int64_t j = 0; j < k; ++j) _mm256_storeu_ps(o + i0 + 8 * j, acc[j]);
  }
}

// weighted_rows for G query heads of one KV head at once: o + g * d += sum over l of p[g * stride + l] * V row of
// slot row[l], l in order. Slots before `valid` are all valid (a shared prefix): every one is added, a p == 0
// adding an exact 0. From `valid` on a slot is skipped when every head's p is 0 (masked), and a scattered slot's V
// row is prefetched ahead. Each V vector is loaded (and converted) once for the G heads; d a multiple of 32, in
// passes of 32 columns.
template <int G, typename T>
static inline void weighted_rows_heads(const float* p, int64_t stride, const int64_t* row, int64_t len,
                                       int64_t valid, const T* vp, int64_t hk, int64_t h, int64_t d, float* o) {
  for (int64_t i0 = 0; i0 < d; i0 += 32) {
    __m256 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_loadu_ps(o + g * d + i0 + 8 * j);
    auto add = [&](int64_t l) {
      const T* vr = vp + (row[l] * hk + h) * d + i0;
      __m256 pv[G];
      for (int g = 0; g < G; ++g) pv[g] = _mm256_broadcast_ss(p + g * stride + l);
      for (int j = 0; j < 4; ++j) {
        const __m256 v = Kv<T>::eight(vr + 8 * j);
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

// s[0..n) = softmax(s) in place; a row with no valid entry (all -inf: a padding row) gives zeros
static inline void softmax_in_place(float* s, int64_t n) {
  const float top = max_of(s, n);
  if (top == -INFINITY) {
    std::fill(s, s + n, 0.f);
    return;
  }
  const float inv = 1.f / exp_and_sum(s, n, top);
  for (int64_t l = 0; l < n; ++l) s[l] *= inv;
}

// softmax over s[0..n) and one more logit, `sink`, whose share goes to no entry (GPT-OSS's attention sinks): every
// entry is scaled by exp(s - top) / (sum + exp(sink - top)), so a row with no valid entry gives zeros
static inline void softmax_with_sink_in_place(float* s, int64_t n, float sink) {
  const float top = std::max(max_of(s, n), sink);
  const float inv = 1.f / (exp_and_sum(s, n, top) + std::exp(sink - top));
  for (int64_t l = 0; l < n; ++l) s[l] *= inv;
}

// the dot products q_g . rows[j] of G query heads (q + g * d) and 4 K rows, d a multiple of 8, as 4 floats per head
// in out[g]: each K vector is loaded once for the G heads (4 x G accumulators, G <= 3 with the loads in registers).
// Each product: 8 lanes accumulated over d in order, then lanes summed by one fixed tree (hadd, hadd, halves).
template <int G, typename T>
static inline void dot4(const float* q, int64_t d, const T* const* rows, __m128* out) {
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 qv[G];
    for (int g = 0; g < G; ++g) qv[g] = _mm256_loadu_ps(q + g * d + i);
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = Kv<T>::eight(rows[j] + i);
      for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(qv[g], kv, acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
    out[g] = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  }
}

// scores of G heads against a full tile of 8 rows: s[g * stride + j] = (q_g . rows[j]) * sc
template <int G, typename T>
static inline void score_full_tile(const float* q, int64_t d, const T* const* rows, float sc, float* s,
                                   int64_t stride) {
  const __m128 scv = _mm_set1_ps(sc);
  for (int half = 0; half < 2; ++half) {
    __m128 r[G];
    dot4<G, T>(q, d, rows + 4 * half, r);
    for (int g = 0; g < G; ++g) _mm_storeu_ps(s + g * stride + 4 * half, _mm_mul_ps(r[g], scv));
  }
}

// One tile of eight slots of a table row: their K rows (masked, out-of-pool and past-the-end entries point at a
// valid row and are skipped); the query heads' scaled dot products go to s[g * stride + j], skipped slots -inf. A
// tile at the end of the table is padded to eight rather than computed another way, so a slot's score takes the
// same instructions whatever the table's width (how long the batch's longest request is): a request decodes to
// the same bits alone, in a batch, or as a verify row. Heads go three at a time, a K row loaded once for the three.
template <typename T>
static inline void score_tile(const float* qv, int64_t group, int64_t d, const T* const* rows,
                              const bool* skip, float sc, float* s, int64_t stride) {
  if (d % 8 == 0) {
    int64_t g = 0;
    for (; g + 3 <= group; g += 3) score_full_tile<3, T>(qv + g * d, d, rows, sc, s + g * stride, stride);
    for (; g < group; ++g) score_full_tile<1, T>(qv + g * d, d, rows, sc, s + g * stride, stride);
  } else {
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < 8; ++j) s[g * stride + j] = dot(qv + g * d, rows[j], d) * sc;
  }
  for (int64_t j = 0; j < 8; ++j)
    if (skip[j])
      for (int64_t g = 0; g < group; ++g) s[g * stride + j] = -INFINITY;
}

// One decode_attention call as its work items read it: the layer's K and V rows of element type T, the table of
// slots and its mask (null: every slot valid), and the shapes. A work item is one KV head of a chunk of requests.
template <typename T>
struct DecodeCall {
  const float* q;
  const T* k;
  const T* v;
  const int64_t* table;
  const bool* mask;
  float* out;
  int64_t b_size, hq, hk, d, len, group, slots, shared, chunk;
  int64_t stride;  // len rounded up to whole tiles: a score row's width (the padding columns are -inf)
  float scale;
  std::atomic<bool>* bad_slot;
  const float* sinks;  // [Hq] a logit per query head in every row's softmax, or null

  // a tile of row b from column l0: its eight K rows and which to skip (columns past the table's end included)
  void tile(int64_t b, int64_t h, int64_t l0, const T** rows, bool* skip) const {
    const int64_t* row = table + b * len;
    const bool* valid = mask ? mask + b * len : nullptr;
    const int64_t n = std::min<int64_t>(8, len - l0);
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t l = l0 + std::min(j, n - 1);
      const bool invalid = j >= n || (valid && !valid[l]);
      const bool outside = !invalid && (row[l] < 0 || row[l] >= slots);
      if (outside) *bad_slot = true;
      skip[j] = invalid || outside;
      rows[j] = k + ((skip[j] ? 0 : row[l]) * hk + h) * d;
    }
    for (int64_t l = l0 + 8; l < std::min<int64_t>(l0 + 16, len); ++l)  // the next tile's K rows, ahead
      if (row[l] >= 0 && row[l] < slots) prefetch_row(k + (row[l] * hk + h) * d, d);
  }

  // the scaled scores of head h's query group for requests [b0, b1) into scores (group x stride per request)
  void score(int64_t h, int64_t b0, int64_t b1, float* scores) const {
    const T* rows[8];
    bool skip[8];
    const int64_t per_req = group * stride;
    for (int64_t l0 = 0; l0 < shared; l0 += 8) {  // the common prefix: a tile's rows serve every request
      tile(b0, h, l0, rows, skip);
      for (int64_t b = b0; b < b1; ++b)
        score_tile(q + (b * hq + h * group) * d, group, d, rows, skip, scale, scores + (b - b0) * per_req + l0,
                   stride);
    }
    for (int64_t b = b0; b < b1; ++b)  // each request's own slots, eight at a time
      for (int64_t l0 = shared; l0 < len; l0 += 8) {
        tile(b, h, l0, rows, skip);
        score_tile(q + (b * hq + h * group) * d, group, d, rows, skip, scale, scores + (b - b0) * per_req + l0,
                   stride);
      }
  }

  // out rows of head h's query group for requests [b0, b1): the softmaxed scores' weighted sums of V rows
  void weigh(int64_t h, int64_t b0, int64_t b1, const float* scores) const {
    for (int64_t b = b0; b < b1; ++b)  // the chunk's requests one after another: prefix V rows stay in cache
      for (int64_t g = 0; g < group;) {
        const float* p = scores + (b - b0) * group * stride + g * stride;
        float* o = out + (b * hq + h * group + g) * d;
        if (d % 32 == 0 && g + 3 <= group) {
          weighted_rows_heads<3>(p, stride, table + b * len, len, shared, v, hk, h, d, o);
          g += 3;
        } else {
          weighted_rows(p, table + b * len, len, v, hk, h, d, o);
          g += 1;
        }
      }
  }

  void run(int64_t w, std::vector<float>& scores) const {
    const int64_t h = w % hk, b0 = (w / hk) * chunk, b1 = std::min(b_size, b0 + chunk);
    score(h, b0, b1, scores.data());
    // over whole tiles (the padding is -inf): no scalar tail whose sum order would depend on the table's width
    for (int64_t i = 0; i < (b1 - b0) * group; ++i) {
      float* row = scores.data() + i * stride;
      if (sinks)
        softmax_with_sink_in_place(row, stride, sinks[h * group + i % group]);
      else
        softmax_in_place(row, stride);
    }
    weigh(h, b0, b1, scores.data());
  }
};

template <typename T>
static void decode_attention_over(const DecodeCall<T>& call) {
  const int64_t chunks = (call.b_size + call.chunk - 1) / call.chunk;
  dynamic_for(chunks * call.hk, 1, [&](int64_t w0, int64_t w1) {
    thread_local std::vector<float> scores;  // every entry is written before it is read
    if (scores.size() < static_cast<size_t>(call.chunk * call.group * call.stride))
      scores.resize(call.chunk * call.group * call.stride);
    for (int64_t w = w0; w < w1; ++w) call.run(w, scores);
  });
}

template <typename T>
static void decode_attention_as(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                const torch::Tensor& table, const torch::Tensor& mask, float scale, int64_t shared,
                                const torch::Tensor& sinks, torch::Tensor& out) {
  std::atomic<bool> bad_slot{false};
  const int64_t hq = q.size(1), hk = k_cache.size(1);
  const DecodeCall<T> call{q.data_ptr<float>(),
                           static_cast<const T*>(k_cache.data_ptr()),
                           static_cast<const T*>(v_cache.data_ptr()),
                           table.data_ptr<int64_t>(),
                           mask.numel() > 0 ? mask.data_ptr<bool>() : nullptr,
                           out.data_ptr<float>(),
                           q.size(0),
                           hq,
                           hk,
                           q.size(2),
                           table.size(1),
                           hq / hk,
                           k_cache.size(0),
                           shared,
                           shared > 0 ? 8 : 1,  // requests per work item
                           (table.size(1) + 7) / 8 * 8,
                           scale,
                           &bad_slot,
                           sinks.defined() ? sinks.data_ptr<float>() : nullptr};
  decode_attention_over(call);
  TORCH_CHECK(!bad_slot, "decode_attention: a valid entry of the table is outside the KV pool");
}

// One new token per request against its KV slots in the pool: out[b, head] = softmax(q . K[slots] * scale) V[slots]
// q [B, Hq, D] float32; k_cache, v_cache [S, Hk, D] (one layer of the pool) float32, bfloat16, float16,
// float8_e4m3fn or float8_e5m2, both the same; table [B, L] slots; mask [B, L] (or an empty tensor: every slot
// valid). Heads are grouped (Hq / Hk query heads share a KV head), as in the model: each K and V row is read once
// for its group. `shared`: the table's first `shared` columns (a multiple of 8) are the same valid slots in every
// row, a common prefix: each of those K and V rows is then read once for a chunk of requests, from L1, instead of
// once per request. The arithmetic per request is the same either way (same tiles, same order). `sinks` [Hq] (or an
// undefined or empty tensor: none): a logit per query head in every row's softmax whose share goes to no slot.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                               torch::Tensor mask, double scale, int64_t shared, torch::Tensor sinks) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: float32 q");
  TORCH_CHECK(v_cache.scalar_type() == kv && (kv == at::kFloat || kv == at::kBFloat16 || kv == at::kHalf ||
                                              kv == at::kFloat8_e4m3fn || kv == at::kFloat8_e5m2),
              "decode_attention: a KV pool of float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, K and V "
              "alike");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && table.dim() == 2 && table.size(0) == q.size(0),
              "decode_attention: q [B, Hq, D], cache [S, Hk, D], table [B, L]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: contiguous KV pool");
  TORCH_CHECK(shared >= 0 && shared % 8 == 0 && shared <= table.size(1), "decode_attention: shared % 8 == 0");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && k_cache.size(2) == q.size(2), "decode_attention: head shapes");
  const bool with_sinks = sinks.defined() && sinks.numel() > 0;
  TORCH_CHECK(!with_sinks || (sinks.dim() == 1 && sinks.size(0) == q.size(1)), "decode_attention: sinks [Hq]");
  sinks = with_sinks ? sinks.to(at::kFloat).contiguous() : torch::Tensor();
  q = q.contiguous();
  table = table.to(at::kLong).contiguous();
  if (mask.numel() > 0) mask = mask.reshape({table.size(0), table.size(1)}).to(at::kBool).contiguous();
  auto out = torch::zeros_like(q);
  const float sc = static_cast<float>(scale);
  if (kv == at::kFloat)
    decode_attention_as<float>(q, k_cache, v_cache, table, mask, sc, shared, sinks, out);
  else if (kv == at::kBFloat16)
    decode_attention_as<Bf16>(q, k_cache, v_cache, table, mask, sc, shared, sinks, out);
  else if (kv == at::kHalf)
    decode_attention_as<Half>(q, k_cache, v_cache, table, mask, sc, shared, sinks, out);
  else if (kv == at::kFloat8_e4m3fn)
    decode_attention_as<E4m3>(q, k_cache, v_cache, table, mask, sc, shared, sinks, out);
  else
    decode_attention_as<E5m2>(q, k_cache, v_cache, table, mask, sc, shared, sinks, out);
  return out;
}
