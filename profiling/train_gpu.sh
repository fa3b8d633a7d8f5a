#!/usr/bin/env bash
# One GPU training run of the project's agent model, then a quick held-out
# eval through the engine (on the CPU), all files flat in OUT_DIR:
#   config.json model.safetensors tokenizer.json tokenizer_config.json
#   generation_config.json train_log.json loss.png eval.json   (8 files, < 16 MB each)
#
#   bash profiling/train_gpu.sh OUT_DIR [extra train_agent_model args]
#
# Budget: training 6.5 min of wall time counted from its process start (the
# loop stops itself before that, then evaluates and saves); `timeout` sends
# SIGINT 45 s after that (the script then saves at the next step) and SIGKILL
# 20 s later, which still leaves the export written every minute. The eval is
# capped at EVAL_LIMIT s of turns and killed at EVAL_TIMEOUT s. About 8 min in all.
# Environment overrides: MINUTES DEVICE EVAL_TURNS EVAL_LIMIT EVAL_TIMEOUT EVAL_THREADS PYTHON CKPT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash profiling/train_gpu.sh OUT_DIR [train args...]}
shift
MINUTES=${MINUTES:-6.5}
DEVICE=${DEVICE:-cuda}
EVAL_TURNS=${EVAL_TURNS:-24}
EVAL_LIMIT=${EVAL_LIMIT:-45}
EVAL_TIMEOUT=${EVAL_TIMEOUT:-80}
EVAL_THREADS=${EVAL_THREADS:-4}
PY=${PYTHON:-$(command -v python3 || command -v python)}
CKPT=${CKPT:-${TMPDIR:-/tmp}/agentkv-train-$$.resume.pt}

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline WANDB_SILENT=true
export WANDB_DIR=${WANDB_DIR:-${TMPDIR:-/tmp}/agentkv-wandb}
unset TRITON_INTERPRET AGENTKV_KERNELS
LIMIT=$("$PY" -c "print(int(float('$MINUTES') * 60 + 45))")

echo "== train: $MINUTES min on $DEVICE -> $OUT ($("$PY" --version 2>&1); $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
timeout -s INT -k 20 "$LIMIT" "$PY" -m experiments.train_agent_model --out "$OUT" --minutes "$MINUTES" \
    --device "$DEVICE" --ckpt "$CKPT" "$@"
rc=$?
echo "== train exit status $rc"
if [ ! -f "$OUT/model.safetensors" ]; then
    echo "== no model was written"
    exit 1
fi

echo "== eval: $EVAL_TURNS held-out turns through the engine (CPU), at most ${EVAL_LIMIT}s"
timeout -s INT -k 10 "$EVAL_TIMEOUT" "$PY" -m experiments.eval_agent_model --model "$OUT" --turns "$EVAL_TURNS" \
    --threads "$EVAL_THREADS" --time-limit "$EVAL_LIMIT" --out "$OUT/eval.json"
erc=$?
echo "== eval exit status $erc"
ls -la "$OUT"
exit $rc
