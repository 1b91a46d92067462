#!/usr/bin/env bash
# Everything an offline GPU host needs for scripts/gpu-check.sh, made on a machine that reaches PyPI:
#   bash scripts/gpu-bundle.sh DIR [--cuda-arch 90] [--cmake-args "..."] [--llama-wheel FILE] [--python-version 3.12]
#                                  [--find-links D]
# DIR/whl gets:
#   - llama-cpp-python built for CUDA from PyPI's sdist (~30 min on 2 cores for one architecture), or the
#     prebuilt wheel --llama-wheel names. The build's nvcc: $CUDA_HOME/bin/nvcc (default /usr/local/cuda),
#     else the nvidia-cuda-nvcc wheel; cuBLAS: the nvidia-cublas wheel. CMake flags (docs/gpu.md):
#     -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES=<arch> -DLLAVA_BUILD=OFF, then --cmake-args
#     (e.g. "-DGGML_CUDA_FORCE_CUBLAS=ON");
#   - this project's wheel, and every wheel it needs (its dependencies and the nvfp4 extra, transitively,
#     less the image's torch and numpy: scripts/gpu_bundle_wheels.py) at the versions requirements/test.txt
#     pins, for the host's Python (--python-version, default 3.12); all install there with --no-deps;
#   - nvidia-cublas (the llama.cpp build's cuBLAS at run time, where the image's torch has another).
# DIR/BUILD.json says what was built and how. --find-links D: take the wheels from folder D, not PyPI.
set -euo pipefail
py="${PYTHON:-python3}"  # the Python whose pip builds and downloads
root="$(cd "$(dirname "$0")/.." && pwd)"
usage() { echo "usage: bash scripts/gpu-bundle.sh DIR [--cuda-arch N] [--cmake-args FLAGS] [--llama-wheel FILE] [--python-version X.Y] [--find-links DIR]" >&2; exit 2; }
[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || usage
out="$(mkdir -p "$1" && cd "$1" && pwd)"; shift
arch=90 llama_wheel="" pyver=3.12 links=() extra_cmake=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda-arch) arch="${2:?--cuda-arch needs a value such as 90}"; shift 2 ;;
    --cmake-args) extra_cmake="${2?--cmake-args needs FLAGS such as -DGGML_CUDA_FORCE_CUBLAS=ON}"; shift 2 ;;
    --llama-wheel) llama_wheel="$(realpath "${2:?--llama-wheel needs a FILE}")"; shift 2 ;;
    --python-version) pyver="${2:?--python-version needs X.Y}"; shift 2 ;;
    --find-links) links=(--no-index --find-links "$(realpath "${2:?--find-links needs a folder}")"); shift 2 ;;
    *) echo "gpu-bundle: unknown option $1" >&2; usage ;;
  esac
done
[[ "$arch" =~ ^[0-9]+[a-z]?(;[0-9]+[a-z]?)*$ ]] || { echo "gpu-bundle: --cuda-arch $arch is not a CUDA architecture list (90, 89;90)" >&2; exit 2; }
[[ "$pyver" =~ ^3\.[0-9]+$ ]] || { echo "gpu-bundle: --python-version $pyver is not X.Y" >&2; exit 2; }
if [ -n "$llama_wheel" ] && [ ! -f "$llama_wheel" ]; then echo "gpu-bundle: no file $llama_wheel" >&2; exit 2; fi
if [ -n "$llama_wheel" ] && [ -n "$extra_cmake" ]; then
  echo "gpu-bundle: --cmake-args applies to the CUDA build, not to a prebuilt --llama-wheel" >&2; exit 2
fi
for f in $extra_cmake; do
  [[ "$f" =~ ^-D[A-Za-z_][A-Za-z0-9_]*(:[A-Z]+)?=[^[:space:]]*$ ]] \
    || { echo "gpu-bundle: --cmake-args: $f is not a -DNAME=VALUE flag" >&2; exit 2; }
done
mkdir -p "$out/whl"
rm -f "$out"/whl/*.whl
CUBLAS="nvidia-cublas==13.0.0.19"
# Assignments: a package with no pin stops the script here (set -e), naming it, before anything is built.
llama="$("$py" "$root/scripts/gpu_bundle_wheels.py" --pin llama-cpp-python)"
wheels="$("$py" "$root/scripts/gpu_bundle_wheels.py")"
flags="-DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES=$arch -DLLAVA_BUILD=OFF${extra_cmake:+ $extra_cmake}"
if [ -n "$llama_wheel" ]; then
  cp "$llama_wheel" "$out/whl/"
  built="prebuilt: $(basename "$llama_wheel")"
else
  tools="$(mktemp -d)"; trap 'rm -rf "$tools"' EXIT
  cuda="${CUDA_HOME:-/usr/local/cuda}"
  if [ ! -x "$cuda/bin/nvcc" ]; then  # the compiler from PyPI: the nvidia-cuda-nvcc wheel
    "$py" -m pip install -q "${links[@]}" --target "$tools/nvcc" "nvidia-cuda-nvcc==13.0.*"
    cuda="$(dirname "$(dirname "$(find "$tools/nvcc" -name nvcc -type f | head -1)")")"
  fi
  "$py" -m pip install -q "${links[@]}" --target "$tools/cublas" "$CUBLAS"
  cublas="$(dirname "$(find "$tools/cublas" -name 'libcublas.so*' | head -1)")"
  echo "gpu-bundle: compiling $llama for CUDA sm_$arch with $cuda/bin/nvcc (about 30 min on 2 cores)" >&2
  CUDACXX="$cuda/bin/nvcc" CUDA_HOME="$cuda" LIBRARY_PATH="$cublas${LIBRARY_PATH:+:$LIBRARY_PATH}" \
    CPATH="$cublas/../include${CPATH:+:$CPATH}" CMAKE_ARGS="$flags -DCUDAToolkit_ROOT=$cuda" FORCE_CMAKE=1 \
    "$py" -m pip wheel -q "${links[@]}" --no-deps --no-binary llama-cpp-python -w "$out/whl" "$llama"
  built="compiled by gpu-bundle.sh: CMAKE_ARGS=$flags, nvcc $("$cuda/bin/nvcc" --version | tail -1)"
fi
isolation=()  # with no index, the build backend comes from this Python, not a download
if [ ${#links[@]} -gt 0 ]; then isolation=(--no-build-isolation); fi
"$py" -m pip wheel -q "${links[@]}" "${isolation[@]}" --no-deps -w "$out/whl" "$root"
major="${pyver%%.*}" minor="${pyver#*.}"
plat=(--only-binary=:all: --python-version "$pyver" --implementation cp --abi "cp$major$minor" --abi abi3 --abi none
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mapfile -t specs <<<"$wheels"
"$py" -m pip download -q "${links[@]}" --no-deps "${plat[@]}" -d "$out/whl" "${specs[@]}" "$CUBLAS"
"$py" - "$out" "$arch" "$pyver" "$built" <<'EOF'
import json, pathlib, sys
out, arch, pyver, built = sys.argv[1:]
wheels = sorted(p.name for p in (pathlib.Path(out) / "whl").glob("*.whl"))
(pathlib.Path(out) / "BUILD.json").write_text(json.dumps(
    {"cuda_arch": arch, "python": pyver, "llama_cpp": built, "wheels": wheels}, indent=1) + "\n")
EOF
du -sh "$out"
