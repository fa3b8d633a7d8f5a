#!/usr/bin/env bash
# One GPU training run of the project's agent model, a quick held-out eval
# through the engine (on the CPU), and the results packed to come back from
# the GPU machine (at most 8 files of at most 16 MB each):
#   OUT_DIR/model-0000k-of-0000n.safetensors   the bf16 weight shards (15 MB each at most)
#   OUT_DIR/meta.tar.gz                         config.json generation_config.json
#                                               model.safetensors.index.json tokenizer.json
#                                               tokenizer_config.json train_log.json loss.png eval.json
# Unpack into a model folder that our loader and transformers read:
#   mkdir -p M && cp OUT_DIR/model*.safetensors M/ && tar xzf OUT_DIR/meta.tar.gz -C M
#
#   bash profiling/train_gpu.sh OUT_DIR [extra default_model.train args]
#
# Budget (one command of at most 10 minutes on an H200): training MINUTES of
# wall time counted from its process start (the loop stops itself before
# that, evaluates, keeps the best export); `timeout` sends SIGINT 30 s after
# that (the script then stops at the next step) and SIGKILL 20 s later, which
# still leaves the best export written. The eval is capped at EVAL_LIMIT s of
# turns and killed at EVAL_TIMEOUT s. About 9 min in all.
# Environment overrides: MINUTES SHAPE DEVICE EVAL_SETS EVAL_LIMIT EVAL_TIMEOUT EVAL_THREADS PYTHON CKPT WORK.
# tests/test_agent_model.py runs this very script on the CPU with a tiny model (DEVICE=cpu SHAPE=tiny).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash profiling/train_gpu.sh OUT_DIR [train args...]}
shift
MINUTES=${MINUTES:-6.5}
SHAPE=${SHAPE:-agent-25m}
DEVICE=${DEVICE:-cuda}
EVAL_SETS=${EVAL_SETS:-task,alt}
EVAL_LIMIT=${EVAL_LIMIT:-60}
EVAL_TIMEOUT=${EVAL_TIMEOUT:-90}
EVAL_THREADS=${EVAL_THREADS:-8}
PY=${PYTHON:-$(command -v python3 || command -v python)}
WORK=${WORK:-${TMPDIR:-/tmp}/agentkv-train-$$}
CKPT=${CKPT:-$WORK.resume.pt}
MODEL=$WORK/model

mkdir -p "$OUT" "$MODEL"
# The code imports as agentkv: where this checkout is not installed (a bare
# device machine, no registry to build from), a link named agentkv to it on
# PYTHONPATH serves the same tree.
if ! "$PY" -c "import agentkv" 2>/dev/null; then
    LINK=$(mktemp -d)
    ln -s "$PWD" "$LINK/agentkv"
    export PYTHONPATH="$LINK${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline WANDB_SILENT=true
export WANDB_DIR=${WANDB_DIR:-${TMPDIR:-/tmp}/agentkv-wandb}
unset TRITON_INTERPRET AGENTKV_KERNELS
LIMIT=$("$PY" -c "print(int(float('$MINUTES') * 60 + 30))")

echo "== train: $SHAPE, $MINUTES min on $DEVICE -> $MODEL ($("$PY" --version 2>&1); $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
timeout -s INT -k 20 "$LIMIT" "$PY" -m agentkv.experiments.default_model.train --out "$MODEL" --minutes "$MINUTES" \
    --shape "$SHAPE" --device "$DEVICE" --ckpt "$CKPT" "$@"
rc=$?
echo "== train exit status $rc"
if ! ls "$MODEL"/model*.safetensors >/dev/null 2>&1; then
    echo "== no model was written"
    exit 1
fi

# The C++ kernels compile on a machine's first use: before the eval's timeout starts, not inside it.
"$PY" -c "from agentkv.kernels.dispatch import build_cpu_kernels; build_cpu_kernels()"
echo "== eval: sets $EVAL_SETS through the engine (CPU), at most ${EVAL_LIMIT}s of turns"
timeout -s INT -k 10 "$EVAL_TIMEOUT" "$PY" -m agentkv.experiments.default_model.eval --model "$MODEL" --sets "$EVAL_SETS" \
    --no-compare --reply-slack 24 --threads "$EVAL_THREADS" --time-limit "$EVAL_LIMIT" --out "$MODEL/eval.json"
echo "== eval exit status $?"

cp "$MODEL"/model*.safetensors "$OUT"/
meta=$(cd "$MODEL" && ls | grep -v '^model.*\.safetensors$')
tar czf "$OUT/meta.tar.gz" -C "$MODEL" $meta
ls -la "$OUT"
n=$(ls "$OUT" | wc -l)
big=$(find "$OUT" -type f -size +16000k | wc -l)
if [ "$n" -gt 8 ] || [ "$big" -gt 0 ]; then
    echo "== WARNING: $n files, $big over 16 MB: not all of it comes back"
fi
exit $rc
