// Kiln's integer CPU matmuls for quantized weights (kiln/layers/int_gemm.py documents the formats and the packed
// layout): y = x W^T with x's rows rounded to int8 in blocks, integer dot products per block, float32 scales.
//
// One source, one code path per instruction set, chosen at call time. The kernels are written once, over an `Ops`
// struct of 16-lane operations (16 output rows' int32 sums, float32 accumulators, 64-byte weight vectors), and this
// file includes itself once per instruction set inside that set's `#pragma GCC target` region and namespace: the
// build needs no -m flags, so the same library runs on any x86-64 CPU and a path whose instructions the CPU lacks
// is never entered (cpu_isas() asks cpuid).
//
// The paths give the same bits: integer sums are exact whatever the instructions, and every float32 operation is
// one per output lane, in the same order on every path (the build passes -ffp-contract=off so no multiply and add
// are fused on one path and not on another). The activations are quantized once per call by common code.
#ifndef KILN_INT_GEMM_KERNELS

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kRows = 16;  // output rows per packed block: one 16-lane vector of sums
constexpr int64_t kPanel = 256;  // activation rows a thread runs over a block before the next block
enum Format { kQ4_0, kQ4_1, kQ8_0, kQ4_K, kQ6_K, kI8 };
constexpr int64_t kActivationBlock[] = {32, 32, 32, 256, 256, 32};
// packed bytes per 16 rows per block of K (I8 adds its 16 float32 row scales once, ahead of the blocks)
constexpr int64_t kChunkBytes[] = {288, 320, 544, 2368, 3360, 512};
const char* const kIsaNames[] = {"scalar", "avx2", "avxvnni", "avx512vnni"};

struct Args {
  const int8_t* qa;  // activations rounded to int8 [M, K]
  const float* da;  // their scales [M, K / activation block]
  const int32_t* sums;  // their sums over runs of 16 [M, K / 16]
  const uint8_t* w;  // packed weight, block_bytes per 16 rows
  int64_t block_bytes;
  float* y;  // [M, y_stride]
  int64_t y_stride, m, k;
};

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// the sum of an activation row's values over run `run` of `width` (32 or 16) values
inline int32_t run_sum(const Args& a, int64_t row, int64_t run, int width) {
  const int32_t* s = a.sums + row * (a.k / 16);
  return width == 16 ? s[run] : s[2 * run] + s[2 * run + 1];
}

}  // namespace

