#!/usr/bin/env bash
# One GPU check run (see profiling/gpu_check.py): kernel tests on CUDA, paged
# attention vs SDPA, kernel microbenchmarks. Usage: bash profiling/gpu_check.sh --out DIR
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET AGENTKV_KERNELS
PYTHONUNBUFFERED=1 exec python3 profiling/gpu_check.py "$@"
