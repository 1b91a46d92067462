#!/usr/bin/env bash
# Make the bundle scripts/gpu-check.sh installs on the offline GPU machine, here (PyPI reachable):
#   bash scripts/gpu-bundle.sh OUT [BASE]
# BASE: a bundle of llama-cpp-python built for CUDA (default ../shared/gpu-bundle, made by
# ../shared/tools/cuda-bundle.sh: ~32 min on 2 cores for sm_90; another for a build variant such as flash
# attention on or GGML_CUDA_FORCE_CUBLAS, named in BASE/VARIANT). Adds what the check needs that the GPU
# image (Python 3.12, torch 2.11+cu130) lacks, and this project's wheel (installed --no-deps). Put OUT in
# an ignored folder of the checkout and name it in the device tool's `carry` (64 MiB in all); never commit it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "$1" && cd "$1" && pwd)"
base="${2:-$root/../shared/gpu-bundle}"
cp -r "$base"/. "$out"/
chmod -R u+w "$out"
mkdir -p "$out/whl"
rm -f "$out"/whl/clef_gguf-*.whl
python3 -m pip wheel -q --no-deps -w "$out/whl" "$root"  # setuptools as pyproject pins it
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# serve and bench-server (fastapi imports annotated-doc and opentelemetry-api at load), at the versions
# the suite tested (requirements/test.txt); the speed probe's RAM probe is in the image (psutil);
# fla-core: the linear attention's Triton kernels for the nvfp4 backend (pure Python; its einops with it)
pinned() {  # NAME -> NAME==VERSION as requirements/test.txt pins it
  local line
  line="$(grep -i -m1 "^$1==" "$root/requirements/test.txt")" || { echo "gpu-bundle: $1 is not pinned in requirements/test.txt" >&2; exit 1; }
  echo "$line"
}
for p in fastapi starlette uvicorn h11 anyio sniffio click prometheus-client httpx httpcore certifi idna \
         annotated-doc opentelemetry-api filelock; do
  spec="$(pinned "$p")"
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/whl" "$spec"
done
for p in fla-core==0.6.0 einops==0.8.1; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/whl" "$p"
done
du -sh "$out"