// ---- scalar: plain C++, the reference every vector path equals ----
namespace isa_scalar {
struct Ops {
  static constexpr int kTile = 1;  // activation rows per tile: one, the reference needs no speed, only a short build
  static constexpr int kBlocks = 1;  // blocks of 16 rows per tile
  static constexpr int kSignedOffset = 0;  // signed weights multiply as they are
  struct I { int32_t v[16]; };
  struct F { float v[16]; };
  struct W { uint8_t v[64]; };
  static I izero() { return I{}; }
  static F fzero() { return F{}; }
  static I set1(int32_t s) { I r; for (int c = 0; c < 16; ++c) r.v[c] = s; return r; }
  static F set1(float s) { F r; for (int c = 0; c < 16; ++c) r.v[c] = s; return r; }
  static W load(const uint8_t* p) { W r; std::memcpy(r.v, p, 64); return r; }
  static W low(W w) { for (auto& b : w.v) b &= 0xF; return w; }
  static W high(W w) { for (auto& b : w.v) b >>= 4; return w; }
  // bits 2t..2t+1 of each byte, moved to bits 4..5
  static W crumb(W h, int t) { for (auto& b : h.v) b = ((b >> (2 * t)) & 3) << 4; return h; }
  static W join(W a, W b) { for (int i = 0; i < 64; ++i) a.v[i] |= b.v[i]; return a; }
  static W flip(W w) { return w; }
  // pair sums (see the AVX2 path): here plain int32 sums
  using P = I;
  static P pzero() { return I{}; }
  static P dot_pairs(P acc, W w, int32_t a4) { return dot(acc, w, a4); }
  static I widen(I acc, P p) { return add(acc, p); }
  // lane c += sum_j w[c][j] (unsigned) * a[j] (signed)
  static I dot(I acc, W w, int32_t a4) {
    int8_t a[4];
    std::memcpy(a, &a4, 4);
    for (int c = 0; c < 16; ++c)
      for (int j = 0; j < 4; ++j) acc.v[c] += int32_t(w.v[4 * c + j]) * a[j];
    return acc;
  }
  static I dot_signed(I acc, W w, int32_t a4) {
    int8_t a[4];
    std::memcpy(a, &a4, 4);
    for (int c = 0; c < 16; ++c)
      for (int j = 0; j < 4; ++j) acc.v[c] += int32_t(int8_t(w.v[4 * c + j])) * a[j];
    return acc;
  }
  static I add(I a, I b) { for (int c = 0; c < 16; ++c) a.v[c] += b.v[c]; return a; }
  static I sub(I a, I b) { for (int c = 0; c < 16; ++c) a.v[c] -= b.v[c]; return a; }
  static I mullo(I a, I b) { for (int c = 0; c < 16; ++c) a.v[c] *= b.v[c]; return a; }
  static I widen_u8(const uint8_t* p) { I r; for (int c = 0; c < 16; ++c) r.v[c] = p[c]; return r; }
  static I widen_s8(const uint8_t* p) { I r; for (int c = 0; c < 16; ++c) r.v[c] = int8_t(p[c]); return r; }
  static F cvt(I a) { F r; for (int c = 0; c < 16; ++c) r.v[c] = float(a.v[c]); return r; }
  static F add(F a, F b) { for (int c = 0; c < 16; ++c) a.v[c] += b.v[c]; return a; }
  static F sub(F a, F b) { for (int c = 0; c < 16; ++c) a.v[c] -= b.v[c]; return a; }
  static F mul(F a, F b) { for (int c = 0; c < 16; ++c) a.v[c] *= b.v[c]; return a; }
  static F load_half(const uint8_t* p) {
    F r;
    for (int c = 0; c < 16; ++c) {
      uint16_t h;
      std::memcpy(&h, p + 2 * c, 2);
      r.v[c] = c10::detail::fp16_ieee_to_fp32_value(h);
    }
    return r;
  }
  static F load_float(const uint8_t* p) { F r; std::memcpy(r.v, p, 64); return r; }
  static void store(float* p, F a) { std::memcpy(p, a.v, 64); }
};
#define KILN_INT_GEMM_KERNELS
#include __FILE__
#undef KILN_INT_GEMM_KERNELS
}  // namespace isa_scalar

