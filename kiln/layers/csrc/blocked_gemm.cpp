// Kiln's CPU matmul for float32 linear layers: y = x W^T (+ bias added by the caller).
//
// The weight is packed once, at load, into blocks of 16 output columns laid out [N / 16, K, 16]: a block is one
// contiguous stream of K rows of 16 floats (two AVX2 vectors). Each thread takes whole blocks; for each block it
// walks the rows of x four at a time, broadcasting x[m, k] against the block's row k, so a block is read from
// memory once per call whatever the batch size and stays in L1/L2 while the rows of x go past. At decode batch
// sizes this reads the weights at close to the memory bandwidth (docs/benchmarks.md).
//
// GGML-quantized weights (Q4_1, Q8_0) keep their raw blocks, re-laid by 16-column block (pack_q4_1, pack_q8_0,
// layouts below), and are dequantized inside the matmul: at 1-4 rows of x in registers as the row tile goes, from
// 5 rows up one block at a time into a thread-local float32 buffer in exactly the [K, 16] layout above, the same row
// tiles then running over it. The dequantized values equal gguf's (d * q is exact in float32: an 11-bit fp16
// mantissa times a 4- or 8-bit integer, so fma(d, q, m) rounds once, as gguf's (d * q) + m does) and every output is
// accumulated with the same FMAs in the same order, so the products are bit-identical to linear() on the weight
// gguf.quants.dequantize gives, while a decode step reads 0.625 (Q4_1) or 1.0625 (Q8_0) bytes a weight instead of 4.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>

constexpr int64_t kBlock = 16;  // output columns per block
constexpr int64_t kPrefetch = 16;  // rows of a block ahead of the one being read
constexpr int64_t kChunk = 32;  // K per GGML block (Q4_1, Q8_0)

torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack: a 2-D float32 weight");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % kBlock == 0, "pack: output features must be a multiple of ", kBlock);
  return w.contiguous().view({n / kBlock, kBlock, k}).transpose(1, 2).contiguous();
}

// rows x[0..MB) against one block: y[i, 0..16) = sum_k x[i, k] * block[k, 0..16)
template <int MB>
static inline void tile(const float* x, const float* block, float* y, int64_t k_size, int64_t n_size) {
  __m256 lo[MB], hi[MB];
  for (int i = 0; i < MB; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    const float* row = block + k * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch * kBlock), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * k_size + k);
      lo[i] = _mm256_fmadd_ps(xv, w0, lo[i]);
      hi[i] = _mm256_fmadd_ps(xv, w1, hi[i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    _mm256_storeu_ps(y + i * n_size, lo[i]);
    _mm256_storeu_ps(y + i * n_size + 8, hi[i]);
  }
}

// AVX-512, where the CPU has it: the block's 16 columns in one register, so half the FMA instructions of tile() for
// the same products; each output gets the same FMAs in the same k order as in tile(), so the same bits. Compiled
// for AVX-512 function by function (the file's flags stop at AVX2), entered only where cpuid reports AVX-512F.
template <int MB>
__attribute__((target("avx512f"))) static inline void tile512(const float* x, const float* block, float* y,
                                                              int64_t k_size, int64_t n_size) {
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    const float* row = block + k * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch * kBlock), _MM_HINT_T0);
    const __m512 w = _mm512_loadu_ps(row);
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * k_size + k]), w, acc[i]);
  }
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(y + i * n_size, acc[i]);
}

// block_rows() on AVX-512: eight rows a tile (32 registers hold eight accumulators), then four, then the rest
__attribute__((target("avx512f"))) static void block_rows512(const float* x, const float* block, float* y,
                                                             int64_t m_size, int64_t k_size, int64_t n_size) {
  int64_t m = 0;
  for (; m + 8 <= m_size; m += 8) tile512<8>(x + m * k_size, block, y + m * n_size, k_size, n_size);
  for (; m + 4 <= m_size; m += 4) tile512<4>(x + m * k_size, block, y + m * n_size, k_size, n_size);
  const float* xr = x + m * k_size;
  float* yr = y + m * n_size;
  switch (m_size - m) {
    case 3: tile512<3>(xr, block, yr, k_size, n_size); break;
    case 2: tile512<2>(xr, block, yr, k_size, n_size); break;
    case 1: tile512<1>(xr, block, yr, k_size, n_size); break;
    default: break;
  }
}

