#!/usr/bin/env bash
# The alignment check against PaddleDetection, one command (docs/alignment.md, "Against PaddleDetection"):
#
#     bash tools/align_paddle.sh PADDLE_PYTHON OUT [reference options] [-- gnetmdk overrides]
#
# PADDLE_PYTHON: the python of an environment with paddlepaddle and paddledet (docs/alignment.md says how
# to make one); OUT: a new folder. Runs PaddleDetection's ppyolo_r18vd for 10 SGD iterations on fixed
# cards batches (OUT/ref), converts its weights before and after, replays the same batches with this
# project from the converted starting weights (examples/ppyolo_align.py), prints the loss of every
# iteration beside Paddle's, and compares the weights after the last iteration with the PP-YOLO notes'
# rule (per tensor, sum of squared differences <= 0.0005).
#
# Reference options go to tools/paddle_reference.py (e.g. --lr 0.000404); words after "--" are config
# overrides of the gnetmdk replay (e.g. "-- nesterov true"): the negative controls of docs/alignment.md.
# The gnetmdk steps run with GNETMDK_PYTHON (default: python3 on PATH), which must import torch and
# gnetmdk.
# Exit status: 0 aligned; 1 not aligned; 2 a step could not run (its error is printed above).
set -u
if [ $# -lt 2 ]; then
    echo "usage: bash tools/align_paddle.sh PADDLE_PYTHON OUT [reference options] [-- gnetmdk overrides]" >&2
    exit 2
fi
PADDLE_PY=$1
OUT=$2
shift 2
REF_ARGS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    REF_ARGS+=("$1")
    shift
done
[ $# -gt 0 ] && shift          # the "--"
OVERRIDES=("$@")
PY=${GNETMDK_PYTHON:-python3}
cd "$(dirname "$0")/.." || exit 2
if ! "$PY" -c "import torch, gnetmdk" 2>/dev/null; then
    echo "error: '$PY' cannot import torch and gnetmdk: set GNETMDK_PYTHON to the python of the environment where gnetmdk is installed (pip install -e .)" >&2
    exit 2
fi
if ! "$PADDLE_PY" -c "import paddle, ppdet" 2>/dev/null; then
    echo "error: '$PADDLE_PY' cannot import paddle and ppdet: give the python of the Paddle environment (docs/alignment.md, 'Against PaddleDetection')" >&2
    exit 2
fi
CONFIG=examples/ppyolo_align.py
REF="$OUT/ref"
step() { echo "+ $*"; "$@" || { echo "error: the step above failed" >&2; exit 2; }; }
step "$PADDLE_PY" tools/paddle_reference.py --out "$REF" ${REF_ARGS[@]+"${REF_ARGS[@]}"}
step "$PY" tools/xml_2_txt.py --config "$CONFIG"
step "$PY" tools/convert_weights.py -f "$CONFIG" -c "$REF/before.pdparams" -oc "$REF/start.pth"
step "$PY" tools/convert_weights.py -f "$CONFIG" -c "$REF/after.pdparams" -oc "$REF/after.pth"
step "$PY" train.py --config "$CONFIG" --step 1 --replay-npz "$REF" --deterministic \
    checkpoint_root "$OUT/gnetmdk/checkpoint" log_root "$OUT/gnetmdk/log" ${OVERRIDES[@]+"${OVERRIDES[@]}"}
echo "+ $PY tools/diff_weights.py $REF/after.pth $OUT/gnetmdk/checkpoint/step1/last.pth --d-value 0.0005"
"$PY" tools/diff_weights.py "$REF/after.pth" "$OUT/gnetmdk/checkpoint/step1/last.pth" --d-value 0.0005
exit $?