// ---- AVX2: vpmaddubsw + vpmaddwd, 16 lanes as two 8-lane halves ----
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// the 16-lane values as two 256-bit halves, shared by the AVX2 and AVX-VNNI paths; a namespace of their own, which
// holds no kernels, for the kernels' calls to find by argument-dependent lookup
namespace avx256 {
struct Ops256 {
  struct I { __m256i lo, hi; };
  struct F { __m256 lo, hi; };
  struct W { __m256i lo, hi; };
  static I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static I set1(int32_t s) { return {_mm256_set1_epi32(s), _mm256_set1_epi32(s)}; }
  static F set1(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
  static W load(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
  }
  static W low(W w) {
    const __m256i m = _mm256_set1_epi8(0xF);
    return {_mm256_and_si256(w.lo, m), _mm256_and_si256(w.hi, m)};
  }
  static W high(W w) {
    const __m256i m = _mm256_set1_epi8(0xF);
    return {_mm256_and_si256(_mm256_srli_epi16(w.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(w.hi, 4), m)};
  }
  static __m256i crumb1(__m256i h, int t) {
    const __m256i m = _mm256_set1_epi8(0x30);
    return _mm256_and_si256(t < 2 ? _mm256_slli_epi16(h, 4 - 2 * t) : _mm256_srli_epi16(h, 2 * t - 4), m);
  }
  static W crumb(W h, int t) { return {crumb1(h.lo, t), crumb1(h.hi, t)}; }
  static W join(W a, W b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
  static I add(I a, I b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
  static I sub(I a, I b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
  static I mullo(I a, I b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
  static I widen_u8(const uint8_t* p) {
    return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static I widen_s8(const uint8_t* p) {
    return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static F cvt(I a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
  static F add(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static F sub(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  static F mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static F load_half(const uint8_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
  }
  static F load_float(const uint8_t* p) {
    const float* f = reinterpret_cast<const float*>(p);
    return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
  }
  static void store(float* p, F a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
  }
};
}  // namespace avx256

namespace isa_avx2 {
struct Ops : avx256::Ops256 {
  static constexpr int kTile = 2;  // two 8-lane halves per value: more rows would spill the 16 ymm registers
  static constexpr int kBlocks = 1;
  static constexpr int kSignedOffset = 0;  // vpsignb moves the weight's sign onto the activation
  // u8 x s8 pairs into int16 (15 x 127 x 2 and 63 x 127 x 2 stay below 2^15), then pairs into int32
  static __m256i dot1(__m256i acc, __m256i w, __m256i a) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
  }
  static I dot(I acc, W w, int32_t a4) {
    const __m256i a = _mm256_set1_epi32(a4);
    return {dot1(acc.lo, w.lo, a), dot1(acc.hi, w.hi, a)};
  }
  // |w| x a * sign(w): |w| <= 128, so a pair stays below 2 x 128 x 127 < 2^15
  static I dot_signed(I acc, W w, int32_t a4) {
    const __m256i a = _mm256_set1_epi32(a4);
    return {dot1(acc.lo, _mm256_sign_epi8(w.lo, w.lo), _mm256_sign_epi8(a, w.lo)),
            dot1(acc.hi, _mm256_sign_epi8(w.hi, w.hi), _mm256_sign_epi8(a, w.hi))};
  }
  static W flip(W w) { return w; }
  // 4-bit weights: vpmaddubsw's int16 pairs summed over up to 8 groups of 4 K values (8 x 2 x 15 x 127 < 2^15)
  // before one vpmaddwd widens them, instead of a widening per group
  using P = I;
  static P pzero() { return izero(); }
  static P dot_pairs(P acc, W w, int32_t a4) {
    const __m256i a = _mm256_set1_epi32(a4);
    return {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(w.lo, a)),
            _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(w.hi, a))};
  }
  static I widen(I acc, P p) {
    const __m256i ones = _mm256_set1_epi16(1);
    return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(p.lo, ones)),
            _mm256_add_epi32(acc.hi, _mm256_madd_epi16(p.hi, ones))};
  }
};
#define KILN_INT_GEMM_KERNELS
#include __FILE__
#undef KILN_INT_GEMM_KERNELS
}  // namespace isa_avx2
#pragma GCC pop_options

// ---- AVX-VNNI: vpdpbusd on 256-bit vectors ----
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace isa_avxvnni {
struct Ops : avx256::Ops256 {
  static constexpr int kTile = 2;
  static constexpr int kBlocks = 1;
  // signed weights go in offset by 128 (vpdpbusd's first operand is unsigned); the kernel takes 128 x the
  // activations' sum back off
  static constexpr int kSignedOffset = 128;
  static I dot(I acc, W w, int32_t a4) {
    const __m256i a = _mm256_set1_epi32(a4);
    return {_mm256_dpbusd_avx_epi32(acc.lo, w.lo, a), _mm256_dpbusd_avx_epi32(acc.hi, w.hi, a)};
  }
  static I dot_signed(I acc, W w, int32_t a4) { return dot(acc, w, a4); }
  static W flip(W w) {
    const __m256i m = _mm256_set1_epi8(char(0x80));
    return {_mm256_xor_si256(w.lo, m), _mm256_xor_si256(w.hi, m)};
  }
  using P = I;
  static P pzero() { return izero(); }
  static P dot_pairs(P acc, W w, int32_t a4) { return dot(acc, w, a4); }
  static I widen(I acc, P p) { return add(acc, p); }
};
#define KILN_INT_GEMM_KERNELS
#include __FILE__
#undef KILN_INT_GEMM_KERNELS
}  // namespace isa_avxvnni
#pragma GCC pop_options

// ---- AVX-512 VNNI: vpdpbusd on 512-bit vectors, 16 lanes in one register ----
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace isa_avx512vnni {
struct Ops {
  static constexpr int kTile = 4;
  static constexpr int kBlocks = 2;  // 4 rows x 2 blocks: 8 accumulators and 8 sums of the 32 zmm registers
  static constexpr int kSignedOffset = 128;
  using I = __m512i;
  using F = __m512;
  using W = __m512i;
  static I izero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static I set1(int32_t s) { return _mm512_set1_epi32(s); }
  static F set1(float s) { return _mm512_set1_ps(s); }
  static W load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static W low(W w) { return _mm512_and_si512(w, _mm512_set1_epi8(0xF)); }
  static W high(W w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0xF)); }
  static W crumb(W h, int t) {
    return _mm512_and_si512(t < 2 ? _mm512_slli_epi16(h, 4 - 2 * t) : _mm512_srli_epi16(h, 2 * t - 4),
                            _mm512_set1_epi8(0x30));
  }
  static W join(W a, W b) { return _mm512_or_si512(a, b); }
  static W flip(W w) { return _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))); }
  static I dot(I acc, W w, int32_t a4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(a4)); }
  static I dot_signed(I acc, W w, int32_t a4) { return dot(acc, w, a4); }
  using P = I;
  static P pzero() { return izero(); }
  static P dot_pairs(P acc, W w, int32_t a4) { return dot(acc, w, a4); }
  static I widen(I acc, P p) { return _mm512_add_epi32(acc, p); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static I widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(load16(p)); }
  static I widen_s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(load16(p)); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F load_half(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F load_float(const uint8_t* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
};
#define KILN_INT_GEMM_KERNELS
#include __FILE__
#undef KILN_INT_GEMM_KERNELS
}  // namespace isa_avx512vnni
#pragma GCC pop_options

namespace {

using Run = void (*)(const Args&, int, int64_t, int64_t);
constexpr Run kRuns[] = {isa_scalar::run, isa_avx2::run, isa_avxvnni::run, isa_avx512vnni::run};

bool cpu_has(int isa) {
  __builtin_cpu_init();
  switch (isa) {
    case 0: return true;
    case 1: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case 2: return cpu_has(1) && __builtin_cpu_supports("avxvnni");
    case 3:
      return cpu_has(1) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

// One block of `block` values (a multiple of 32) as int8 against its largest magnitude: d = amax / 127, q =
// round-half-even(x * (127 / amax)) (int_gemm.py's quantize_activations, operation for operation). The vector paths
// give the scalar path's bits: the maximum is exact, each product is the one float32 multiply, and converting
// rounds half to even under the default rounding mode as std::nearbyint does. They exist because the scalar loop
// calls the library's nearbyint per value, which cost more than a small matmul itself at one or a few rows.
void quantize_block_scalar(const float* x, int64_t block, int8_t* q, float* d) {
  float amax = 0.0f;
  for (int64_t j = 0; j < block; ++j) amax = std::max(amax, std::fabs(x[j]));
  *d = amax / 127.0f;
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t j = 0; j < block; ++j) q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inverse));
}

__attribute__((target("avx2"))) void quantize_block_avx2(const float* x, int64_t block, int8_t* q, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t j = 0; j < block; j += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
  *d = amax / 127.0f;
  const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  // packs interleave the 128-bit lanes; the permute puts the 32 bytes back in order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t j = 0; j < block; j += 32) {
    __m256i r[4];
    for (int t = 0; t < 4; ++t) r[t] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * t), inverse));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), _mm256_permutevar8x32_epi32(bytes, order));
  }
}

