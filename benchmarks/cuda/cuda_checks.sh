#!/bin/bash
# Kiln's CUDA checks on a GPU machine, in two parts that each fit one device call (10 minutes), the first the one
# that matters most. Prepare the carried files here first (benchmarks/cuda/prepare_carry.sh), then run from the
# repo root with $OUT set, carry [".whl", ".devcarry"], timeout_s 600:
#   bash benchmarks/cuda/cuda_checks.sh 1   # Triton kernels natively, then the 8B-class model against the GPU's limits
#   bash benchmarks/cuda/cuda_checks.sh 2   # CUDA tests, default capture, graph and overlap benchmarks, fused A/B
#   bash benchmarks/cuda/cuda_checks.sh 3   # FP8 block weights kept on the GPU: their tests natively, their speed;
#                                           # a draft head's captured catch-ups against eager
#   bash benchmarks/cuda/cuda_checks.sh 4   # the tests alone of parts 2 and 3, for a few minutes left after part 1
#   bash benchmarks/cuda/cuda_checks.sh 5   # one short call: the 8B-class model with a profile of its batch-1
#                                           # decode steps, then every GPU test
#   bash benchmarks/cuda/cuda_checks.sh 6   # what has never run on a GPU: speculative decoding's draft graphs and
#                                           # the host tier on CUDA, a head's catch-ups, DeepSeek-V3 kept in FP8
#   bash benchmarks/cuda/cuda_checks.sh 7   # the host tier's copies beside the compute stream, and the
#                                           # hierarchical cache benchmark on CUDA
# Every log lands in $OUT as it is written, so a part stopped at its limit still returns what it did.
part=${1:-1}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD KILN_TINY_LLAMA=$PWD/.devcarry/tiny-llama
python3 -c "import torch,transformers,triton;print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())"
t0=$(date +%s)
step() { echo "=== $1 (at $(( $(date +%s) - t0 )) s)"; }

if [ "$part" = 1 ]; then
  step "Triton attention and fused kernels compiled for the GPU (the CPU runs them in Triton's interpreter); the device sampler"
  timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_triton_fused.py \
    tests/test_device_sampler.py -rA > $OUT/triton_tests.log 2>&1
  tail -c 2500 $OUT/triton_tests.log
  step "8B-class model against the GPU's limits, --attention-backend triton"
  timeout 380 python3 benchmarks/cuda/bench_8b.py --tokenizer .devcarry/tiny-llama --attention-backend triton \
    --json $OUT/bench_8b_triton.json > $OUT/bench_8b_triton.log 2>&1
  grep -v "Capturing" $OUT/bench_8b_triton.log | tail -45
fi

if [ "$part" = 2 ]; then
  step "CUDA tests"
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_graphs.py tests/test_allocator.py \
    tests/test_overlap.py -rA > $OUT/cuda_tests.log 2>&1
  tail -c 2000 $OUT/cuda_tests.log
  step "random SmolLM2-shape model"
  timeout 40 python3 benchmarks/cuda/make_random_smollm.py /tmp/smol .devcarry/tiny-llama 2>&1 | tail -2
  step "overlap schedule against the plain one"
  (cd benchmarks && timeout 120 python3 bench_overlap.py --device cuda --model-path /tmp/smol --cuda-graph-bs 1 32 \
    --bs 1 32 --max-new-tokens 64 --reps 2 > $OUT/bench_overlap_cuda.log 2>&1)
  tail -6 $OUT/bench_overlap_cuda.log
  step "8B-class model, fused kernels off (the A/B of part 1's run)"
  KILN_TRITON_FUSED=off timeout 300 python3 benchmarks/cuda/bench_8b.py --tokenizer .devcarry/tiny-llama \
    --attention-backend triton --json $OUT/bench_8b_unfused.json > $OUT/bench_8b_unfused.log 2>&1
  grep -v "Capturing" $OUT/bench_8b_unfused.log | tail -30
