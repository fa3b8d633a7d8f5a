#!/usr/bin/env bash
# llama.cpp through llama-cpp-python, in its own virtual environment
# (.venv-llamacpp/ at the repo root), for experiments.benchmarks.bench_turns'
# llamacpp-keep / llamacpp-reset peers. Optional: the benchmark skips them
# when this venv is absent.
#
# PyPI has only the source package of llama-cpp-python: this builds llama.cpp
# natively (CPU, GGML_NATIVE, no BLAS), a long compile on a small CPU. The venv
# sees the system site-packages (torch, numpy, transformers, safetensors),
# which the GGUF converter needs.
#
# GGUF conversion: the converter ships in the same source package
# (vendor/llama.cpp/convert_hf_to_gguf.py, with its gguf-py); this script
# unpacks it to .venv-llamacpp/src/llama.cpp. experiments/drivers/peers/llamacpp_driver.py
# converts a checkpoint on first use (DIR/model-<f32|f16|bf16>.gguf). Two
# snags, and the workaround (in the driver):
#   - the converter imports sentencepiece at the top even for BPE models:
#     installed here;
#   - it identifies a BPE tokenizer's pre-tokenizer by hashing how it splits
#     a test string, and rejects a hash it does not know (the project's own
#     BPE is unknown to it): the driver patches
#     TextModel.get_vocab_base_pre to answer "gpt-2" (byte-level, the same
#     family). The benchmark feeds llama.cpp token ids, so its tokenizer is
#     never used to split text and the choice cannot affect the timings.
#
#     bash experiments/drivers/peers/setup_llamacpp.sh [VERSION]
set -euo pipefail
cd "$(dirname "$0")/../../.."
VERSION="${1:-0.3.36}"
VENV=.venv-llamacpp
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
# The converter's source, from the same sdist pip builds.
SRC="$VENV/src"
mkdir -p "$SRC"
if [ ! -f "$SRC/llama.cpp/convert_hf_to_gguf.py" ]; then
  "$VENV/bin/python" -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$SRC"
  tar -xzf "$SRC"/llama_cpp_python-"$VERSION".tar.gz -C "$SRC"
  rm -rf "$SRC/llama.cpp"
  mv "$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC/llama.cpp"
fi
"$VENV/bin/python" -m pip install sentencepiece "gguf>=0.17" || "$VENV/bin/python" -m pip install sentencepiece
# The native build (verbose, so a long silence is visibly a compile).
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  "$VENV/bin/python" -m pip install --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
echo "ok: $VENV"