__attribute__((target("avx512f,avx512bw"))) void quantize_block_avx512(const float* x, int64_t block, int8_t* q,
                                                                       float* d) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t j = 0; j < block; j += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
  const float amax = _mm512_reduce_max_ps(vmax);
  *d = amax / 127.0f;
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  for (int64_t j = 0; j < block; j += 16) {
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtsepi32_epi8(r));
  }
}

using QuantizeBlock = void (*)(const float*, int64_t, int8_t*, float*);
// per instruction set (kIsaNames' order): AVX-VNNI runs the AVX2 quantization
constexpr QuantizeBlock kQuantizeBlocks[] = {quantize_block_scalar, quantize_block_avx2, quantize_block_avx2,
                                             quantize_block_avx512};

// each row's blocks of `block` values as int8 (quantize_block_*), and the rows' sums over runs of 16
void quantize_activations(const float* x, int64_t m, int64_t k, int64_t block, int isa, int8_t* q, float* d,
                          int32_t* sums) {
  const QuantizeBlock quantize_block = kQuantizeBlocks[isa];
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < k / block; ++b)
        quantize_block(x + r * k + b * block, block, q + r * k + b * block, d + r * (k / block) + b);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t s = 0; s < k / 16; ++s) {
        int32_t total = 0;
        for (int j = 0; j < 16; ++j) total += q[r * k + s * 16 + j];
        sums[r * (k / 16) + s] = total;
      }
  });
}

}  // namespace