fi
if [ "$part" = 3 ]; then
  step "FP8 block weights kept in FP8: kernels, shards, a Qwen3-MoE and a DeepSeek-V3 FP8 checkpoint against transformers"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_weights.py \
    "tests/test_deepseek.py::test_an_fp8_checkpoint_loads_and_matches_transformers" -rA > $OUT/fp8_tests.log 2>&1
  tail -c 2500 $OUT/fp8_tests.log
  step "FP8 weights against bfloat16, DeepSeek-V3's per-rank shapes at tp 8"
  timeout 200 python3 benchmarks/cuda/bench_fp8.py --json $OUT/bench_fp8.json > $OUT/bench_fp8.log 2>&1
  tail -12 $OUT/bench_fp8.log | cut -c1-400
  step "a draft head's catch-ups: CUDA graphs against eager extends and eager decode rows"
  timeout 40 python3 benchmarks/cuda/make_random_smollm.py /tmp/smol .devcarry/tiny-llama 2>&1 | tail -2
  timeout 120 python3 benchmarks/bench_catch_up.py --device cuda --model-path /tmp/smol --bs 1 8 32 \
    --json $OUT/bench_catch_up.json > $OUT/bench_catch_up.log 2>&1
  grep -v "Capturing" $OUT/bench_catch_up.log | tail -6
fi
if [ "$part" = 4 ]; then
  step "CUDA tests, then FP8 block weights kept in FP8 against transformers"
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_graphs.py tests/test_allocator.py \
    tests/test_overlap.py -rA > $OUT/cuda_tests.log 2>&1
  tail -c 1500 $OUT/cuda_tests.log
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_weights.py -rA > $OUT/fp8_tests.log 2>&1
  tail -c 1500 $OUT/fp8_tests.log
fi
if [ "$part" = 5 ]; then
  step "8B-class model against the GPU's limits, --attention-backend triton, batch-1 decode profiled"
  timeout 100 python3 benchmarks/cuda/bench_8b.py --tokenizer .devcarry/tiny-llama --attention-backend triton \
    --profile --json $OUT/bench_8b_profiled.json > $OUT/bench_8b_profiled.log 2>&1
  python3 -c "import json; d = json.load(open('$OUT/bench_8b_profiled.json')); p = d.pop('profile_bs1'); \
print(json.dumps({k: d[k] for k in ('capture', 'decode_bs1', 'decode_bs64', 'prefill')})); \
print({k: v for k, v in p.items() if k != 'top'}); [print(r) for r in p['top']]" || tail -20 $OUT/bench_8b_profiled.log
  step "GPU tests: CUDA graphs and overlap; Triton kernels, the device sampler, FP8 weights kept"
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_graphs.py tests/test_allocator.py \
    tests/test_overlap.py -rfE > $OUT/cuda_tests.log 2>&1
  tail -c 800 $OUT/cuda_tests.log
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_triton_fused.py \
    tests/test_device_sampler.py tests/test_fp8_weights.py \
    "tests/test_deepseek.py::test_an_fp8_checkpoint_loads_and_matches_transformers" -rfE > $OUT/gpu_tests.log 2>&1
  tail -c 2500 $OUT/gpu_tests.log
fi
if [ "$part" = 6 ]; then
  step "draft CUDA graphs (EAGLE, STANDALONE) and the host tier on CUDA against the target alone"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_spec_hicache.py -rA \
    > $OUT/cuda_spec_hicache.log 2>&1
  tail -c 2500 $OUT/cuda_spec_hicache.log
  step "a draft head's catch-ups: CUDA graphs against eager extends and eager decode rows"
  timeout 40 python3 benchmarks/cuda/make_random_smollm.py /tmp/smol .devcarry/tiny-llama 2>&1 | tail -1
  timeout 90 python3 benchmarks/bench_catch_up.py --device cuda --model-path /tmp/smol --bs 1 8 32 \
    --json $OUT/bench_catch_up.json > $OUT/bench_catch_up.log 2>&1
  grep -v "Capturing" $OUT/bench_catch_up.log | tail -8
  step "DeepSeek-V3 FP8 checkpoints, dequantized and kept in FP8, against transformers"
  timeout 150 python3 -m pytest -q -p no:cacheprovider \
    "tests/test_deepseek.py::test_an_fp8_checkpoint_loads_and_matches_transformers" -rfE > $OUT/deepseek_fp8.log 2>&1
  tail -c 1500 $OUT/deepseek_fp8.log
fi
if [ "$part" = 7 ]; then
  step "the host tier's copies on their own stream, then the hierarchical cache's TTFT on CUDA"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_spec_hicache.py -k "tier" -rA \
    > $OUT/tier_copies.log 2>&1
  tail -c 1500 $OUT/tier_copies.log
  timeout 40 python3 benchmarks/cuda/make_random_smollm.py /tmp/smol .devcarry/tiny-llama 2>&1 | tail -1
  timeout 300 python3 benchmarks/bench_hicache.py --device cuda --model /tmp/smol --json $OUT/bench_hicache.json \
    > $OUT/bench_hicache.log 2>&1
  tail -c 1500 $OUT/bench_hicache.log
fi
step "done"