// whether block_rows() takes the AVX-512 path: the CPU's answer, unless set_avx512() pinned one (tests compare the
// two paths bit for bit)
static std::atomic<int> avx512_path{-1};  // -1: not asked yet, 0: AVX2, 1: AVX-512

static bool use_avx512() {
  int path = avx512_path.load(std::memory_order_relaxed);
  if (path < 0) {
    __builtin_cpu_init();
    path = __builtin_cpu_supports("avx512f") ? 1 : 0;
    avx512_path.store(path, std::memory_order_relaxed);
  }
  return path == 1;
}

// set_avx512(true) where the CPU has AVX-512F, set_avx512(false) anywhere: which path the float32 tiles take
void set_avx512(bool enable) {
  __builtin_cpu_init();
  TORCH_CHECK(!enable || __builtin_cpu_supports("avx512f"), "set_avx512: this CPU lacks AVX-512F");
  avx512_path.store(enable ? 1 : 0, std::memory_order_relaxed);
}

bool avx512_enabled() { return use_avx512(); }

// every row of x against one [K, 16] float32 block, four rows at a time: y[:, 0..16) of the block's columns
static void block_rows(const float* x, const float* block, float* y, int64_t m_size, int64_t k_size,
                       int64_t n_size) {
  if (use_avx512()) return block_rows512(x, block, y, m_size, k_size, n_size);
  int64_t m = 0;
  for (; m + 4 <= m_size; m += 4) tile<4>(x + m * k_size, block, y + m * n_size, k_size, n_size);
  const float* xr = x + m * k_size;
  float* yr = y + m * n_size;
  switch (m_size - m) {
    case 3: tile<3>(xr, block, yr, k_size, n_size); break;
    case 2: tile<2>(xr, block, yr, k_size, n_size); break;
    case 1: tile<1>(xr, block, yr, k_size, n_size); break;
    default: break;
  }
}

// this thread's buffer of at least `floats` floats, 64-byte aligned, kept for the thread's life (grown as needed)
static float* scratch_buffer(size_t floats) {
  thread_local std::unique_ptr<float, decltype(&std::free)> buffer(nullptr, &std::free);
  thread_local size_t capacity = 0;
  if (floats > capacity) {
    const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
    buffer.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buffer != nullptr, "blocked matmul: out of memory for a ", bytes, "-byte block buffer");
    capacity = bytes / sizeof(float);
  }
  return buffer.get();
}

void dynamic_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);  // cpu_ops.cpp

// x [M, K] against `blocks` blocks of 16 columns -> y [M, blocks * 16], in parallel over ranges of blocks:
// run(b0, b1, x, y) fills y's columns of blocks [b0, b1).
template <class Run>
static torch::Tensor over_blocks(torch::Tensor x, int64_t blocks, Run run) {
  x = x.contiguous();
  auto y = torch::empty({x.size(0), blocks * kBlock}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // ~8 ranges a thread, handed out as threads come free (cpu_ops.cpp)
  const int64_t grain = std::max<int64_t>(1, blocks / (8 * at::get_num_threads()));
  dynamic_for(blocks, grain, [&](int64_t b0, int64_t b1) { run(b0, b1, xp, yp); });
  return y;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear: a 2-D float32 input");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.size(1) == x.size(1),
              "linear: a weight from pack() with the input's K");
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = packed.size(0) * kBlock;
  const float* wp = packed.data_ptr<float>();
  return over_blocks(x, packed.size(0), [=](int64_t b0, int64_t b1, const float* xp, float* yp) {
    for (int64_t b = b0; b < b1; ++b)
      block_rows(xp, wp + b * k_size * kBlock, yp + b * kBlock, m_size, k_size, n_size);
  });
}

