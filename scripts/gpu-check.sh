#!/usr/bin/env bash
# GPU check, for the times a CUDA machine is lent (under 5 minutes on 16 cores):
# builds llama-cpp-python with CUDA in a scratch venv, then runs scripts/gpu_check.py, which
# decides on the tiny demo model on the GPU and on the CPU and reports max |dp| between them.
# Usage: bash scripts/gpu-check.sh   (CUDA toolkit + driver present; CUDA_ARCH defaults to 90, Hopper)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${GPU_CHECK_VENV:-/tmp/clef-gguf-gpu-venv}"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install --quiet torch==2.13.0 || pip install --quiet torch  # the head runs on the CPU either way
CMAKE_ARGS="-DGGML_CUDA=on -DLLAVA_BUILD=OFF -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}" \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  pip install --quiet --no-cache-dir "llama-cpp-python==0.3.36"
pip install --quiet -e .
python scripts/gpu_check.py "$@"
