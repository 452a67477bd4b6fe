"""One interface over a checkpoint, a chip model (integer emulator) and an exported ONNX model:
8-bit images in, GNetDet predictions / detections out; plus drawing and the input walkers of
tools/predict.py.

Every kind sees the same input: ``preprocess_image`` (the evaluation resize) of the decoded BGR
image, turned into the chip's 5-bit codes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import cv2
import numpy as np
import torch

from gnetmdk.gti.quantize import image_to_codes
from gnetmdk.models.gnetdet.decode import decode_gnetdet
from gnetmdk.models.gnetdet.head import output_head
from gnetmdk.evaluation.draw import draw_detections  # noqa: F401 (its earlier home)
from .model_file import ChipModelError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".mkv", ".m4v", ".mpg", ".mpeg", ".wmv", ".webm")


@dataclass
class Predictor:
    """A loaded model of any kind.

    Attributes:
        kind: "checkpoint", "chip" (integer emulator) or "onnx" (onnxruntime).
        path: where it was loaded from.
        class_names: C names.
        image_size: network input side (pixels).
        conf_thresh, nms_thresh, max_detections, predict_thresh: decode settings stored with the model.
        score_head, score_offset, score_scale: the model's score head (gnetmdk.models.gnetdet.head.output_scores).
        size_head, size_min: the model's size head (gnetmdk.models.gnetdet.head.output_sizes).
    """
    kind: str
    path: str
    class_names: List[str]
    image_size: int
    conf_thresh: float
    nms_thresh: float
    max_detections: int
    predict_thresh: float
    _fn: object = None
    score_head: str = "linear"
    score_offset: float = 4.0
    score_scale: float = 1.0
    size_head: str = "linear"
    size_min: float = 1.0 / 64

    @property
    def num_classes(self) -> int:
        """C, the number of classes."""
        return len(self.class_names)

    def predictions(self, images: np.ndarray) -> torch.Tensor:
        """(N, S, S, 3) uint8 BGR network-size images -> (N, S, S, 10 + C) float32 predictions (host scale)."""
        return self._fn(np.ascontiguousarray(images, dtype=np.uint8))

    def detect(self, images: np.ndarray, sizes: Sequence[Tuple[int, int]], conf_thresh: float, nms_thresh: float,
               max_detections: Optional[int] = None) -> List[Dict[str, torch.Tensor]]:
        """Detections in original-image pixels.

        Args:
            images: (N, S, S, 3) uint8 BGR network-size images.
            sizes: N (width, height) of the original images.
        Returns:
            N dicts: "boxes" (K, 4) float32 xyxy pixels, "scores" (K,), "labels" (K,) int64.
        """
        pred = self.predictions(images)
        out = decode_gnetdet(pred, self.num_classes, conf_thresh, nms_thresh,
                             self.max_detections if max_detections is None else max_detections, **output_head(self))
        res = []
        for d, (w, h) in zip(out, sizes):
            scale = torch.tensor([w, h, w, h], dtype=torch.float32)
            res.append({"boxes": d["boxes"] * scale, "scores": d["scores"], "labels": d["labels"]})
        return res


def load_predictor(path: str, backend: str = "emulator", threads: int = 1, batch_size: int = 16) -> Predictor:
    """Load a checkpoint (.pth), a chip model (.json, or a folder with chip_model.json) or an ONNX model (.onnx).

    Args:
        backend: for a chip model: "emulator" (default) or "onnx" (export in memory, run onnxruntime).
    Raises:
        CheckpointError / ChipModelError: missing or unreadable model, unknown extension.
    """
    from gnetmdk.config.base import BaseConfig
    low = path.lower()
    if low.endswith((".pth", ".pt")):
        from types import SimpleNamespace
        from .cli_util import eval_device, load_eval_model
        model, ckpt = load_eval_model(path)
        cfg = dict(ckpt.get("config") or {})
        # the device the checkpoint's config allows (auto / cuda: the GPU when there is one)
        device = eval_device(SimpleNamespace(device=cfg.get("device", "auto"), tf32=cfg.get("tf32", False)))
        model.to(device)
        names = list(cfg.get("VOC_CLASSES") or [])
        if len(names) != model.num_classes:
            names = [f"class{i}" for i in range(model.num_classes)]

        @torch.no_grad()
        def fn(images):
            x = image_to_codes(torch.from_numpy(images)).permute(0, 3, 1, 2).float().to(device)
            return model(x).float().cpu()
        return Predictor("checkpoint", path, names, model.image_size, float(cfg.get("conf_thresh", BaseConfig.conf_thresh)),
                         float(cfg.get("nms_thresh", BaseConfig.nms_thresh)),
                         int(cfg.get("max_detections", BaseConfig.max_detections)),
                         float(cfg.get("predict_thresh", BaseConfig.predict_thresh)), fn,
                         model.score_head, model.score_offset, model.score_scale, model.size_head, model.size_min)
    if low.endswith(".onnx"):
        from .onnx_export import OnnxChipRunner, onnx_header
        head = onnx_header(path)
        with open(path, "rb") as fh:
            runner = OnnxChipRunner(fh.read(), threads=threads)
        dec = head["decode"]
        return Predictor("onnx", path, list(head["classes"]), int(head["input"]["height"]), float(dec["conf_thresh"]),
                         float(dec["nms_thresh"]), int(dec["max_detections"]), float(dec.get("predict_thresh", 0.3)),
                         lambda images: torch.from_numpy(runner.predictions(images)),
                         str(dec.get("score_head", "linear")), float(dec.get("score_offset", 4.0)),
                         float(dec.get("score_scale", 1.0)), str(dec.get("size_head", "linear")),
                         float(dec.get("size_min", 1.0 / 64)))
    if low.endswith(".json") or os.path.isdir(path):
        from .emulator import ChipEmulator
        from .host import codes_to_predictions
        from .model_file import load_chip_model
        cm = load_chip_model(path)
        if backend == "onnx":
            from .onnx_export import OnnxChipRunner
            runner = OnnxChipRunner(cm, threads=threads)
        elif backend == "emulator":
            runner = ChipEmulator(cm, batch_size=batch_size)
        else:
            raise ChipModelError(f"unknown backend '{backend}': use emulator or onnx")
        return Predictor("chip", path, list(cm.class_names), cm.input_size, cm.conf_thresh, cm.nms_thresh,
                         cm.max_detections, cm.predict_thresh, lambda images: codes_to_predictions(runner(images), cm),
                         cm.score_head, cm.score_offset, cm.score_scale, cm.size_head, cm.size_min)
    raise ChipModelError(f"model '{path}': unknown kind; give a checkpoint (.pth), a chip model (.json or its "
                         "folder) or an ONNX model (.onnx)")


# ------------------------------------------------------------------ inputs
def list_inputs(path: str) -> Tuple[str, List[str]]:
    """Classify an input: ("image", [file]), ("folder", [image files, sorted]) or ("video", [file]).

    Raises:
        FileNotFoundError: the path does not exist, or a folder holds no image.
        ChipModelError: a file with an extension that is neither an image nor a video.
    """
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.lower().endswith(IMAGE_EXTENSIONS) and os.path.isfile(os.path.join(path, f)))
        if not files:
            raise FileNotFoundError(f"folder '{path}' holds no image ({', '.join(IMAGE_EXTENSIONS)})")
        return "folder", files
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input '{path}' does not exist: give an image, a folder of images or a video file")
    low = path.lower()
    if low.endswith(VIDEO_EXTENSIONS):
        return "video", [path]
    if low.endswith(IMAGE_EXTENSIONS):
        return "image", [path]
    raise ChipModelError(f"input '{path}': unknown extension; images: {', '.join(IMAGE_EXTENSIONS)}; videos: "
                         f"{', '.join(VIDEO_EXTENSIONS)}")


def iter_video(path: str, batch_size: int = 8) -> Iterator[Tuple[int, List[np.ndarray], float]]:
    """Yield (first frame index, frames (BGR uint8), fps) in batches.

    Raises:
        ImageReadError: the video cannot be opened.
    """
    from gnetmdk.dataset.image_io import ImageReadError
    cap = cv2.VideoCapture(path)
    if not cap.isOpened():
        raise ImageReadError(f"video '{path}' could not be opened by opencv: convert it to mp4 (H.264/mp4v) or avi")
    fps = cap.get(cv2.CAP_PROP_FPS) or 25.0
    idx = 0
    try:
        while True:
            frames = []
            for _ in range(batch_size):
                ok, frame = cap.read()
                if not ok:
                    break
                frames.append(frame)
            if not frames:
                break
            yield idx, frames, fps
            idx += len(frames)
    finally:
        cap.release()


# ------------------------------------------------------------------ records
def detection_records(det: Dict[str, torch.Tensor], class_names: Sequence[str]) -> List[Dict[str, object]]:
    """JSON-ready detections: [{"class", "label", "score", "box": [x1, y1, x2, y2] pixels}], best first."""
    return [{"class": class_names[int(l)], "label": int(l), "score": round(float(s), 6),
             "box": [round(float(v), 2) for v in b]}
            for b, s, l in zip(det["boxes"].tolist(), det["scores"].tolist(), det["labels"].tolist())]
