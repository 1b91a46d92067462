#!/usr/bin/env bash
# GPU check, for the times a CUDA machine is lent (under 5 minutes on 16 cores before the speed part,
# which first builds a ~6 GB random 9B-shaped model: not yet run on a GPU, its time unmeasured):
# builds llama-cpp-python with CUDA in a scratch venv, then runs scripts/gpu_check.py, which
# decides on the tiny demo model on the GPU and on the CPU and reports max |dp| between them, and
# pick's speed probe on the GPU against a measured decision of a random 9B-shaped model (--speed);
# then the nvfp4 backend: its tests, and scripts/gpu_check_nvfp4.py (kernel in use, GPU vs CPU
# agreement, latency of a tiny and a 0.8B-shaped NVFP4 model). GPU_CHECK_SKIP_GGUF=1 runs only
# the nvfp4 part (no CUDA build of llama.cpp: a few minutes less).
# Usage: bash scripts/gpu-check.sh   (CUDA toolkit + driver present; CUDA_ARCH defaults to 90, Hopper)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${GPU_CHECK_VENV:-/tmp/clef-gguf-gpu-venv}"
python3 -m venv "$venv"
. "$venv/bin/activate"
# A CUDA torch: the nvfp4 backend runs on it (the GGUF path's head runs on the CPU either way).
pip install --quiet "torch==2.13.0" --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cu130}" \
  || pip install --quiet torch==2.13.0
if [ "${GPU_CHECK_SKIP_GGUF:-0}" != 1 ]; then
  CMAKE_ARGS="-DGGML_CUDA=on -DLLAVA_BUILD=OFF -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    pip install --quiet --no-cache-dir "llama-cpp-python==0.3.36"
fi
pip install --quiet -e ".[nvfp4]" pytest
status=0
if [ "${GPU_CHECK_SKIP_GGUF:-0}" != 1 ]; then
  python scripts/gpu_check.py --speed "$@" || status=1
fi
python -m pytest -q tests/nvfp4 tests/convert/test_nvfp4_convert.py || status=1
python scripts/gpu_check_nvfp4.py || status=1
exit "$status"
