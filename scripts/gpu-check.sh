#!/usr/bin/env bash
# The GPU check, for a GPU host that reaches no package index (docs/gpu.md).
#   bash scripts/gpu-check.sh BUNDLE [--deadline S] [--kernels-s S] [--rows a,b] [--report FILE]
#       installs BUNDLE (scripts/gpu-bundle.sh made it: llama-cpp-python built for CUDA, the wheels the
#       host may lack, this project's wheel) into a site folder with no index, then runs the package
#       scripts/gpu_check (by path): one JSON report, rows in priority order, each measurement written as taken,
#       a row that does not fit the time left `skipped`, one the deadline reaches `cut` with what it
#       measured (default 480 s for every row but kernels, then --kernels-s). Exit 1 when a row failed.
#   bash scripts/gpu-check.sh --dry-run [--report FILE]
#       every row's code on this CPU at the tiny shapes, with the installed package (the test suite runs it).
#   bash scripts/gpu-check.sh --install-only BUNDLE
#       only the install step; prints the site folder (tests check it against a local bundle).
# The report goes to gpu-check-report.json in the current folder unless --report names another.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
report="$PWD/gpu-check-report.json"
install_only=0
args=()
if [ "${1:-}" = "--install-only" ]; then install_only=1; shift; fi
if [ "${1:-}" != "--dry-run" ] && [ $# -ge 1 ] && [ -d "$1" ]; then
  bundle="$(cd "$1" && pwd)"; shift
  site="${CLEF_GPU_SITE:-/tmp/clef-gguf-site}"
  mkdir -p "$site"
  # No index, no dependencies: what the bundle holds, beside what the host has (torch, numpy...).
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$bundle"/whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  # cuBLAS from the bundle's nvidia-cublas, the CUDA runtime from the host's torch wheel (nvidia/cu*/lib)
  cuda_libs="$(python3 -c 'import glob,site,sys
roots = [sys.argv[1], *site.getsitepackages()]
print(":".join(sorted({p.rsplit("/",1)[0] for s in roots for p in glob.glob(s+"/nvidia/*/lib/lib*.so.*")})))' "$site" || true)"
  export LD_LIBRARY_PATH="${cuda_libs:+$cuda_libs:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if [ -f "$bundle/BUILD.json" ]; then export CLEF_GPU_BUNDLE="$bundle/BUILD.json"; fi
  if [ "$install_only" = 1 ]; then echo "$site"; exit 0; fi
elif [ "${1:-}" = "--dry-run" ]; then
  args+=(--dry-run); shift
else
  echo "usage: bash scripts/gpu-check.sh BUNDLE [options] | --dry-run [options] | --install-only BUNDLE" >&2
  exit 2
fi
# The options left: a --report FILE is taken here, made absolute before the folder changes below.
rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --report) report="$(realpath -m "${2:?--report needs a FILE}")"; shift 2 ;;
    --report=*) report="$(realpath -m "${1#--report=}")"; shift ;;
    *) rest+=("$1"); shift ;;
  esac
done
# From a folder with no clef_gguf/ in it: `python -m` there imports the installed package, never the clone's.
# The package runs by path: its sys.path starts with scripts/, never the current folder.
cd "$(mktemp -d)"
exec python3 "$root/scripts/gpu_check" --report "$report" "${args[@]}" "${rest[@]}"
