// Kiln's CPU matmul for float32 linear layers: y = x W^T (+ bias added by the caller).
//
// The weight is packed once, at load, into blocks of 16 output columns laid out [N / 16, K, 16]: a block is one
// contiguous stream of K rows of 16 floats (two AVX2 vectors). Each thread takes whole blocks; for each block it
// walks the rows of x four at a time, broadcasting x[m, k] against the block's row k, so a block is read from
// memory once per call whatever the batch size and stays in L1/L2 while the rows of x go past. At decode batch
// sizes this reads the weights at close to the memory bandwidth (docs/benchmarks.md).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

constexpr int64_t kBlock = 16;  // output columns per block
constexpr int64_t kPrefetch = 16;  // rows of a block ahead of the one being read

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

torch::Tensor linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear: a 2-D float32 input");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.size(1) == x.size(1),
              "linear: a weight from pack() with the input's K");
  x = x.contiguous();
  const int64_t m_size = x.size(0), k_size = x.size(1), blocks = packed.size(0), n_size = blocks * kBlock;
  auto y = torch::empty({m_size, n_size}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* block = wp + b * k_size * kBlock;
      float* yb = yp + b * kBlock;
      int64_t m = 0;
      for (; m + 4 <= m_size; m += 4) tile<4>(xp + m * k_size, block, yb + m * n_size, k_size, n_size);
      const float* xr = xp + m * k_size;
      float* yr = yb + m * n_size;
      switch (m_size - m) {
        case 3: tile<3>(xr, block, yr, k_size, n_size); break;
        case 2: tile<2>(xr, block, yr, k_size, n_size); break;
        case 1: tile<1>(xr, block, yr, k_size, n_size); break;
        default: break;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "W [N, K] -> [N / 16, K, 16]");
  m.def("linear", &linear, "x [M, K] @ packed^T -> [M, N]");
}