std::vector<std::string> cpu_isas() {
  std::vector<std::string> names;
  for (int isa = 0; isa < 4; ++isa)
    if (cpu_has(isa)) names.push_back(kIsaNames[isa]);
  return names;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t format, int64_t n, int64_t isa) {
  TORCH_CHECK(format >= 0 && format <= kI8, "int linear: unknown format ", format);
  TORCH_CHECK(isa >= 0 && isa < 4, "int linear: unknown instruction set ", isa);
  TORCH_CHECK(cpu_has(isa), "int linear: this CPU lacks the instructions of the ", kIsaNames[isa], " path");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, "int linear: a float32 input [..., K]");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte, "int linear: a packed uint8 weight");
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  x = x.reshape({-1, x.size(-1)}).contiguous();
  packed = packed.contiguous();
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), block = kActivationBlock[format];
  TORCH_CHECK(k % block == 0, "int linear: K (", k, ") must be a multiple of ", block);
  TORCH_CHECK(packed.size(1) == k / block * kChunkBytes[format] + (format == kI8 ? 64 : 0),
              "int linear: the weight's bytes per 16 rows do not match K (", k, ")");
  TORCH_CHECK(n <= blocks * kRows && n > (blocks - 1) * kRows, "int linear: n (", n, ") vs ", blocks, " blocks");
  // the calling thread's buffers for the quantized activations, kept between calls: a decode step makes hundreds
  // of small calls, and three allocations each would cost about as much as a small matmul
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int32_t> sums;
  q.resize(m * k);
  d.resize(m * (k / block));
  sums.resize(m * (k / 16));
  quantize_activations(x.data_ptr<float>(), m, k, block, int(isa), q.data(), d.data(), sums.data());
  auto y = torch::empty({m, blocks * kRows}, x.options());
  const Args args{q.data(), d.data(), sums.data(), packed.data_ptr<uint8_t>(), packed.size(1), y.data_ptr<float>(),
                  blocks * kRows, m, k};
  const Run run = kRuns[isa];
  if (m > 0) at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { run(args, int(format), b0, b1); });
  return (n == blocks * kRows ? y : y.narrow(1, 0, n).contiguous()).view(out_sizes);
}

// the path kiln::int_linear takes: the best this CPU has until set_isa() pins another
int best_isa() {
  int isa = 0;
  while (isa < 3 && cpu_has(isa + 1)) ++isa;
  return isa;
}
std::atomic<int> g_isa{best_isa()};

void set_isa(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa < 4 && cpu_has(int(isa)), "int linear: this CPU cannot run path ", isa);
  g_isa = int(isa);
}

// kiln::int_linear as the dispatcher calls it from a compiled step: C++ throughout, no Python frame per matmul
// (int_gemm.py defines the schema; this is its CPU kernel)
torch::Tensor int_linear_op(const torch::Tensor& x, const torch::Tensor& packed, c10::string_view qtype, int64_t n,
                            int64_t k) {
  static const char* const kNames[] = {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "I8"};
  int64_t format = 0;
  while (format <= kI8 && qtype != kNames[format]) ++format;
  TORCH_CHECK_VALUE(format <= kI8, "unknown quantized type '", qtype, "'");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == k, qtype, " linear: the input's K ", x.size(-1),
                    " is not the weight's ", k);
  return linear(x, packed, format, n, g_isa.load());
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("int_linear", &int_linear_op); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_isas", &cpu_isas, "the instruction-set paths this CPU runs, slowest first");
  m.def("set_isa", &set_isa, "the path kiln::int_linear takes (an index into the scalar, avx2, ... list)");
  m.def("isa", [] { return int64_t(g_isa.load()); }, "the path kiln::int_linear takes now");
  m.def("linear", &linear, "x [..., K] float32 against a packed weight -> [..., n]", py::arg("x"), py::arg("packed"),
        py::arg("format"), py::arg("n"), py::arg("isa"));
}

#else  // KILN_INT_GEMM_KERNELS: the kernels, over the enclosing namespace's Ops