// ---- GGML-quantized weights ----
//
// GGML rows (one per output feature) are runs of 32-wide K blocks. Packed, a weight is [N / 16, K / 32, C] uint8:
// for each block of 16 output columns, its K / 32 chunks one after another, each chunk C bytes (the same bytes as
// the 16 GGML blocks it came from, re-laid so one vector load gives one k's columns):
//
//   Q4_1 (C = 320): d[16] fp16 (32 B) | m[16] fp16 (32 B) | 32 rows of 8 bytes, row k: byte i = q[col i, k] in the
//                   low nibble, q[col i + 8, k] in the high nibble; w[col, k] = d[col] * q + m[col]
//   Q8_0 (C = 544): d[16] fp16 (32 B) | 32 rows of 16 int8, row k: byte i = q[col i, k]; w[col, k] = d[col] * q
//
// so a k row expands with widening loads (vpmovzxbd / vpmovsxbd) and (Q4_1) a mask or shift to 8 + 8 columns, the
// fp16 scales with _mm256_cvtph_ps once per chunk.
//
// Two ways through a weight, the same products. At 1-4 rows of x (decode), the k rows are expanded in registers as the
// one row tile goes (fused_tile); from 5 rows up, each block is expanded once into this thread's float32 buffer and
// the float32 row tiles run over it (the expansion amortized over all the rows instead of repeated for every 4,
// which pays from a few rows on; the crossover is in docs/benchmarks.md). Both accumulate each output over k in
// order with the same FMAs as tile().

static inline __m256 load_fp16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A format: kBytes (one GGML block), kChunkBytes (a packed chunk), kScales (floats of a chunk's scales),
// scales(chunk, table) (the chunk's fp16 scales -> float32 table), row(chunk, table, k, w0, w1) (k row of the chunk:
// columns 0..8 into w0, 8..16 into w1) and relay(src, chunk, col) (one column's GGML block into its zeroed chunk).
struct Q4_1 {
  static constexpr const char* kName = "q4_1";
  static constexpr int64_t kBytes = 20;  // one GGML block: d fp16 | m fp16 | qs[16]
  static constexpr int64_t kChunkBytes = kBlock * kBytes;
  static constexpr int kScales = 2 * kBlock;  // d[16] | m[16]
  static inline void scales(const uint8_t* chunk, float* table) {
    for (int i = 0; i < kScales / 8; ++i) _mm256_store_ps(table + 8 * i, load_fp16x8(chunk + 16 * i));
  }
  // fma(d, q, m) is gguf's d * q + m: d * q is exact
  static inline void row(const uint8_t* chunk, const float* table, int k, __m256& w0, __m256& w1) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk + 4 * kBlock + 8 * k));
    const __m256i v = _mm256_cvtepu8_epi32(bytes);
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    w0 = _mm256_fmadd_ps(_mm256_load_ps(table), q0, _mm256_load_ps(table + 16));
    w1 = _mm256_fmadd_ps(_mm256_load_ps(table + 8), q1, _mm256_load_ps(table + 24));
  }
  // GGML's qs[j] holds k = j in its low nibble, k = j + 16 in its high one
  static inline void relay(const uint8_t* src, uint8_t* chunk, int col) {
    std::memcpy(chunk + 2 * col, src, 2);
    std::memcpy(chunk + 2 * kBlock + 2 * col, src + 2, 2);
    uint8_t* q = chunk + 4 * kBlock + (col & 7);
    const int shift = col < 8 ? 0 : 4;
    for (int j = 0; j < kChunk / 2; ++j) {
      q[8 * j] |= static_cast<uint8_t>((src[4 + j] & 0xF) << shift);
      q[8 * (j + kChunk / 2)] |= static_cast<uint8_t>((src[4 + j] >> 4) << shift);
    }
  }
};

