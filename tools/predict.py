#!/usr/bin/env python3
"""Detect objects with a checkpoint, a chip model or an exported ONNX model; draw them; write JSON.

    python3 tools/predict.py model/chip_model.json photo.jpg                 # integer emulator
    python3 tools/predict.py checkpoint/step4/best.pth ../shared/data/cards/JPEGImages --out runs/pred
    python3 tools/predict.py model/chip_model.onnx clip.mp4 --thresh 0.4     # onnxruntime, a video

MODEL: a checkpoint (.pth, any stage, evaluated with its stage switches), a chip model (.json or its
folder; --backend emulator|onnx) or an ONNX model (.onnx written by tools/convert_to_chip.py).
INPUT: an image, a folder of images, or a video file. Every image goes through the evaluation
preprocessing (gnetmdk.dataset.dataset.preprocess_image, then the chip's 5-bit codes); boxes are drawn
on the original image with class name and score. Writes into --out: the drawn images (same names),
for a video <stem>_pred.mp4, and detections.json (schema in docs/chip.md).
Exit status: 0 ok, 1 some images of a folder could not be read (skipped, listed), 2 a user error
(one line on stderr).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from gnetmdk.config.cli import Parser, at_least, fraction
from gnetmdk.engine.cli import tool_main


def parse_args(argv):
    """Parse the command line (see the module docstring); config overrides are returned separately where taken."""
    p = Parser(description=__doc__.split("\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("model", help="checkpoint .pth, chip model .json (or folder) or .onnx")
    p.add_argument("input", help="image, folder of images or video file")
    p.add_argument("--out", default="predictions", help="output folder (default ./predictions)")
    p.add_argument("--thresh", type=fraction(), default=None,
                   help="score threshold (conf x class score; default the model's predict_thresh)")
    p.add_argument("--nms", type=fraction(low_open=True), default=None,
                   help="NMS IoU threshold in (0, 1] (default the model's nms_thresh)")
    p.add_argument("--backend", choices=["emulator", "onnx"], default="emulator", help="for a chip model .json")
    p.add_argument("--batch-size", type=at_least(1), default=8)
    p.add_argument("--threads", type=int, default=0, help="torch / onnxruntime threads (0 = library default)")
    p.add_argument("--no-draw", action="store_true", help="only write detections.json")
    return p.parse_args(argv)


@tool_main
def main(argv) -> int:
    """Run the tool; returns the exit status (0 ok, 1 check failed where applicable, 2 user error)."""
    args = parse_args(argv)
    import cv2
    import numpy as np
    import torch
    from gnetmdk.utils.atomic import atomic_write_text
    from gnetmdk.dataset.dataset import preprocess_image
    from gnetmdk.dataset.image_io import ImageReadError, decode_image
    from gnetmdk.chip.predictor import (detection_records, draw_detections, iter_video, list_inputs,
                                            load_predictor)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    pred = load_predictor(args.model, args.backend, threads=args.threads or 1, batch_size=args.batch_size)
    kind, files = list_inputs(args.input)
    thresh = pred.predict_thresh if args.thresh is None else args.thresh
    nms = pred.nms_thresh if args.nms is None else args.nms
    from gnetmdk.checkpoint.outputs import check_output_folder
    check_output_folder(args.out, "the predictions", "--out")
    os.makedirs(args.out, exist_ok=True)
    results, skipped = [], []
    t0 = time.time()
    n_frames = 0
    size = pred.image_size
    if kind == "video":
        src = files[0]
        out_path = os.path.join(args.out, os.path.splitext(os.path.basename(src))[0] + "_pred.mp4")
        writer = None
        for first, frames, fps in iter_video(src, args.batch_size):
            h, w = frames[0].shape[:2]
            if writer is None and not args.no_draw:
                writer = cv2.VideoWriter(out_path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
                if not writer.isOpened():
                    raise ImageReadError(f"cannot write video '{out_path}' (mp4v): check --out")
            dets = pred.detect(np.stack([preprocess_image(f, size) for f in frames]),
                               [(f.shape[1], f.shape[0]) for f in frames], thresh, nms)
            for k, (f, d) in enumerate(zip(frames, dets)):
                if writer is not None:
                    writer.write(draw_detections(f, d, pred.class_names))
                results.append({"source": src, "frame": first + k, "width": f.shape[1], "height": f.shape[0],
                                "output": None if args.no_draw else out_path,
                                "detections": detection_records(d, pred.class_names)})
            n_frames += len(frames)
        if writer is not None:
            writer.release()
        if n_frames == 0:
            raise ImageReadError(f"video '{src}' has no readable frame")
    else:
        for start in range(0, len(files), args.batch_size):
            chunk, imgs = [], []
            for f in files[start:start + args.batch_size]:
                try:
                    imgs.append(decode_image(f, fix="replace it, or remove it from the input"))
                    chunk.append(f)
                except ImageReadError as exc:
                    if kind == "image":
                        raise
                    skipped.append({"source": f, "reason": str(exc)})     # the others go on
                    print(f"skipped: {exc}", file=sys.stderr, flush=True)
            if not chunk:
                continue
            dets = pred.detect(np.stack([preprocess_image(im, size) for im in imgs]),
                               [(im.shape[1], im.shape[0]) for im in imgs], thresh, nms)
            for f, im, d in zip(chunk, imgs, dets):
                out_path = None
                if not args.no_draw:
                    out_path = os.path.join(args.out, os.path.basename(f))
                    if not cv2.imwrite(out_path, draw_detections(im, d, pred.class_names)):
                        raise ImageReadError(f"cannot write '{out_path}': check --out")
                results.append({"source": f, "frame": None, "width": im.shape[1], "height": im.shape[0],
                                "output": out_path, "detections": detection_records(d, pred.class_names)})
            n_frames += len(chunk)
    doc = {"model": args.model, "model_kind": pred.kind, "backend": args.backend if pred.kind == "chip" else None,
           "classes": pred.class_names, "image_size": size, "score_thresh": thresh, "nms_thresh": nms,
           "box_format": "xyxy pixels of the original image", "results": results, "skipped": skipped}
    json_path = os.path.join(args.out, "detections.json")
    atomic_write_text(json_path, json.dumps(doc, indent=1) + "\n")
    n_det = sum(len(r["detections"]) for r in results)
    print(f"{pred.kind} model {args.model}: {n_frames} {'frames' if kind == 'video' else 'images'}, {n_det} detections "
          f"(score > {thresh:g}) in {time.time() - t0:.1f}s -> {args.out}/ and {json_path}")
    if skipped:
        print(f"error: {len(skipped)} of {len(files)} images could not be read and were skipped (listed above and "
              f"under 'skipped' in {json_path}): replace or remove them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