using I = Ops::I;
using F = Ops::F;
using W = Ops::W;

// sums[i * NB + j] += block j's 16 rows' dot products with activation row i (x + i * K) over 32 K values of 4-bit
// weights (the four 64-byte vectors at quants + j * stride)
template <int MB, int NB>
static inline void nibble_dots(const Args& a, const uint8_t* quants, int64_t stride, const int8_t* x, I* sums) {
  typename Ops::P pairs[MB * NB];
  for (int t = 0; t < MB * NB; ++t) pairs[t] = Ops::pzero();
  for (int v = 0; v < 4; ++v)
    for (int j = 0; j < NB; ++j) {
      const W raw = Ops::load(quants + j * stride + 64 * v), low = Ops::low(raw), high = Ops::high(raw);
      for (int i = 0; i < MB; ++i) {
        pairs[i * NB + j] = Ops::dot_pairs(pairs[i * NB + j], low, load4(x + i * a.k + 8 * v));
        pairs[i * NB + j] = Ops::dot_pairs(pairs[i * NB + j], high, load4(x + i * a.k + 8 * v + 4));
      }
    }
  for (int t = 0; t < MB * NB; ++t) sums[t] = Ops::widen(sums[t], pairs[t]);
}

// the integer dot products of one 32-wide block of K: MB activation rows against NB blocks of 16 rows
template <int FMT, int MB, int NB>
static inline void dots32(const Args& a, const uint8_t* quants, const int8_t* x, I* isum) {
  for (int t = 0; t < MB * NB; ++t) isum[t] = Ops::izero();
  if constexpr (FMT == kQ4_0 || FMT == kQ4_1) {
    nibble_dots<MB, NB>(a, quants, a.block_bytes, x, isum);
  } else {
    for (int g = 0; g < 8; ++g)
      for (int j = 0; j < NB; ++j) {
        const W q = Ops::flip(Ops::load(quants + j * a.block_bytes + 64 * g));
        for (int i = 0; i < MB; ++i)
          isum[i * NB + j] = Ops::dot_signed(isum[i * NB + j], q, load4(x + i * a.k + 4 * g));
      }
  }
}