struct Q8_0 {
  static constexpr const char* kName = "q8_0";
  static constexpr int64_t kBytes = 34;  // one GGML block: d fp16 | qs[32] int8
  static constexpr int64_t kChunkBytes = kBlock * kBytes;
  static constexpr int kScales = kBlock;  // d[16]
  static inline void scales(const uint8_t* chunk, float* table) {
    for (int i = 0; i < kScales / 8; ++i) _mm256_store_ps(table + 8 * i, load_fp16x8(chunk + 16 * i));
  }
  // two 8-byte loads, each sign-extended from memory: cheaper than one 16-byte load plus the cross-lane shuffle
  // its upper half would need before widening (docs/benchmarks.md)
  static inline void row(const uint8_t* chunk, const float* table, int k, __m256& w0, __m256& w1) {
    const uint8_t* q = chunk + 2 * kBlock + kBlock * k;
    const __m256i q0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i q1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
    w0 = _mm256_mul_ps(_mm256_load_ps(table), _mm256_cvtepi32_ps(q0));
    w1 = _mm256_mul_ps(_mm256_load_ps(table + 8), _mm256_cvtepi32_ps(q1));
  }
  static inline void relay(const uint8_t* src, uint8_t* chunk, int col) {
    std::memcpy(chunk + 2 * col, src, 2);
    uint8_t* q = chunk + 2 * kBlock + col;
    for (int k = 0; k < kChunk; ++k) q[kBlock * k] = src[2 + k];
  }
};

static inline void prefetch_chunk(const uint8_t* chunk, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(chunk + off), _MM_HINT_T0);
}

constexpr int64_t kChunkPrefetch = 4;  // chunks of a block ahead of the one being expanded

// raw GGML rows [N, K / 32 * Q::kBytes] -> [N / 16, K / 32, Q::kChunkBytes]
template <class Q>
static torch::Tensor pack_quant(torch::Tensor raw) {
  const std::string name = std::string("pack_") + Q::kName;
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte, name, ": raw GGML rows, a 2-D uint8 tensor [N, K / ",
              kChunk, " * ", Q::kBytes, "], got ", raw.scalar_type(), " of shape ", raw.sizes());
  TORCH_CHECK(raw.size(0) % kBlock == 0, name, ": output features (rows) must be a multiple of ", kBlock, ", got ",
              raw.size(0));
  TORCH_CHECK(raw.size(1) % Q::kBytes == 0, name, ": a row must be whole ", Q::kBytes, "-byte blocks of ", kChunk,
              " weights (K a multiple of ", kChunk, "), got ", raw.size(1), " bytes");
  raw = raw.contiguous();
  const int64_t n = raw.size(0), row_bytes = raw.size(1), chunks = row_bytes / Q::kBytes;
  torch::Tensor out = torch::zeros({n / kBlock, chunks, Q::kChunkBytes}, raw.options());
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kBlock, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < chunks; ++c)
        for (int col = 0; col < kBlock; ++col)
          Q::relay(rp + (b * kBlock + col) * row_bytes + c * Q::kBytes, op + (b * chunks + c) * Q::kChunkBytes, col);
  });
  return out;
}

// one block's K / 32 chunks -> its [K, 16] float32 block (pack()'s layout)
template <class Q>
static void expand(const uint8_t* src, float* dst, int64_t chunks) {
  alignas(32) float table[Q::kScales];
  for (int64_t c = 0; c < chunks; ++c, src += Q::kChunkBytes, dst += kChunk * kBlock) {
    prefetch_chunk(src + kChunkPrefetch * Q::kChunkBytes, Q::kChunkBytes);
    Q::scales(src, table);
    for (int k = 0; k < kChunk; ++k) {
      __m256 w0, w1;
      Q::row(src, table, k, w0, w1);
      _mm256_store_ps(dst + k * kBlock, w0);
      _mm256_store_ps(dst + k * kBlock + 8, w1);
    }
  }
}

