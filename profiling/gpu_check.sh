#!/usr/bin/env bash
# One GPU check run (see profiling/gpu_check.py): kernel tests on CUDA, paged
# attention vs SDPA, kernel microbenchmarks. Usage: bash profiling/gpu_check.sh --out DIR
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET AGENTKV_KERNELS
PY=$(command -v python3 || command -v python)
# The code imports as agentkv: where this checkout is not installed (a bare
# device machine, no registry to build from), a link named agentkv to it on
# PYTHONPATH serves the same tree.
if ! "$PY" -c "import agentkv" 2>/dev/null; then
    LINK=$(mktemp -d)
    ln -s "$PWD" "$LINK/agentkv"
    export PYTHONPATH="$LINK${PYTHONPATH:+:$PYTHONPATH}"
fi
PYTHONUNBUFFERED=1 exec "$PY" -m agentkv.profiling.gpu_check "$@"
