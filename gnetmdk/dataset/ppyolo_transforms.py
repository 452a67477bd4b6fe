"""PP-YOLO training augmentations as pure numpy / OpenCV functions.

Behaviour follows PaddleDetection's PP-YOLO train reader (``configs/ppyolo/_base_/ppyolo_reader.yml``:
per sample ``Mixup -> RandomDistort -> RandomExpand -> RandomCrop -> RandomFlip``, per batch
``BatchRandomResize`` to one of 320..608 (step 32) with a random interpolation and
``keep_ratio: False``, then ``NormalizeBox`` and ``PadBox``), operators in
``ppdet/data/transform/operators.py`` and ``batch_operators.py``. This is an independent
implementation; departures are listed per function and summarised here:

* Every random draw comes from an explicit ``np.random.Generator`` (no global state), and the
  per-batch size and interpolation come from :func:`draw_batch_size` / :func:`draw_interp`, pure
  functions of ``(seed, epoch, batch_index)``, so every data-parallel process and a replay agree.
* Images stay uint8 between steps (PaddleDetection carries unclipped float32 after RandomDistort):
  colour distortion is computed in float32 and clipped/rounded to ``[0, 255]`` once at its end,
  Mixup rounds instead of truncating, RandomExpand fills with the ImageNet mean rounded to whole
  levels ``(124, 116, 104)``.
* RandomDistort's hue angle is in degrees. PaddleDetection multiplies the degree value by pi
  (``cos(delta * pi)``), which for ``delta`` uniform in ``[-18, 18]`` is a rotation uniform over the
  whole circle; pass ``hue=(-180, 180, 0.5)`` to reproduce that distribution exactly.
* Probabilities mean "probability of applying" everywhere (PaddleDetection's RandomDistort and
  RandomExpand store the probability of *skipping*; with the defaults, 0.5, they are the same).
* RandomCrop places a crop anywhere including flush with the bottom/right edge (PaddleDetection's
  ``randint(0, h - crop_h)`` excludes that last offset and fails when ``crop_h == h``).

Conventions: images uint8 RGB ``(H, W, 3)``; boxes float32 ``(K, 4)`` pixel ``x1 y1 x2 y2`` on
continuous coordinates (a box ``[x1, x2)`` covers pixel columns ``x1 .. x2 - 1`` when whole); labels
int64 ``(K,)``; scores float32 ``(K,)``, 1.0 except after Mixup. Functions never modify their
inputs. Bad input raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Mapping, Sequence

import cv2
import numpy as np

__all__ = [
    "PPYOLO_SIZES",
    "PPYOLO_INTERPS",
    "IMAGENET_MEAN_PIXELS",
    "mixup",
    "random_distort",
    "random_expand",
    "random_crop",
    "random_flip",
    "resize_to",
    "draw_batch_size",
    "draw_interp",
    "ppyolo_train_sample",
    "pad_targets",
]

#: BatchRandomResize target sizes of the PP-YOLO reader (pixels, square)
PPYOLO_SIZES = tuple(range(320, 608 + 1, 32))
#: interpolations BatchRandomResize draws from when ``random_interp`` is on (OpenCV flags)
PPYOLO_INTERPS = (cv2.INTER_NEAREST, cv2.INTER_LINEAR, cv2.INTER_AREA, cv2.INTER_CUBIC,
                  cv2.INTER_LANCZOS4)
#: ImageNet mean (0.485, 0.456, 0.406) * 255, RGB, the PP-YOLO RandomExpand fill
IMAGENET_MEAN_PIXELS = (123.675, 116.28, 103.53)

# RGB -> YIQ (FCC NTSC coefficients); the inverse is computed, so a 0 or 360 degree hue rotation
# is an identity up to float rounding and grey pixels (I = Q = 0) never change
_RGB2YIQ = np.array([[0.299, 0.587, 0.114],
                     [0.5959, -0.2746, -0.3213],
                     [0.2115, -0.5227, 0.3112]], dtype=np.float64)
_YIQ2RGB = np.linalg.inv(_RGB2YIQ)
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------

def _check_image(img: Any, name: str = "img") -> np.ndarray:
    if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
        desc = (f"{img.dtype} {img.shape}" if isinstance(img, np.ndarray) else type(img).__name__)
        raise ValueError(f"{name} must be a uint8 RGB array (H, W, 3), got {desc}; decode with "
                         f"cv2.imread then cv2.cvtColor(..., cv2.COLOR_BGR2RGB)")
    if img.shape[0] < 1 or img.shape[1] < 1:
        raise ValueError(f"{name} is empty: shape {img.shape}")
    return img


def _check_boxes(boxes: Any, name: str = "boxes") -> np.ndarray:
    b = np.asarray(boxes, dtype=np.float32)
    if b.size == 0:
        return b.reshape(0, 4).copy()
    if b.ndim != 2 or b.shape[1] != 4:
        raise ValueError(f"{name} must have shape (K, 4) pixel x1 y1 x2 y2, got {b.shape}")
    if not np.all(np.isfinite(b)):
        raise ValueError(f"{name} has non-finite coordinates: {b.tolist()}")
    return b.copy()


def _check_vector(v: Any, n: int, name: str, dtype) -> np.ndarray:
    a = np.asarray(v)
    if a.size == 0 and n == 0:
        return a.reshape(0).astype(dtype)
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) to match the boxes, got {a.shape}")
    return a.astype(dtype, copy=True)


def _unpack(sample: Mapping[str, Any], name: str):
    if not isinstance(sample, Mapping):
        raise ValueError(f"{name} must be a dict with 'image', 'boxes', 'labels' (and optional "
                         f"'scores'), got {type(sample).__name__}")
    for key in ("image", "boxes", "labels"):
        if key not in sample:
            raise ValueError(f"{name} is missing key {key!r}")
    img = _check_image(sample["image"], f"{name}['image']")
    boxes = _check_boxes(sample["boxes"], f"{name}['boxes']")
    labels = _check_vector(sample["labels"], len(boxes), f"{name}['labels']", np.int64)
    scores = sample.get("scores")
    scores = (np.ones(len(boxes), np.float32) if scores is None
              else _check_vector(scores, len(boxes), f"{name}['scores']", np.float32))
    return img, boxes, labels, scores


def _check_prob(p: float, name: str) -> float:
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
    return p


# ----------------------------------------------------------------------------------------------
# per-sample transforms
# ----------------------------------------------------------------------------------------------

def mixup(a: Mapping[str, Any], b: Mapping[str, Any], rng: np.random.Generator,
          alpha: float = 1.5, beta: float = 1.5) -> dict:
    """Overlay two samples with a Beta-distributed weight (Mixup for detection).

    Zhang et al., "mixup: Beyond Empirical Risk Minimization" (2018), as used for detection by
    Zhang et al., "Bag of Freebies for Training Object Detection Neural Networks" (2019) and
    PaddleDetection's ``Mixup`` operator: ``f ~ Beta(alpha, beta)``; the canvas is
    ``max(Ha, Hb) x max(Wa, Wb)``, both images placed at its top-left corner,
    ``canvas = round(f * a + (1 - f) * b)`` (a pixel covered by one image only gets that image's
    weighted value, the other contributing 0, as in PaddleDetection). Boxes keep their pixel
    coordinates and are concatenated ``[a's, b's]``; labels likewise; scores are
    ``[f * a.scores, (1 - f) * b.scores]`` (each box's score is its image's weight, so for fresh
    samples with scores 1 a box of ``a`` and a box of ``b`` sum to 1). ``f`` is 1 or 0 only with
    probability 0; then the sample with weight 1 is returned (copied, scores as given).

    Args:
        a, b: dicts with ``"image"`` uint8 RGB ``(H, W, 3)``, ``"boxes"`` float32 ``(K, 4)`` pixel
            xyxy, ``"labels"`` int64 ``(K,)``, optional ``"scores"`` float32 ``(K,)`` (default 1).
        rng: the random generator (one ``beta`` draw).
        alpha, beta: Beta distribution parameters, both > 0 (PP-YOLO: 1.5, 1.5).

    Returns:
        dict with ``"image"`` uint8 ``(max H, max W, 3)``, ``"boxes"`` float32 ``(Ka + Kb, 4)``,
        ``"labels"`` int64, ``"scores"`` float32 and ``"mixup_factor"`` (float ``f``, the weight of
        ``a``).

    Raises:
        ValueError: ``alpha`` or ``beta`` not > 0, or a malformed sample.
    """
    if not (alpha > 0 and beta > 0):
        raise ValueError(f"mixup alpha and beta must be > 0, got alpha={alpha}, beta={beta}")
    ia, ba, la, sa = _unpack(a, "a")
    ib, bb, lb, sb = _unpack(b, "b")
    f = float(np.clip(rng.beta(alpha, beta), 0.0, 1.0))
    if f >= 1.0:
        return {"image": ia.copy(), "boxes": ba, "labels": la, "scores": sa, "mixup_factor": 1.0}
    if f <= 0.0:
        return {"image": ib.copy(), "boxes": bb, "labels": lb, "scores": sb, "mixup_factor": 0.0}
    h = max(ia.shape[0], ib.shape[0])
    w = max(ia.shape[1], ib.shape[1])
    canvas = np.zeros((h, w, 3), np.float32)
    canvas[:ia.shape[0], :ia.shape[1]] = ia.astype(np.float32) * f
    canvas[:ib.shape[0], :ib.shape[1]] += ib.astype(np.float32) * (1.0 - f)
    image = np.clip(np.rint(canvas), 0, 255).astype(np.uint8)
    return {
        "image": image,
        "boxes": np.concatenate([ba, bb]).reshape(-1, 4).astype(np.float32),
        "labels": np.concatenate([la, lb]).astype(np.int64),
        "scores": np.concatenate([sa * np.float32(f), sb * np.float32(1.0 - f)]).astype(np.float32),
        "mixup_factor": f,
    }


def _hue(img: np.ndarray, degrees: float) -> np.ndarray:
    """Rotate the chroma (I, Q) plane of YIQ by ``degrees``; float32 in and out."""
    t = math.radians(degrees)
    c, s = math.cos(t), math.sin(t)
    rot = np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])
    m = (_YIQ2RGB @ rot @ _RGB2YIQ).T.astype(np.float32)
    return img @ m


def _saturation(img: np.ndarray, factor: float) -> np.ndarray:
    gray = (img @ _LUMA)[..., None]
    return img * np.float32(factor) + gray * np.float32(1.0 - factor)


def random_distort(img: np.ndarray, rng: np.random.Generator,
                   hue: Sequence[float] = (-18.0, 18.0, 0.5),
                   saturation: Sequence[float] = (0.5, 1.5, 0.5),
                   contrast: Sequence[float] = (0.5, 1.5, 0.5),
                   brightness: Sequence[float] = (0.5, 1.5, 0.5)) -> np.ndarray:
    """Colour distortion: four operations in a random order, each applied with its probability.

    PaddleDetection ``RandomDistort`` with ``random_apply=True, count=4`` (its defaults, those of the
    PP-YOLO reader). Each argument is ``(low, high, prob)``; the order is a uniform permutation of
    (brightness, contrast, saturation, hue), then for each: with probability ``prob`` draw
    ``delta ~ U(low, high)`` and apply, in float32:

    * hue: rotate the chroma plane of YIQ by ``delta`` **degrees** (grey pixels are unchanged);
      PaddleDetection's ``delta * pi`` radians is reproduced by ``hue=(-180, 180, 0.5)``;
    * saturation: ``x * delta + luma * (1 - delta)``, luma ``0.299 R + 0.587 G + 0.114 B``;
    * contrast: ``x * delta`` (PaddleDetection's definition: a gain about 0, not about the mean);
    * brightness: ``x + delta`` in pixel levels (PaddleDetection's default ``0.5..1.5`` levels is
      nearly invisible; kept for fidelity).

    The result is clipped to ``[0, 255]`` and rounded to uint8 once at the end.

    Args:
        img: uint8 RGB ``(H, W, 3)``.
        rng: random generator (one permutation, one uniform per operation, one more per applied
            operation).
        hue, saturation, contrast, brightness: ``(low, high, prob)``, ``prob`` in ``[0, 1]`` is the
            probability of applying (PaddleDetection's third value is the probability of
            skipping; equal at 0.5).

    Returns:
        uint8 RGB ``(H, W, 3)``, a new array.

    Raises:
        ValueError: ``img`` not uint8 ``(H, W, 3)``, a setting not three numbers with
            ``low <= high`` and ``prob`` in ``[0, 1]``.
    """
    _check_image(img)
    ops = []
    for name, setting in (("brightness", brightness), ("contrast", contrast),
                          ("saturation", saturation), ("hue", hue)):
        try:
            low, high, prob = (float(v) for v in setting)
        except (TypeError, ValueError):
            raise ValueError(f"random_distort {name} must be (low, high, prob), got {setting!r}") from None
        if not low <= high:
            raise ValueError(f"random_distort {name}: low {low} > high {high}")
        ops.append((name, low, high, _check_prob(prob, f"random_distort {name} prob")))
    out = None
    for k in rng.permutation(len(ops)):
        name, low, high, prob = ops[int(k)]
        if rng.uniform() >= prob:
            continue
        delta = float(rng.uniform(low, high))
        if out is None:
            out = img.astype(np.float32)
        if name == "brightness":
            out += np.float32(delta)
        elif name == "contrast":
            out *= np.float32(delta)
        elif name == "saturation":
            out = _saturation(out, delta)
        else:
            out = _hue(out, delta)
    if out is None:
        return img.copy()
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def random_expand(img: np.ndarray, boxes: np.ndarray, rng: np.random.Generator, ratio: float = 4.0,
                  prob: float = 0.5, fill: Sequence[float] = IMAGENET_MEAN_PIXELS):
    """Place the image on a larger canvas filled with ``fill`` (zoom-out), SSD style.

    PaddleDetection ``RandomExpand``: with probability ``prob``, ``r ~ U(1, ratio)``, canvas
    ``int(H * r) x int(W * r)``; if it is not larger in both sides nothing happens; else the image
    goes at offset ``x ~ U{0 .. Wc - W - 1}``, ``y ~ U{0 .. Hc - H - 1}`` (integers) and boxes move
    by ``(x, y)``. Departure: the canvas is uint8, so ``fill`` is rounded to whole levels.

    Args:
        img: uint8 RGB ``(H, W, 3)``.
        boxes: float ``(K, 4)`` pixel xyxy.
        rng: random generator.
        ratio: largest expansion factor, > 1.01 (PaddleDetection's check).
        prob: probability of expanding.
        fill: RGB fill (PP-YOLO: the ImageNet mean in pixels, 123.675, 116.28, 103.53).

    Returns:
        ``(image uint8 (Hc, Wc, 3), boxes float32 (K, 4))``, new arrays.

    Raises:
        ValueError: ``ratio <= 1.01``, ``prob`` outside ``[0, 1]``, ``fill`` not 3 values in
            ``[0, 255]``, malformed image or boxes.
    """
    _check_image(img)
    boxes = _check_boxes(boxes)
    prob = _check_prob(prob, "random_expand prob")
    if not ratio > 1.01:
        raise ValueError(f"random_expand ratio must be > 1.01, got {ratio}")
    fill_px = np.asarray(fill, dtype=np.float64).reshape(-1)
    if fill_px.size != 3 or np.any(fill_px < 0) or np.any(fill_px > 255):
        raise ValueError(f"random_expand fill must be 3 RGB values in [0, 255], got {fill!r}")
    if rng.uniform() >= prob:
        return img.copy(), boxes
    height, width = img.shape[:2]
    r = float(rng.uniform(1.0, ratio))
    h, w = int(height * r), int(width * r)
    if h <= height or w <= width:
        return img.copy(), boxes
    y = int(rng.integers(0, h - height))
    x = int(rng.integers(0, w - width))
    canvas = np.empty((h, w, 3), np.uint8)
    canvas[:] = np.rint(fill_px).astype(np.uint8)
    canvas[y:y + height, x:x + width] = img
    boxes = boxes + np.array([x, y, x, y], np.float32)
    return canvas, boxes


def _iou_with(boxes: np.ndarray, crop: np.ndarray) -> np.ndarray:
    """IoU of ``(K, 4)`` xyxy boxes with one xyxy box, continuous coordinates."""
    lt = np.maximum(boxes[:, :2], crop[:2])
    rb = np.minimum(boxes[:, 2:], crop[2:])
    wh = np.clip(rb - lt, 0, None)
    inter = wh[:, 0] * wh[:, 1]
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    area_c = (crop[2] - crop[0]) * (crop[3] - crop[1])
    return inter / np.maximum(area + area_c - inter, 1e-10)


def random_crop(img: np.ndarray, boxes: np.ndarray, labels: np.ndarray, scores: np.ndarray,
                rng: np.random.Generator, aspect_ratio: Sequence[float] | None = (0.5, 2.0),
                thresholds: Sequence[float] = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9),
                scaling: Sequence[float] = (0.3, 1.0), num_attempts: int = 50,
                allow_no_crop: bool = True, cover_all_box: bool = False):
    """SSD-style IoU-constrained random crop (Liu et al., "SSD", ECCV 2016, section 2.2).

    PaddleDetection ``RandomCrop`` with its defaults (``aspect_ratio=[.5, 2.]``,
    ``thresholds=[.0, .1, .3, .5, .7, .9]``, ``scaling=[.3, 1.]``, ``num_attempts=50``,
    ``allow_no_crop=True``, ``cover_all_box=False``), the PP-YOLO reader's setting:

    1. The thresholds, plus a "no crop" choice when ``allow_no_crop``, are shuffled; they are tried
       in that order and "no crop" returns the input unchanged.
    2. For a threshold, up to ``num_attempts`` candidates: ``s ~ U(scaling)``,
       ``a ~ U(max(ar_min, s^2), min(ar_max, s^-2))``, crop ``int(H s / sqrt(a)) x
       int(W s sqrt(a))`` at a uniform integer offset (``0 .. H - crop_h`` inclusive: departure, see
       the module docstring). With ``aspect_ratio=None`` the two sides scale independently and
       crops with height/width outside ``[0.5, 2]`` are skipped.
    3. A candidate is accepted when the largest IoU of a box with the crop is ``>= threshold``
       (every box's IoU with ``cover_all_box``) and at least one box has its centre inside the crop
       (``x1 <= cx < x2``). Boxes whose centre is outside are dropped; the others are clipped to the
       crop and shifted, so each kept box is exactly its visible part.
    4. If no threshold yields a crop, the input is returned unchanged.

    So the result never loses all boxes: it is either uncropped or keeps at least one box. An image
    without boxes is returned unchanged (as PaddleDetection does).

    Args:
        img: uint8 RGB ``(H, W, 3)``.
        boxes: float ``(K, 4)`` pixel xyxy; labels int ``(K,)``; scores float ``(K,)``.
        rng: random generator.
        aspect_ratio, thresholds, scaling, num_attempts, allow_no_crop, cover_all_box: as above.

    Returns:
        ``(image uint8 (h, w, 3), boxes float32 (K', 4), labels int64 (K',), scores float32
        (K',))`` with ``K' >= 1`` when ``K >= 1``; new arrays.

    Raises:
        ValueError: malformed inputs, ``scaling`` not within ``(0, 1]``, ``aspect_ratio`` not
            positive with min <= max, ``num_attempts < 1``.
    """
    _check_image(img)
    boxes = _check_boxes(boxes)
    labels = _check_vector(labels, len(boxes), "labels", np.int64)
    scores = _check_vector(scores, len(boxes), "scores", np.float32)
    s_lo, s_hi = (float(v) for v in scaling)
    if not 0 < s_lo <= s_hi <= 1:
        raise ValueError(f"random_crop scaling must satisfy 0 < min <= max <= 1, got {scaling!r}")
    if aspect_ratio is not None:
        ar_lo, ar_hi = (float(v) for v in aspect_ratio)
        if not 0 < ar_lo <= ar_hi:
            raise ValueError(f"random_crop aspect_ratio must be 0 < min <= max, got {aspect_ratio!r}")
    if int(num_attempts) < 1:
        raise ValueError(f"random_crop num_attempts must be >= 1, got {num_attempts}")
    if len(boxes) == 0:
        return img.copy(), boxes, labels, scores

    h, w = img.shape[:2]
    choices: list = [float(t) for t in thresholds]
    if allow_no_crop:
        choices.append(None)
    order = rng.permutation(len(choices))
    centers = (boxes[:, :2] + boxes[:, 2:]) / 2
    for k in order:
        thresh = choices[int(k)]
        if thresh is None:
            return img.copy(), boxes, labels, scores
        for _ in range(int(num_attempts)):
            scale = float(rng.uniform(s_lo, s_hi))
            if aspect_ratio is not None:
                ar = float(rng.uniform(max(ar_lo, scale ** 2), min(ar_hi, scale ** -2)))
                h_scale, w_scale = scale / math.sqrt(ar), scale * math.sqrt(ar)
            else:
                h_scale = float(rng.uniform(s_lo, s_hi))
                w_scale = float(rng.uniform(s_lo, s_hi))
                if not 0.5 <= (h * h_scale) / (w * w_scale) <= 2.0:
                    continue
            crop_h, crop_w = int(h * h_scale), int(w * w_scale)
            if crop_h < 1 or crop_w < 1:
                continue
            crop_y = int(rng.integers(0, h - crop_h + 1))
            crop_x = int(rng.integers(0, w - crop_w + 1))
            crop = np.array([crop_x, crop_y, crop_x + crop_w, crop_y + crop_h], np.float32)
            iou = _iou_with(boxes, crop)
            if iou.max() < thresh or (cover_all_box and iou.min() < thresh):
                continue
            cut = boxes.copy()
            cut[:, :2] = np.maximum(boxes[:, :2], crop[:2])
            cut[:, 2:] = np.minimum(boxes[:, 2:], crop[2:])
            cut -= np.tile(crop[:2], 2)
            keep = (np.all((centers >= crop[:2]) & (centers < crop[2:]), axis=1)
                    & np.all(cut[:, :2] < cut[:, 2:], axis=1))
            if not keep.any():
                continue
            image = img[crop_y:crop_y + crop_h, crop_x:crop_x + crop_w].copy()
            return image, cut[keep], labels[keep], scores[keep]
    return img.copy(), boxes, labels, scores


def random_flip(img: np.ndarray, boxes: np.ndarray, rng: np.random.Generator, prob: float = 0.5):
    """Horizontal flip with probability ``prob`` (PaddleDetection ``RandomFlip``).

    Pixel column ``j`` goes to ``W - 1 - j``; a box ``x1, x2`` becomes ``W - x2, W - x1``
    (continuous coordinates), so flipping twice is the identity.

    Args:
        img: uint8 RGB ``(H, W, 3)``; boxes: float ``(K, 4)`` pixel xyxy; rng: random generator
            (one uniform draw); prob: probability of flipping.

    Returns:
        ``(image uint8 (H, W, 3), boxes float32 (K, 4))``, new arrays.

    Raises:
        ValueError: malformed image or boxes, ``prob`` outside ``[0, 1]``.
    """
    _check_image(img)
    boxes = _check_boxes(boxes)
    prob = _check_prob(prob, "random_flip prob")
    if rng.uniform() >= prob:
        return img.copy(), boxes
    width = img.shape[1]
    flipped = boxes.copy()
    flipped[:, 0] = width - boxes[:, 2]
    flipped[:, 2] = width - boxes[:, 0]
    return np.ascontiguousarray(img[:, ::-1]), flipped


def resize_to(img: np.ndarray, boxes: np.ndarray, size, interp: int = cv2.INTER_LINEAR):
    """Resize without keeping the aspect ratio (PaddleDetection ``Resize(keep_ratio=False)``).

    Boxes scale by ``(size_w / W, size_h / H)`` and are clipped to ``[0, size_w] x [0, size_h]``.

    Args:
        img: uint8 RGB ``(H, W, 3)``; boxes: float ``(K, 4)`` pixel xyxy.
        size: ``int`` (square) or ``(width, height)`` in pixels, each >= 1.
        interp: OpenCV interpolation flag (one of :data:`PPYOLO_INTERPS`).

    Returns:
        ``(image uint8 (size_h, size_w, 3), boxes float32 (K, 4) pixels of the new image)``.

    Raises:
        ValueError: malformed image or boxes, a size below 1, an unknown ``interp``.
    """
    _check_image(img)
    boxes = _check_boxes(boxes)
    if isinstance(size, (int, np.integer)):
        sw = sh = int(size)
    else:
        try:
            sw, sh = (int(v) for v in size)
        except (TypeError, ValueError):
            raise ValueError(f"resize_to size must be an int or (width, height), got {size!r}") from None
    if sw < 1 or sh < 1:
        raise ValueError(f"resize_to size must be >= 1 pixel, got {size!r}")
    if int(interp) not in PPYOLO_INTERPS:
        raise ValueError(f"resize_to interp {interp!r} is not one of the OpenCV flags "
                         f"{PPYOLO_INTERPS} (NEAREST, LINEAR, AREA, CUBIC, LANCZOS4)")
    h, w = img.shape[:2]
    out = cv2.resize(img, (sw, sh), interpolation=int(interp))
    scale = np.array([sw / w, sh / h, sw / w, sh / h], np.float32)
    boxes = boxes * scale
    boxes[:, 0::2] = np.clip(boxes[:, 0::2], 0, sw)
    boxes[:, 1::2] = np.clip(boxes[:, 1::2], 0, sh)
    return out, boxes


# ----------------------------------------------------------------------------------------------
# per-batch draws
# ----------------------------------------------------------------------------------------------

def _draw_index(tag: str, seed: int, epoch: int, batch_index: int, n: int) -> int:
    for name, v in (("seed", seed), ("epoch", epoch), ("batch_index", batch_index)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if n < 1:
        raise ValueError("the list to draw from is empty")
    key = f"gnetmdk-ppyolo-{tag}:{int(seed)}:{int(epoch)}:{int(batch_index)}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") % n


def draw_batch_size(seed: int, epoch: int, batch_index: int,
                    sizes: Sequence[int] = PPYOLO_SIZES) -> int:
    """The multi-scale input size of one global batch (PaddleDetection ``BatchRandomResize``).

    A pure function of its integers: ``sizes[blake2b("size", seed, epoch, batch_index) mod n]``
    (a 64-bit hash; bias from the modulo is below 1e-18). It uses no random state, so every process
    of a data-parallel run draws the same size for the same global batch, and a resumed or replayed
    run draws the same sequence, whatever NumPy version or platform.

    Args:
        seed: run seed; epoch: epoch number; batch_index: index of the global batch in the epoch.
        sizes: candidate sizes in pixels (PP-YOLO: 320, 352, ..., 608).

    Returns:
        One element of ``sizes`` (int).

    Raises:
        ValueError: a non-integer argument or empty ``sizes``.
    """
    sizes = [int(s) for s in sizes]
    return sizes[_draw_index("size", seed, epoch, batch_index, len(sizes))]


def draw_interp(seed: int, epoch: int, batch_index: int,
                interps: Sequence[int] = PPYOLO_INTERPS) -> int:
    """The interpolation of one global batch (``BatchRandomResize(random_interp=True)``).

    Same construction as :func:`draw_batch_size` with its own hash tag (independent of the size).

    Returns:
        One OpenCV interpolation flag of ``interps`` (default NEAREST, LINEAR, AREA, CUBIC,
        LANCZOS4, drawn uniformly as in PaddleDetection).

    Raises:
        ValueError: a non-integer argument or empty ``interps``.
    """
    interps = [int(i) for i in interps]
    return interps[_draw_index("interp", seed, epoch, batch_index, len(interps))]


# ----------------------------------------------------------------------------------------------
# the chain
# ----------------------------------------------------------------------------------------------

def ppyolo_train_sample(sample: Mapping[str, Any], rng: np.random.Generator, size,
                        mixup_sample: Mapping[str, Any] | None = None,
                        interp: int = cv2.INTER_LINEAR, mixup_alpha: float = 1.5,
                        mixup_beta: float = 1.5, expand_fill: Sequence[float] = IMAGENET_MEAN_PIXELS):
    """The PP-YOLO training chain for one sample, ending at the batch's size.

    ``mixup`` (only when ``mixup_sample`` is given; the PP-YOLO reader mixes every sample with a
    random other one for the first ``mixup_epoch`` epochs, 25000 in its config, i.e. always) ->
    ``random_distort`` -> ``random_expand`` (ImageNet-mean fill) -> ``random_crop`` ->
    ``random_flip`` -> ``resize_to(size, interp)`` -> boxes divided by the size (PaddleDetection's
    ``NormalizeBox``), clipped to ``[0, 1]``. All draws come from ``rng`` in this order, so one seed
    gives one output. ``size`` and ``interp`` belong to the whole batch: take them from
    :func:`draw_batch_size` and :func:`draw_interp`.

    Args:
        sample, mixup_sample: dicts with ``"image"`` uint8 RGB ``(H, W, 3)``, ``"boxes"`` float
            ``(K, 4)`` pixel xyxy, ``"labels"`` int ``(K,)``, optional ``"scores"`` (default 1).
        rng: random generator.
        size: output side in pixels (int) or ``(width, height)``.
        interp: OpenCV interpolation flag.
        mixup_alpha, mixup_beta: Beta parameters of Mixup.
        expand_fill: RGB fill of RandomExpand.

    Returns:
        ``(image uint8 (size, size, 3), boxes float32 (K', 4) relative xyxy in [0, 1], labels
        int64 (K',), scores float32 (K',))``; scores are 1 unless Mixup ran.

    Raises:
        ValueError: malformed samples or settings (see the individual functions).
    """
    img, boxes, labels, scores = _unpack(sample, "sample")
    if mixup_sample is not None:
        mixed = mixup({"image": img, "boxes": boxes, "labels": labels, "scores": scores},
                      mixup_sample, rng, mixup_alpha, mixup_beta)
        img, boxes, labels, scores = (mixed["image"], mixed["boxes"], mixed["labels"],
                                      mixed["scores"])
    img = random_distort(img, rng)
    img, boxes = random_expand(img, boxes, rng, fill=expand_fill)
    img, boxes, labels, scores = random_crop(img, boxes, labels, scores, rng)
    img, boxes = random_flip(img, boxes, rng)
    img, boxes = resize_to(img, boxes, size, interp)
    h, w = img.shape[:2]
    rel = boxes / np.array([w, h, w, h], np.float32)
    rel = np.clip(rel, 0.0, 1.0).astype(np.float32)
    return img, rel, labels.astype(np.int64), scores.astype(np.float32)


def pad_targets(boxes_rel: np.ndarray, labels: np.ndarray, scores: np.ndarray,
                max_boxes: int = 50) -> np.ndarray:
    """Fixed-size target rows for batching (PaddleDetection ``PadBox``, ``num_max_boxes: 50``).

    Row ``i < K`` is ``[class, x1, y1, x2, y2, score]`` (relative xyxy as given; PaddleDetection
    converts to centre-xywh afterwards with ``BboxXYXY2XYWH``, we leave that to the loss); rows
    ``K .. max_boxes - 1`` are ``[-1, 0, 0, 0, 0, 0]``. When ``K > max_boxes`` the first
    ``max_boxes`` boxes are kept in their given order and the rest dropped, as PadBox does: after
    Mixup the boxes of the mixed-in sample come last and are the ones dropped.

    Args:
        boxes_rel: float ``(K, 4)`` relative xyxy; labels: int ``(K,)``; scores: float ``(K,)``.
        max_boxes: number of rows, >= 1.

    Returns:
        float32 ``(max_boxes, 6)``.

    Raises:
        ValueError: shapes that do not match, a negative label, ``max_boxes < 1``.
    """
    if int(max_boxes) != max_boxes or max_boxes < 1:
        raise ValueError(f"max_boxes must be a positive integer, got {max_boxes!r}")
    b = _check_boxes(boxes_rel, "boxes_rel")
    lab = _check_vector(labels, len(b), "labels", np.int64)
    sc = _check_vector(scores, len(b), "scores", np.float32)
    if len(lab) and lab.min() < 0:
        raise ValueError(f"labels must be >= 0 (-1 marks padding), got {lab.tolist()}")
    out = np.zeros((int(max_boxes), 6), np.float32)
    out[:, 0] = -1.0
    n = min(len(b), int(max_boxes))
    out[:n, 0] = lab[:n]
    out[:n, 1:5] = b[:n]
    out[:n, 5] = sc[:n]
    return out
