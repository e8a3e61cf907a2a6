"""The host's float32 FMA peak, and what it allows the comparison's 32-stream workload at most.

A loop of independent 8-wide AVX2 FMAs in registers (no memory traffic), built with g++, on N threads at once:
the most float32 arithmetic these cores do, whatever the kernel. The 32-stream workload of benchmarks/compare.py ((a): 64
requests of ~200 prompt tokens and 128 output tokens) needs at least 2 x (parameters without the embedding)
FLOPs a prompt token and 2 x parameters a decoded token in float32 (attention, norms and everything else left
out), so its output tok/s cannot exceed output tokens / (FLOPs / peak).

    python benchmarks/fma_peak.py [--threads 2] [--prompt-tokens 12800] [--output-tokens 8192]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

// rounds of 12 independent FMA chains on 8 floats: 12 x 8 x 2 FLOPs a round, all in registers
static float chains(long rounds) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(0.001f * i);
  const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-4f);
  for (long r = 0; r < rounds; ++r)
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], x, y);
  float sink = 0;
  for (int i = 0; i < 12; ++i) sink += a[i][0];
  return sink;
}

int main(int argc, char** argv) {
  const int threads = std::atoi(argv[1]);
  const long rounds = std::atol(argv[2]);
  std::vector<std::thread> pool;
  std::vector<float> sinks(threads);
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { sinks[t] = chains(rounds); });
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%f %f\n", threads * rounds * 12 * 16 / s / 1e9, sinks[0]);
}
"""


def build() -> Path:
    """The FMA loop compiled with g++."""
    out = Path(tempfile.mkdtemp(prefix="kiln-fma-"))
    (out / "fma.cpp").write_text(SOURCE)
    cmd = ["g++", "-O3", "-mavx2", "-mfma", "-pthread", str(out / "fma.cpp"), "-o", str(out / "fma")]
    subprocess.run(cmd, check=True)
    return out / "fma"


def gflops(binary: Path, threads: int, rounds: int = 200_000_000) -> float:
    """Best of three runs of the FMA loop on `threads` threads at once, GFLOP/s."""
    runs = [subprocess.run([str(binary), str(threads), str(rounds)], capture_output=True, text=True,
                           check=True) for _ in range(3)]  # fmt: skip
    return max(float(r.stdout.split()[0]) for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64 * 200)
    ap.add_argument("--output-tokens", type=int, default=64 * 128)
    ap.add_argument("--params", type=float, default=134_515_008, help="the default model's")
    ap.add_argument("--embedding", type=float, default=49152 * 576, help="its (tied) embedding table")
    args = ap.parse_args()
    binary = build()
    one, all_threads = gflops(binary, 1), gflops(binary, args.threads)
    work = 2 * (args.params - args.embedding) * args.prompt_tokens + 2 * args.params * args.output_tokens
    seconds = work / (all_threads * 1e9)
    print(f"float32 FMA peak: {one:.1f} GFLOP/s on one thread, {all_threads:.1f} on {args.threads}")
    print(f"workload: {work / 1e12:.2f} TFLOP of matmuls alone -> >= {seconds:.1f} s at the peak, "
          f"<= {args.output_tokens / seconds:.0f} output tok/s")  # fmt: skip


if __name__ == "__main__":
    main()
