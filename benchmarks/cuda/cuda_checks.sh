#!/bin/bash
# Kiln's CUDA checks, one run: the CUDA tests, a default-settings capture, the graph benchmark.
# Run from the repo root on a GPU machine with $OUT set; .whl holds wheels of the packages its image lacks
# (gguf, fastapi, starlette, pydantic, pydantic-core, annotated-types, typing-inspection, pyzmq, uvicorn) and
# .devcarry/tiny-llama a model built by tests/conftest.py::build_tiny_model (the default model stays behind).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD KILN_TINY_LLAMA=$PWD/.devcarry/tiny-llama
python3 -c "import torch,transformers;print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
echo "=== CUDA tests"; date
timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_graphs.py tests/test_allocator.py -rA -s 2>&1 | tail -c 20000 > $OUT/cuda_tests.log
tail -c 3000 $OUT/cuda_tests.log
echo "=== Triton attention and fused kernels compiled for the GPU (the CPU runs them in Triton's interpreter); the device sampler"; date
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_triton_fused.py tests/test_device_sampler.py -rA 2>&1 | tail -c 8000 > $OUT/triton_tests.log
tail -c 2000 $OUT/triton_tests.log
echo "=== random SmolLM2-shape model"; date
timeout 40 python3 benchmarks/cuda/make_random_smollm.py /tmp/smol .devcarry/tiny-llama 2>&1 | tail -2
echo "=== default capture"; date
timeout 90 python3 benchmarks/cuda/default_capture.py /tmp/smol $OUT/default_capture.json > $OUT/default_capture.log 2>&1
grep -v "Capturing" $OUT/default_capture.log | tail -30
echo "=== bench_graphs"; date
cd benchmarks && timeout 150 python3 bench_graphs.py --device cuda --model-path /tmp/smol --bs 1 8 32 --prefill 128 512 --reps 3 --json $OUT/bench_graphs_cuda.json > $OUT/bench_graphs_cuda.log 2>&1
tail -30 $OUT/bench_graphs_cuda.log
echo "=== overlap schedule against the plain one"; date
timeout 150 python3 bench_overlap.py --device cuda --model-path /tmp/smol --cuda-graph-bs 1 32 --bs 1 32 --max-new-tokens 64 --reps 2 > $OUT/bench_overlap_cuda.log 2>&1
tail -6 $OUT/bench_overlap_cuda.log
echo "=== 8B-class model against the GPU's limits, --attention-backend triton"; date
cd .. && timeout 420 python3 benchmarks/cuda/bench_8b.py --tokenizer .devcarry/tiny-llama --attention-backend triton --json $OUT/bench_8b_triton.json > $OUT/bench_8b_triton.log 2>&1
grep -v "Capturing" $OUT/bench_8b_triton.log | tail -50
date