// Q4_0, Q4_1, Q8_0, I8: MB activation rows from m0 against NB consecutive blocks of 16 rows (w), blocks of 32 along
// K. Several blocks a tile share each activation row's broadcasts and its per-block scalars.
template <int FMT, int MB, int NB>
static inline void tile32(const Args& a, const uint8_t* w, int64_t m0, float* y) {
  constexpr bool kNibbles = FMT == kQ4_0 || FMT == kQ4_1;
  constexpr int64_t kHeader = FMT == kQ4_1 ? 64 : FMT == kI8 ? 0 : 32;
  constexpr int32_t kOffset = kNibbles ? (FMT == kQ4_0 ? 8 : 0) : Ops::kSignedOffset;
  const int64_t chunks = a.k / 32;
  F row_scale[NB];
  if constexpr (FMT == kI8) {
    for (int j = 0; j < NB; ++j) row_scale[j] = Ops::load_float(w + j * a.block_bytes);
    w += 64;
  }
  F acc[MB * NB];
  for (int t = 0; t < MB * NB; ++t) acc[t] = Ops::fzero();
  const int8_t* x = a.qa + m0 * a.k;
  for (int64_t c = 0; c < chunks; ++c, w += kChunkBytes[FMT], x += 32) {
    I isum[MB * NB];
    dots32<FMT, MB, NB>(a, w + kHeader, x, isum);
    for (int i = 0; i < MB; ++i) {
      const int64_t row = m0 + i;
      const float da = a.da[row * chunks + c];
      const int32_t sum = run_sum(a, row, c, 32);
      const I offset = Ops::set1(kOffset * sum);
      const F da_v = Ops::set1(da), sum_a = Ops::set1(da * float(sum));
      for (int j = 0; j < NB; ++j) {
        const int t = i * NB + j;
        const F scale = FMT == kI8 ? row_scale[j] : Ops::load_half(w + j * a.block_bytes);
        if (kOffset != 0) isum[t] = Ops::sub(isum[t], offset);
        F term = Ops::mul(Ops::cvt(isum[t]), Ops::mul(scale, da_v));
        if constexpr (FMT == kQ4_1) {
          term = Ops::add(term, Ops::mul(Ops::load_half(w + j * a.block_bytes + 32), sum_a));
        }
        acc[t] = Ops::add(acc[t], term);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) Ops::store(y + i * a.y_stride + j * kRows, acc[i * NB + j]);
}

// Q4_K: super-blocks of 256, eight 32-wide sub-blocks with 6-bit scales and mins
template <int MB>
static inline void tile_q4_k(const Args& a, const uint8_t* w, int64_t m0, float* y) {
  const int64_t supers = a.k / 256;
  F acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = Ops::fzero();
  for (int64_t c = 0; c < supers; ++c, w += kChunkBytes[kQ4_K]) {
    I sumi[MB], summ[MB];
    for (int i = 0; i < MB; ++i) sumi[i] = summ[i] = Ops::izero();
    for (int u = 0; u < 8; ++u) {
      const I scale = Ops::widen_u8(w + 64 + 16 * u), min = Ops::widen_u8(w + 192 + 16 * u);
      const uint8_t* quants = w + 320 + 256 * u;
      const int8_t* x = a.qa + m0 * a.k + c * 256 + 32 * u;
      I part[MB];
      for (int i = 0; i < MB; ++i) part[i] = Ops::izero();
      nibble_dots<MB, 1>(a, quants, 0, x, part);
      for (int i = 0; i < MB; ++i) {
        sumi[i] = Ops::add(sumi[i], Ops::mullo(part[i], scale));
        summ[i] = Ops::add(summ[i], Ops::mullo(min, Ops::set1(run_sum(a, m0 + i, c * 8 + u, 32))));
      }
    }
    const F d = Ops::load_half(w), dmin = Ops::load_half(w + 32);
    for (int i = 0; i < MB; ++i) {
      const F da = Ops::set1(a.da[(m0 + i) * supers + c]);
      const F scaled = Ops::mul(Ops::cvt(sumi[i]), Ops::mul(d, da));
      const F term = Ops::sub(scaled, Ops::mul(Ops::cvt(summ[i]), Ops::mul(dmin, da)));
      acc[i] = Ops::add(acc[i], term);
    }
  }
  for (int i = 0; i < MB; ++i) Ops::store(y + i * a.y_stride, acc[i]);
}

// Q6_K: super-blocks of 256, sixteen 16-wide sub-blocks with int8 scales, values 6-bit offset by 32
template <int MB>
static inline void tile_q6_k(const Args& a, const uint8_t* w, int64_t m0, float* y) {
  const int64_t supers = a.k / 256;
  F acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = Ops::fzero();
  for (int64_t c = 0; c < supers; ++c, w += kChunkBytes[kQ6_K]) {
    I sumi[MB];
    for (int i = 0; i < MB; ++i) sumi[i] = Ops::izero();
    for (int u = 0; u < 8; ++u) {
      const uint8_t* quants = w + 288 + 384 * u;
      const int8_t* x = a.qa + m0 * a.k + c * 256 + 32 * u;
      for (int half = 0; half < 2; ++half) {  // the unit's two sub-blocks of 16
        const int sub = 2 * u + half;
        const W crumbs = Ops::load(quants + 256 + 64 * half);
        I part[MB];
        for (int i = 0; i < MB; ++i) part[i] = Ops::izero();
        for (int v = 2 * half; v < 2 * half + 2; ++v) {
          const W raw = Ops::load(quants + 64 * v);
          const W even = Ops::join(Ops::low(raw), Ops::crumb(crumbs, 2 * v - 4 * half));
          const W odd = Ops::join(Ops::high(raw), Ops::crumb(crumbs, 2 * v + 1 - 4 * half));
          for (int i = 0; i < MB; ++i) {
            part[i] = Ops::dot(part[i], even, load4(x + i * a.k + 8 * v));
            part[i] = Ops::dot(part[i], odd, load4(x + i * a.k + 8 * v + 4));
          }
        }
        const I scale = Ops::widen_s8(w + 32 + 16 * sub);
        for (int i = 0; i < MB; ++i) {
          part[i] = Ops::sub(part[i], Ops::set1(32 * run_sum(a, m0 + i, c * 16 + sub, 16)));
          sumi[i] = Ops::add(sumi[i], Ops::mullo(part[i], scale));
        }
      }
    }
    const F d = Ops::load_half(w);
    for (int i = 0; i < MB; ++i) {
      const F da = Ops::set1(a.da[(m0 + i) * supers + c]);
      acc[i] = Ops::add(acc[i], Ops::mul(Ops::cvt(sumi[i]), Ops::mul(d, da)));
    }
  }
  for (int i = 0; i < MB; ++i) Ops::store(y + i * a.y_stride, acc[i]);
}

template <int FMT, int MB, int NB>
static inline void tile(const Args& a, const uint8_t* w, int64_t m0, float* y) {
  if constexpr (FMT == kQ4_K) tile_q4_k<MB>(a, w, m0, y);
  else if constexpr (FMT == kQ6_K) tile_q6_k<MB>(a, w, m0, y);
  else tile32<FMT, MB, NB>(a, w, m0, y);
}

// activation rows [m0, m1) against NB blocks from b, kTile rows at a time
template <int FMT, int NB>
static void rows(const Args& a, int64_t b, int64_t m0, int64_t m1) {
  const uint8_t* w = a.w + b * a.block_bytes;
  float* y = a.y + b * kRows;
  int64_t m = m0;
  for (; m + Ops::kTile <= m1; m += Ops::kTile) tile<FMT, Ops::kTile, NB>(a, w, m, y + m * a.y_stride);
  switch (m1 - m) {  // fewer than kTile rows left
    case 3:
      if constexpr (Ops::kTile > 3) tile<FMT, 3, NB>(a, w, m, y + m * a.y_stride);
      break;
    case 2:
      if constexpr (Ops::kTile > 2) tile<FMT, 2, NB>(a, w, m, y + m * a.y_stride);
      break;
    case 1: tile<FMT, 1, NB>(a, w, m, y + m * a.y_stride); break;
    default: break;
  }
}

// blocks [b0, b1): panels of kPanel activation rows (kept in cache) run over each block in turn, so a block is
// read once per panel and the panel once per block from cache rather than memory; the 32-wide formats take
// Ops::kBlocks blocks a tile where the registers hold them
// A few activation rows make a call read-bound: each thread streams its blocks once. The hardware prefetchers
// stop at every 4 KiB page and start again from a miss, so the blocks a little ahead are asked for here.
constexpr int64_t kPrefetchAhead = 2;  // tiles of blocks ahead
constexpr int64_t kPrefetchRows = 8;  // up to this many activation rows (a batch-1 verify step has up to 8)

static inline void prefetch_blocks(const Args& a, int64_t b0, int64_t b1, int64_t rows) {
  if (rows > kPrefetchRows) return;
  const char* first = reinterpret_cast<const char*>(a.w + b0 * a.block_bytes);
  const char* end = reinterpret_cast<const char*>(a.w + b1 * a.block_bytes);
  for (const char* line = first; line < end; line += 64) _mm_prefetch(line, _MM_HINT_T0);
}

template <int FMT>
static void blocks(const Args& a, int64_t b0, int64_t b1) {
  constexpr int NB = FMT == kQ4_K || FMT == kQ6_K ? 1 : Ops::kBlocks;
  for (int64_t p = 0; p < a.m; p += kPanel) {
    const int64_t p1 = std::min(a.m, p + kPanel);
    int64_t b = b0;
    for (; b + NB <= b1; b += NB) {
      prefetch_blocks(a, b + kPrefetchAhead * NB, std::min(b1, b + (kPrefetchAhead + 1) * NB), p1 - p);
      rows<FMT, NB>(a, b, p, p1);
    }
    for (; b < b1; ++b) rows<FMT, 1>(a, b, p, p1);
  }
}

void run(const Args& a, int format, int64_t b0, int64_t b1) {
  switch (format) {
    case kQ4_0: return blocks<kQ4_0>(a, b0, b1);
    case kQ4_1: return blocks<kQ4_1>(a, b0, b1);
    case kQ8_0: return blocks<kQ8_0>(a, b0, b1);
    case kQ4_K: return blocks<kQ4_K>(a, b0, b1);
    case kQ6_K: return blocks<kQ6_K>(a, b0, b1);
    case kI8: return blocks<kI8>(a, b0, b1);
    default: return;
  }
}

#endif  // KILN_INT_GEMM_KERNELS
