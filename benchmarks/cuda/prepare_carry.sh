#!/bin/bash
# What benchmarks/cuda/cuda_checks.sh needs carried to a GPU machine, prepared here (a minute, no device time):
# .whl, wheels of the packages the GPU image lacks, for its Python 3.12, at the versions .venv holds; and
# .devcarry/tiny-llama, the tests' random tiny Llama with the default model's tokenizer. Both are ignored by git,
# so each device call names them: carry [".whl", ".devcarry"]. Run from the repo root after `make install`.
set -euo pipefail
PY=.venv/bin/python
NEEDED="gguf fastapi starlette pydantic pydantic_core annotated-types typing-inspection pyzmq uvicorn"
pins=$($PY -m pip freeze 2>/dev/null | grep -i -E "^($(echo $NEEDED | tr ' ' '|'))==")
rm -rf .whl && mkdir -p .whl
platforms=""
for n in 28 27 17; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
    --platform manylinux2014_x86_64 -d .whl $pins
ls .whl
rm -rf .devcarry/tiny-llama && mkdir -p .devcarry
$PY -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from conftest import build_tiny_model; \
print(build_tiny_model('llama', Path('.devcarry/tiny-llama')))"
du -sh .whl .devcarry
