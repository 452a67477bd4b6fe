#!/usr/bin/env bash
# The alignment check against PaddleDetection, one command (docs/alignment.md, "Against PaddleDetection"):
#
#     bash tools/align_paddle.sh PADDLE_PYTHON OUT [reference options]
#
# PADDLE_PYTHON: the python of an environment with paddlepaddle and paddledet (tools/paddle_reference.py
# says how to make one); OUT: a new folder. Runs PaddleDetection's ppyolo_r18vd for 10 SGD iterations
# on fixed cards batches (OUT/ref), converts its weights before and after, replays the same batches
# with this project from the converted starting weights (examples/ppyolo_align.py), prints the loss
# of every iteration beside Paddle's, and compares the weights after the last iteration with the PP-YOLO
# notes' rule (per tensor, sum of squared differences <= 0.0005).
# Exit status: 0 aligned; 1 not aligned; 2 a step could not run (its error is printed above).
set -u
if [ $# -lt 2 ]; then
    echo "usage: bash tools/align_paddle.sh PADDLE_PYTHON OUT [reference options]" >&2
    exit 2
fi
PADDLE_PY=$1
OUT=$2
shift 2
cd "$(dirname "$0")/.." || exit 2
CONFIG=examples/ppyolo_align.py
REF="$OUT/ref"
step() { echo "+ $*"; "$@" || { echo "error: the step above failed" >&2; exit 2; }; }
step "$PADDLE_PY" tools/paddle_reference.py --out "$REF" "$@"
step python3 tools/xml_2_txt.py --config "$CONFIG"
step python3 tools/convert_weights.py -f "$CONFIG" -c "$REF/before.pdparams" -oc "$REF/start.pth"
step python3 tools/convert_weights.py -f "$CONFIG" -c "$REF/after.pdparams" -oc "$REF/after.pth"
step python3 train.py --config "$CONFIG" --step 1 --replay-npz "$REF" --deterministic \
    checkpoint_root "$OUT/gnetmdk/checkpoint" log_root "$OUT/gnetmdk/log"
echo "+ python3 tools/diff_weights.py $REF/after.pth $OUT/gnetmdk/checkpoint/step1/last.pth --d-value 0.0005"
python3 tools/diff_weights.py "$REF/after.pth" "$OUT/gnetmdk/checkpoint/step1/last.pth" --d-value 0.0005
exit $?