// rows x[0..MB) against NB consecutive quantized blocks (at w, each `chunks` chunks long), expanding each k row in
// registers: the FMAs of tile<MB>, each output's in k order. The accumulators are indexed t = i * NB + j, every loop
// over them innermost and flat, and copied into per-chunk locals: GCC (12) otherwise keeps them in memory too and
// stores all of them at every k, turning a register-bound loop into a store-bound one. The scales are read from a
// float table in L1.
template <class Q, int MB, int NB>
static inline void fused_tile(const float* x, const uint8_t* w, float* y, int64_t chunks, int64_t k_size,
                              int64_t n_size) {
  constexpr int T = MB * NB;
  const int64_t stride = chunks * Q::kChunkBytes;
  __m256 lo[T], hi[T];
  for (int t = 0; t < T; ++t) lo[t] = hi[t] = _mm256_setzero_ps();
  alignas(32) float table[NB * Q::kScales];
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* chunk = w + c * Q::kChunkBytes;
    for (int j = 0; j < NB; ++j) {
      prefetch_chunk(chunk + j * stride + kChunkPrefetch * Q::kChunkBytes, Q::kChunkBytes);
      Q::scales(chunk + j * stride, table + j * Q::kScales);
    }
    const float* xc = x + c * kChunk;
    __m256 l[T], h[T];
    for (int t = 0; t < T; ++t) l[t] = lo[t], h[t] = hi[t];
    for (int k = 0; k < kChunk; ++k) {
      __m256 w0[NB], w1[NB], xv[MB];
      for (int j = 0; j < NB; ++j) Q::row(chunk + j * stride, table + j * Q::kScales, k, w0[j], w1[j]);
      for (int i = 0; i < MB; ++i) xv[i] = _mm256_broadcast_ss(xc + i * k_size + k);
      for (int t = 0; t < T; ++t) {
        l[t] = _mm256_fmadd_ps(xv[t / NB], w0[t % NB], l[t]);
        h[t] = _mm256_fmadd_ps(xv[t / NB], w1[t % NB], h[t]);
      }
    }
    for (int t = 0; t < T; ++t) lo[t] = l[t], hi[t] = h[t];
  }
  for (int t = 0; t < T; ++t) {
    _mm256_storeu_ps(y + (t / NB) * n_size + (t % NB) * kBlock, lo[t]);
    _mm256_storeu_ps(y + (t / NB) * n_size + (t % NB) * kBlock + 8, hi[t]);
  }
}

// rows x[0..MB) (MB <= 4) against blocks [b0, b1), expanding in registers; one row takes two blocks a tile: one
// block alone gives 2 independent FMA chains, too few to hide the FMA latency, and 4 chains ran fastest of the
// widths tried (docs/benchmarks.md)
template <class Q, int MB>
static void fused_blocks(const float* x, const uint8_t* w, float* y, int64_t b0, int64_t b1, int64_t chunks,
                         int64_t k_size, int64_t n_size) {
  constexpr int NB = MB == 1 ? 2 : 1;
  const int64_t stride = chunks * Q::kChunkBytes;
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) fused_tile<Q, MB, NB>(x, w + b * stride, y + b * kBlock, chunks, k_size, n_size);
  for (; b < b1; ++b) fused_tile<Q, MB, 1>(x, w + b * stride, y + b * kBlock, chunks, k_size, n_size);
}

// x [M, K] against a weight from pack_quant<Q>()
template <class Q>
static torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed) {
  const std::string name = std::string("linear_") + Q::kName;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, ": a 2-D float32 input");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == Q::kChunkBytes, name,
              ": a weight from pack_", Q::kName, "() ([N / 16, K / 32, ", Q::kChunkBytes, "] uint8), got ",
              packed.scalar_type(), " of shape ", packed.sizes());
  TORCH_CHECK(packed.size(1) * kChunk == x.size(1), name, ": the input's K (", x.size(1), ") is not the weight's (",
              packed.size(1) * kChunk, ")");
  packed = packed.contiguous();
  const int64_t m_size = x.size(0), k_size = x.size(1), chunks = packed.size(1), n_size = packed.size(0) * kBlock;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  return over_blocks(x, packed.size(0), [=](int64_t b0, int64_t b1, const float* xp, float* yp) {
    switch (m_size) {
      case 0: return;
      case 1: return fused_blocks<Q, 1>(xp, wp, yp, b0, b1, chunks, k_size, n_size);
      case 2: return fused_blocks<Q, 2>(xp, wp, yp, b0, b1, chunks, k_size, n_size);
      case 3: return fused_blocks<Q, 3>(xp, wp, yp, b0, b1, chunks, k_size, n_size);
      case 4: return fused_blocks<Q, 4>(xp, wp, yp, b0, b1, chunks, k_size, n_size);
      default: break;  // from 5 rows, the buffer: expanding once per block beats once per 4 rows
    }
    float* block = scratch_buffer(k_size * kBlock);
    for (int64_t b = b0; b < b1; ++b) {
      expand<Q>(wp + b * chunks * Q::kChunkBytes, block, chunks);
      block_rows(xp, block, yp + b * kBlock, m_size, k_size, n_size);
    }
  });
}

torch::Tensor pack_q4_1(torch::Tensor raw) { return pack_quant<Q4_1>(raw); }
torch::Tensor pack_q8_0(torch::Tensor raw) { return pack_quant<Q8_0>(raw); }
torch::Tensor linear_q4_1(torch::Tensor x, torch::Tensor packed) { return linear_quant<Q4_1>(x, packed); }
torch::Tensor linear_q8_0(torch::Tensor x, torch::Tensor packed) { return linear_quant<Q8_0>(x, packed); }

// cpu_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                               torch::Tensor mask, double scale, int64_t shared, torch::Tensor sinks);

// kiln::decode_attention as the dispatcher calls it from a compiled step, where the shared prefix's width is a
// one-element tensor (cpu_gemm.py defines the schema): C++ throughout, no Python frame per layer
torch::Tensor decode_attention_op(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                  const torch::Tensor& table, const torch::Tensor& mask, double scale,
                                  const torch::Tensor& shared) {
  return decode_attention(q, k_cache, v_cache, table, mask, scale, shared.item<int64_t>(), torch::Tensor());
}

// the Python binding's: no sinks unless given (None)
torch::Tensor decode_attention_py(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                                  torch::Tensor mask, double scale, int64_t shared,
                                  std::optional<torch::Tensor> sinks) {
  return decode_attention(q, k_cache, v_cache, table, mask, scale, shared, sinks.value_or(torch::Tensor()));
}

torch::Tensor rms_norm_op(const torch::Tensor& x, const torch::Tensor& w, double eps) { return rms_norm(x, w, eps); }

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("decode_attention", &decode_attention_op);
  m.impl("rms_norm", &rms_norm_op);  // a compiled step's norms: the eager step's arithmetic (cpu_gemm.cpu_rms_norm)
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "W [N, K] -> [N / 16, K, 16]");
  m.def("linear", &linear, "x [M, K] @ packed^T -> [M, N]");
  m.def("pack_q4_1", &pack_q4_1, "raw GGML Q4_1 rows [N, K / 32 * 20] uint8 -> [N / 16, K / 32, 320] uint8");
  m.def("pack_q8_0", &pack_q8_0, "raw GGML Q8_0 rows [N, K / 32 * 34] uint8 -> [N / 16, K / 32, 544] uint8");
  m.def("linear_q4_1", &linear_q4_1, "x [M, K] @ dequantized pack_q4_1 weight^T -> [M, N]");
  m.def("linear_q8_0", &linear_q8_0, "x [M, K] @ dequantized pack_q8_0 weight^T -> [M, N]");
  m.def("set_avx512", &set_avx512, "pin the float32 tiles to AVX-512 (true) or AVX2 (false)");
  m.def("avx512_enabled", &avx512_enabled, "whether the float32 tiles take the AVX-512 path");
  m.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2) + eps) * w over the last dimension");
  m.def("decode_attention", &decode_attention_py, "one token per request over its KV slots in the pool",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("table"), py::arg("mask"), py::arg("scale"),
        py::arg("shared") = 0, py::arg("sinks") = py::none());
}
