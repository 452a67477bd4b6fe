"""Plots of the numbers the tools compute: per-class precision-recall curves, a detection confusion
matrix, the per-stage mAP of a pipeline run, the per-layer output drift along the stages, and training
curves (PNG, matplotlib's Agg renderer).

Every plot function writes two files as one set, ``NAME.png`` and ``NAME.json`` (the plotted numbers,
so tests and users can read them without decoding the image), through
:func:`gnetmdk.checkpoint.io.atomic_write_set`: a run that fails leaves neither a half-written PNG nor a
PNG without its JSON. Each returns the paths written, ``[png, json]``.

matplotlib is not a dependency of the package (``pip install matplotlib``, or ``pip install -e
".[plots]"``); it is imported when a plot is drawn, and its absence is reported as a
:class:`PlotError` naming that command. The figures are drawn on ``matplotlib.figure.Figure`` objects
with the Agg canvas, never through pyplot's global figure list, so nothing is left open and an
interactive user's backend is not switched (``matplotlib.use("Agg")`` is called only when pyplot has
not been imported yet).

Used by ``tools/eval_voc.py --plots DIR`` and ``tools/chip_eval.py --plots DIR`` (``pr_curves`` and
``confusion_matrix``), ``tools/run_pipeline.py --plots DIR`` (``stages``, ``layer_drift``),
``tools/stage_report.py --plots DIR`` (``stage_report``) and the trainer (``curves``); docs/pipeline.md, "Plots".
"""
from __future__ import annotations

import io
import json
import math
import os
import sys
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

__all__ = ["PlotError", "require_matplotlib", "prepare_plot_dir", "plot_pr_curves", "confusion_matrix",
           "plot_confusion_matrix", "plot_stages", "write_eval_plots", "CONFUSION_CONF_THRESH"]

#: default score threshold of :func:`confusion_matrix`: detections scoring above it are counted
CONFUSION_CONF_THRESH = 0.3

_INSTALL = "pip install matplotlib (or, in the repository, pip install -e \".[plots]\")"


class PlotError(RuntimeError):
    """A plot cannot be written: matplotlib is missing, or the output folder cannot be created or
    written. The message names the path or the command that fixes it."""


def require_matplotlib():
    """Import matplotlib (Agg renderer) and return ``(Figure, FigureCanvasAgg)``.

    Raises:
        PlotError: matplotlib is not installed (the message names ``pip install matplotlib``).
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotError(f"plots need matplotlib, which is not installed: {_INSTALL}") from exc
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    return Figure, FigureCanvasAgg


def prepare_plot_dir(folder: str) -> str:
    """Create ``folder`` (and its parents) if needed and check that files can be written in it (a probe
    file is created and removed, as gnetmdk.checkpoint.outputs.check_writable does for the stage
    outputs: that also catches a read-only file system, or permissions root ignores).

    The tools call this before they evaluate, so a bad ``--plots DIR`` is refused before any work.

    Returns:
        ``folder`` unchanged.
    Raises:
        PlotError: ``folder`` is an existing file, cannot be created, or is not writable.
    """
    if not folder:
        raise PlotError("the plots folder is empty: pass --plots DIR with a folder name")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise PlotError(f"plots folder '{folder}' is a file, not a folder: pass another --plots DIR")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise PlotError(f"plots folder '{folder}' cannot be created ({exc.strerror or exc}): "
                        "pass a folder you can write to") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".plots-write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise PlotError(f"plots folder '{folder}' is not writable ({exc.strerror or exc}): fix its permissions "
                        "or pass another --plots DIR") from None
    return folder


def _json_path(png_path: str) -> str:
    stem, ext = os.path.splitext(png_path)
    if ext.lower() != ".png":
        raise ValueError(f"plot path must end in .png, got '{png_path}'")
    return stem + ".json"


def _finite_or_none(v: Any) -> Optional[float]:
    """A float for JSON; ``nan`` / ``None`` become ``None`` (JSON has no NaN)."""
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v


def _write_pair(fig, png_path: str, data: Dict[str, Any], dpi: int = 100) -> List[str]:
    """Render ``fig`` to PNG bytes, then write the PNG and ``data`` as JSON (same stem) as one set."""
    from gnetmdk.utils.atomic import atomic_write_set, text_writer
    json_path = _json_path(png_path)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    png = buf.getvalue()
    text = json.dumps(data, allow_nan=False) + "\n"
    try:
        return atomic_write_set({png_path: lambda fh: fh.write(png), json_path: text_writer(text)})
    except OSError as exc:
        raise PlotError(f"cannot write plot '{png_path}' ({exc.strerror or exc}): nothing was written; "
                        "pass a folder you can write to") from None


def _new_figure(size):
    Figure, FigureCanvasAgg = require_matplotlib()
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


# ------------------------------------------------------------------------------ precision-recall
def plot_pr_curves(result: Mapping[str, Any], class_names: Sequence[str], path: str,
                   iou_thresh: float = 0.5, title: Optional[str] = None) -> List[str]:
    """Per-class precision-recall curves, one figure, one line per class, AP in the legend.

    The curves are the arrays :func:`gnetmdk.evaluation.voc.evaluate_detections` computes each AP from
    (``return_curves=True``): for the class's detections ranked by score, recall = cumulative TP /
    number of ground truths and precision = cumulative TP / (TP + FP), one point per detection; the
    AP is their all-point interpolated area (PASCAL VOC devkit ``VOCap``, Everingham et al. 2010:
    :func:`gnetmdk.evaluation.voc.voc_ap`). The raw (not interpolated) precision is drawn.

    Args:
        result: ``evaluate_detections(..., return_curves=True)`` output (``"ap"``, ``"map"``,
            ``"num_gt"``, ``"num_det"``, ``"curves"``).
        class_names: ``C`` class names, in label order.
        path: the PNG file to write (``.png``); the JSON goes beside it with the same stem.
        iou_thresh: the IoU threshold ``result`` was computed with (only labels the plot).
        title: figure title (default: "precision-recall per class, VOC AP@<iou>").

    JSON written: ``{"iou_thresh", "map", "classes": [{"index", "name", "ap", "num_gt", "num_det",
    "recall", "precision"}, ...]}``, one entry per class in label order; recall and precision are
    lists of floats in ``[0, 1]`` (``voc_ap(recall, precision)`` gives ``ap`` exactly); a class
    without ground truth has ``ap`` null and empty lists (it is not drawn); ``map`` is null when no
    class has ground truth.

    Returns:
        ``[png path, json path]``.
    Raises:
        ValueError: ``result`` lacks a key (``"curves"``: pass ``return_curves=True``), or
            ``class_names`` does not have one name per class.
        PlotError: matplotlib missing, or the files cannot be written (nothing was replaced).
    """
    for key in ("ap", "map", "num_gt", "num_det", "curves"):
        if key not in result:
            hint = ": call evaluate_detections(..., return_curves=True)" if key == "curves" else ""
            raise ValueError(f"result is missing key {key!r}{hint}")
    aps = list(result["ap"])
    if len(class_names) != len(aps):
        raise ValueError(f"class_names has {len(class_names)} entries but the result has {len(aps)} classes")
    curves = result["curves"]
    classes = []
    for c, name in enumerate(class_names):
        rec, prec = curves.get(c, ((), ()))
        classes.append({"index": c, "name": str(name), "ap": _finite_or_none(aps[c]),
                        "num_gt": int(result["num_gt"][c]), "num_det": int(result["num_det"][c]),
                        "recall": [float(v) for v in np.asarray(rec, np.float64)],
                        "precision": [float(v) for v in np.asarray(prec, np.float64)]})
    data = {"iou_thresh": float(iou_thresh), "map": _finite_or_none(result["map"]), "classes": classes}

    fig = _new_figure((7.0, 5.0))
    ax = fig.add_subplot()
    for entry in classes:
        if entry["ap"] is None:
            continue                                    # no ground truth: no curve, no AP
        ax.plot(entry["recall"], entry["precision"], linewidth=1.5,
                marker="." if len(entry["recall"]) <= 30 else None,      # a short curve stays visible
                label=f"{entry['name']} (AP {entry['ap']:.4f})")
    m = data["map"]
    ax.set_xlim(-0.02, 1.02)                            # a curve at precision 0 stays visible
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.grid(True, alpha=0.3)
    ax.set_title(title or f"precision-recall per class, VOC AP@{iou_thresh:g}"
                 + ("" if m is None else f", mAP {m:.4f}"))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower left", fontsize="small")
    return _write_pair(fig, path, data)


# ------------------------------------------------------------------------------ confusion matrix
def confusion_matrix(detections: Sequence[Mapping[str, Any]], ground_truths: Sequence[Mapping[str, Any]],
                     num_classes: int, conf_thresh: float = CONFUSION_CONF_THRESH,
                     iou_thresh: float = 0.5) -> np.ndarray:
    """Detection confusion matrix with a background row and column.

    The convention of the detection confusion matrix ultralytics' YOLO tools draw (a ``C + 1`` square
    whose extra class is "background", so missed objects and false detections have a cell), with rows
    = true class and columns = predicted class (ultralytics stores the transpose), and the matching
    described here, by score rather than by IoU. Per image:

    * only detections scoring strictly above ``conf_thresh`` take part, compared in the scores' own
      floating dtype as the decoder compares them (a float32 score of 0.3 is not above 0.3);
    * in order of descending score (ties: the earlier detection first), each detection takes the
      not-yet-matched ground truth of any class with the highest IoU (box IoU,
      :func:`gnetmdk.evaluation.boxes.box_iou`, no "+1"), if that IoU is ``>= iou_thresh``;
    * a match counts ``[true class, predicted class]`` (the diagonal when the classes agree);
    * a ground truth left unmatched counts ``[class, background]`` (a missed object);
    * a detection left unmatched counts ``[background, class]`` (a false detection);
    * a ground truth marked difficult counts nowhere: a detection it matches is neither right nor
      wrong (as in VOC AP) and it is not counted as missed.

    ``[background, background]`` is always 0. Row sums are the (non-difficult) ground truths per class
    (the last row: false detections); column sums the counted detections per predicted class (the
    last column: missed objects).

    Args:
        detections: one dict per image: ``"boxes"`` float ``(K, 4)`` xyxy pixels, ``"scores"`` float
            ``(K,)``, ``"labels"`` int ``(K,)`` in ``[0, num_classes)`` (numpy, torch or lists).
        ground_truths: one dict per image, same order: ``"boxes"`` ``(G, 4)`` xyxy pixels,
            ``"labels"`` int ``(G,)``, optional ``"difficult"`` bool ``(G,)``.
        num_classes: ``C``.
        conf_thresh: score threshold (default :data:`CONFUSION_CONF_THRESH`, 0.3, in the decoder's
            score units, 0..1).
        iou_thresh: minimum IoU of a match (inclusive), default 0.5 as VOC AP.

    Returns:
        ``(C + 1, C + 1)`` int64 array of counts; index ``C`` is background.
    Raises:
        ValueError: the lists differ in length, a dict lacks a key, boxes are not ``(K, 4)``, a per-box
            array does not match its boxes, a label is outside ``[0, C)``, or ``C < 1``.
    """
    import torch
    from .boxes import box_iou
    from .voc import _boxes, _get, _labels, _to_numpy, _vector
    if len(detections) != len(ground_truths):
        raise ValueError(f"detections and ground_truths must have one entry per image and the same length, "
                         f"got {len(detections)} and {len(ground_truths)}")
    if int(num_classes) != num_classes or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    C = int(num_classes)
    bg = C
    matrix = np.zeros((C + 1, C + 1), dtype=np.int64)
    for i, (det, gt) in enumerate(zip(detections, ground_truths)):
        gw, dw = f"ground_truths[{i}]", f"detections[{i}]"
        g_boxes = _boxes(_get(gt, "boxes", gw), gw)
        g_labels = _labels(_get(gt, "labels", gw), len(g_boxes), C, gw)
        diff = gt.get("difficult") if isinstance(gt, Mapping) else None
        g_diff = (np.zeros(len(g_boxes), bool) if diff is None
                  else _vector(diff, len(g_boxes), gw + " difficult", bool))
        d_boxes = _boxes(_get(det, "boxes", dw), dw)
        raw = _to_numpy(_get(det, "scores", dw))
        own = raw.dtype if np.issubdtype(raw.dtype, np.floating) else np.dtype(np.float64)
        d_scores = _vector(raw, len(d_boxes), dw + " scores", own)
        d_labels = _labels(_get(det, "labels", dw), len(d_boxes), C, dw)
        keep = np.nonzero(d_scores > own.type(conf_thresh))[0]      # in the scores' dtype, as the decoder
        keep = keep[np.argsort(-d_scores[keep], kind="stable")]
        matched = np.zeros(len(g_boxes), dtype=bool)
        iou = (box_iou(torch.from_numpy(d_boxes[keep]), torch.from_numpy(g_boxes)).numpy()
               if len(keep) and len(g_boxes) else np.zeros((len(keep), len(g_boxes))))
        for row, j in enumerate(keep):
            pred = int(d_labels[j])
            if len(g_boxes):
                cand = np.where(matched, -1.0, iou[row])
                g = int(np.argmax(cand))
                if cand[g] >= iou_thresh:
                    matched[g] = True
                    if not g_diff[g]:
                        matrix[g_labels[g], pred] += 1
                    continue
            matrix[bg, pred] += 1
        for g in np.nonzero(~matched & ~g_diff)[0]:
            matrix[g_labels[g], bg] += 1
    return matrix


def plot_confusion_matrix(matrix: np.ndarray, class_names: Sequence[str], path: str,
                          conf_thresh: float = CONFUSION_CONF_THRESH, iou_thresh: float = 0.5,
                          title: Optional[str] = None) -> List[str]:
    """Draw a detection confusion matrix (:func:`confusion_matrix`) as a heat map, counts in the cells.

    Args:
        matrix: ``(C + 1, C + 1)`` integer counts, rows true class, columns predicted class, the last
            row and column "background".
        class_names: ``C`` names, in label order.
        path: the PNG file (``.png``); the JSON goes beside it with the same stem.
        conf_thresh, iou_thresh: the thresholds the matrix was counted with (labels and JSON only).
        title: figure title (default names the thresholds).

    JSON written: ``{"labels": C names + ["background"], "rows": "true", "columns": "predicted",
    "conf_thresh", "iou_thresh", "matrix": (C + 1) lists of C + 1 ints}``.

    Returns:
        ``[png path, json path]``.
    Raises:
        ValueError: ``matrix`` is not a ``(C + 1, C + 1)`` array of non-negative integers.
        PlotError: matplotlib missing, or the files cannot be written (nothing was replaced).
    """
    m = np.asarray(matrix)
    n = len(class_names) + 1
    if m.shape != (n, n):
        raise ValueError(f"matrix must be ({n}, {n}) for {n - 1} classes plus background, got {m.shape}")
    if m.size and (not np.all(m == np.round(m)) or m.min() < 0):
        raise ValueError("matrix must hold non-negative integer counts")
    m = m.astype(np.int64)
    labels = [str(c) for c in class_names] + ["background"]
    data = {"labels": labels, "rows": "true", "columns": "predicted", "conf_thresh": float(conf_thresh),
            "iou_thresh": float(iou_thresh), "matrix": m.tolist()}

    side = max(4.5, 0.6 * n + 2.5)
    fig = _new_figure((side + 1.0, side))
    ax = fig.add_subplot()
    im = ax.imshow(m, cmap="Blues", interpolation="nearest", vmin=0, vmax=max(int(m.max()), 1))
    fig.colorbar(im, ax=ax, shrink=0.8, label="count")
    threshold = m.max() / 2.0
    for r in range(n):
        for c in range(n):
            ax.text(c, r, str(int(m[r, c])), ha="center", va="center", fontsize="small",
                    color="white" if m[r, c] > threshold and m[r, c] > 0 else "black")
    ax.set_xticks(range(n), labels, rotation=45, ha="right")
    ax.set_yticks(range(n), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title or f"detections (score > {conf_thresh:g}) vs ground truth, IoU >= {iou_thresh:g}")
    return _write_pair(fig, path, data)


# ------------------------------------------------------------------------------ pipeline stages
def plot_stages(rows: Sequence[Mapping[str, Any]], path: str, title: Optional[str] = None) -> List[str]:
    """Bar chart of val mAP per pipeline stage: the entry mAP (the loaded model after the stage's entry
    edits, before training) and the best mAP (the stage's best.pth) side by side.

    Args:
        rows: one mapping per stage, in run order, with ``"stage"`` (str), ``"entry_map"`` and
            ``"best_map"`` (floats in ``[0, 1]``, or None when the stage has none); the dicts
            ``tools/run_pipeline.py`` prints as its table and writes with ``--json``.
        path: the PNG file (``.png``); the JSON goes beside it with the same stem.
        title: figure title.

    JSON written: ``{"stages": [{"stage", "entry_map", "best_map"}, ...]}`` (null for a missing value).

    Returns:
        ``[png path, json path]``.
    Raises:
        ValueError: a row lacks ``"stage"``.
        PlotError: matplotlib missing, or the files cannot be written (nothing was replaced).
    """
    stages = []
    for k, r in enumerate(rows):
        if "stage" not in r:
            raise ValueError(f"rows[{k}] has no 'stage'")
        stages.append({"stage": str(r["stage"]), "entry_map": _finite_or_none(r.get("entry_map")),
                       "best_map": _finite_or_none(r.get("best_map"))})
    data = {"stages": stages}

    fig = _new_figure((max(6.5, 1.3 * len(stages) + 2.0), 4.5))
    ax = fig.add_subplot()
    x = np.arange(len(stages))
    width = 0.38
    for offset, key, label in ((-width / 2, "entry_map", "entry (after the entry edits, before training)"),
                               (width / 2, "best_map", "best (best.pth)")):
        vals = [s[key] for s in stages]
        bars = ax.bar(x + offset, [np.nan if v is None else v for v in vals], width, label=label)
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, 0.0 if v is None else v, "-" if v is None else f"{v:.4f}",
                    ha="center", va="bottom", fontsize="x-small")
    ax.set_xticks(x, [s["stage"] for s in stages])
    ax.set_ylim(0.0, 1.08)
    ax.set_ylabel("val mAP@0.5")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, fontsize="small", frameon=False)
    ax.set_title(title or "val mAP per stage")
    return _write_pair(fig, path, data)


def plot_layer_drift(layers: Sequence[str], drift: Mapping[str, Sequence[float]], path: str, reference: str = "step1",
                     maps: Optional[Mapping[str, Optional[float]]] = None, title: Optional[str] = None) -> List[str]:
    """Per-layer output drift from the float model along the stages, and optionally mAP per stage.

    Args:
        layers: sublayer names, in network order.
        drift: stage name -> per-layer relative L2 error from ``reference`` (floats >= 0, one per layer;
            what gnetmdk.chip.report.layer_drift computes), in pipeline order. The reference's own
            line (all 0) is not drawn.
        path: the PNG file (``.png``); the JSON goes beside it with the same stem.
        reference: the stage the errors are measured from.
        maps: stage name -> val mAP@0.5 (or None); when given, a bar panel of mAP per stage is drawn
            above the drift panel.
        title: figure title.

    JSON written: ``{"layers": [...], "reference": str, "drift": {stage: [relative error, ...]},
    "maps": {stage: mAP} or null}``.

    Returns:
        ``[png path, json path]``.
    Raises:
        ValueError: a stage's list does not have one value per layer.
        PlotError: matplotlib missing, or the files cannot be written (nothing was replaced).
    """
    layers = [str(n) for n in layers]
    rows = {}
    for stage, vals in drift.items():
        vals = [_finite_or_none(v) for v in vals]
        if len(vals) != len(layers):
            raise ValueError(f"drift[{stage!r}] has {len(vals)} values for {len(layers)} layers")
        rows[str(stage)] = vals
    map_rows = None if maps is None else {str(k): _finite_or_none(v) for k, v in maps.items()}
    data = {"layers": layers, "reference": str(reference), "drift": rows, "maps": map_rows}

    fig = _new_figure((max(7.0, 0.45 * len(layers) + 3.0), 7.5 if map_rows else 4.5))
    if map_rows:
        ax_map, ax = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1, 1.6]})
        names = list(map_rows)
        vals = [map_rows[n] for n in names]
        bars = ax_map.bar(range(len(names)), [np.nan if v is None else v for v in vals], 0.6)
        for b, v in zip(bars, vals):
            ax_map.text(b.get_x() + b.get_width() / 2, 0.0 if v is None else v, "-" if v is None else f"{v:.4f}",
                        ha="center", va="bottom", fontsize="x-small")
        ax_map.set_xticks(range(len(names)), names)
        ax_map.set_ylim(0.0, 1.08)
        ax_map.set_ylabel("mAP@0.5")
        ax_map.grid(True, axis="y", alpha=0.3)
    else:
        ax = fig.add_subplot()
    x = np.arange(len(layers))
    positive = []
    for k, (stage, vals) in enumerate(rows.items()):
        if stage == reference:
            continue
        y = np.array([np.nan if v is None else 100.0 * v for v in vals])
        positive.extend(v for v in y if np.isfinite(v) and v > 0)
        chip_like = stage == "chip"
        ax.plot(x, y, marker="o", linestyle="--" if chip_like else "-", fillstyle="none" if chip_like else "full",
                label=stage)
    if positive:
        from matplotlib.ticker import FormatStrFormatter
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))       # 20, 30, 40 rather than 2 x 10^1
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xticks(x, layers, rotation=90 if len(layers) > 12 else 0, fontsize="small")
    ax.set_xlabel("sublayer (output after the pool)")
    ax.set_ylabel(f"relative L2 error from {reference} (%)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    fig.suptitle(title or f"output drift per layer from {reference}")
    return _write_pair(fig, path, data)


# ------------------------------------------------------------------------------ training curves
def plot_sensitivity(sens, path: str, suggested: Optional[Sequence[int]] = None,
                     title: Optional[str] = None, check=None) -> List[str]:
    """Bars of the mAP change (points) per sublayer with only its weights quantized, and with only its
    activation quantized (gnetmdk.gti.sensitivity.Sensitivity), on one axis; the suggested mask_bits
    in the title.

    Args:
        sens: the measured :class:`~gnetmdk.gti.sensitivity.Sensitivity`.
        path: the PNG file (``.png``); the JSON goes beside it with the same stem.
        suggested: the suggested mask_bits (shown and stored), or None.
        title: figure title.
        check: :class:`~gnetmdk.gti.sensitivity.MaskBitsCheck` of the suggestion, or None.

    JSON written: ``{"base_map", "layers": [{"name", "major", "weights_map", "weights_err", "acts_map",
    "acts_err"}], "outputs": {group: [map, err]}, "output_cap", "weight_formats": {major: {weight_format: [map, err]}},
    "current", "suggested", "together": [{"mask_bits", "map", "err"}], "within"}`` (null where not measured;
    "outputs" empty without caps; "together": the check's trail, empty and "within" null without one).

    Returns:
        ``[png path, json path]``.
    Raises:
        PlotError: matplotlib missing, or the files cannot be written (nothing was replaced).
    """
    layers = []
    for i, name in enumerate(sens.layers):
        w = sens.weights[i] if i < len(sens.weights) else (None, None)
        a = sens.acts[i] if i < len(sens.acts) else (None, None)
        layers.append({"name": name, "major": int(sens.majors[i]) + 1, "weights_map": _finite_or_none(w[0]),
                       "weights_err": _finite_or_none(w[1]), "acts_map": _finite_or_none(a[0]),
                       "acts_err": _finite_or_none(a[1])})
    data = {"base_map": _finite_or_none(sens.base_map), "layers": layers,
            "outputs": {k: [_finite_or_none(v[0]), _finite_or_none(v[1])] for k, v in sens.outputs.items()},
            "output_cap": _finite_or_none(sens.output_cap),
            "weight_formats": {str(m + 1): {str(s): [_finite_or_none(v[0]), _finite_or_none(v[1])]
                                            for s, v in by.items()}
                               for m, by in sens.weight_formats.items()},
            "current": list(sens.current), "suggested": list(suggested) if suggested is not None else None,
            "together": [{"mask_bits": list(b), "map": _finite_or_none(m), "err": _finite_or_none(e)}
                         for b, m, e in (check.trail if check is not None else [])],
            "within": bool(check.within) if check is not None else None}
    fig = _new_figure((max(6.5, 0.55 * len(layers) + 2.0), 4.5))
    ax = fig.add_subplot()
    x = np.arange(len(layers))
    width = 0.38
    for offset, key, label in ((-width / 2, "weights_map", "weights of this sublayer only"),
                               (width / 2, "acts_map", "activation of this layer only")):
        vals = [np.nan if l[key] is None else 100.0 * (l[key] - sens.base_map) for l in layers]
        ax.bar(x + offset, vals, width, label=label)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(x, [l["name"] for l in layers], rotation=45)
    ax.set_xlabel("sublayer (major.sub)")
    ax.set_ylabel("mAP@0.5 change from the float model (points)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="lower left", fontsize="small")
    sub = f"; suggested mask_bits {list(suggested)}" if suggested is not None else ""
    ax.set_title((title or "quantization sensitivity per layer") + sub, fontsize="medium")
    return _write_pair(fig, path, data)


def plot_training_curves(history: Sequence[Mapping[str, Any]], path: str, title: Optional[str] = None) -> List[str]:
    """A stage's training curves: the mean training loss terms per epoch, the learning rate at each
    epoch's end, and val mAP@0.5 (and COCO mAP@[.5:.95] where measured) at each evaluation.

    Args:
        history: one mapping per epoch, in order: ``"epoch"`` (int, 1-based), ``"train"`` ({term: mean
            loss over the epoch}, ``"total"`` among them), ``"lr"`` (float), and where that epoch was
            evaluated ``"val_map"`` and optionally ``"coco_map"`` (floats in ``[0, 1]``). What
            gnetmdk.engine.hooks.CurvesHook collects.
        path: the PNG file (``.png``); the JSON goes beside it with the same stem.
        title: figure title.

    JSON written: ``{"epochs": [...]}``, the history as given (NaN as null).

    Returns:
        ``[png path, json path]``.
    Raises:
        ValueError: an entry lacks ``"epoch"`` or ``"train"``.
        PlotError: matplotlib missing, or the files cannot be written (nothing was replaced).
    """
    rows = []
    for k, h in enumerate(history):
        if "epoch" not in h or "train" not in h:
            raise ValueError(f"history[{k}] needs 'epoch' and 'train'")
        rows.append({"epoch": int(h["epoch"]), "lr": _finite_or_none(h.get("lr")),
                     "train": {str(t): _finite_or_none(v) for t, v in h["train"].items()},
                     "val_map": _finite_or_none(h.get("val_map")), "coco_map": _finite_or_none(h.get("coco_map"))})
    fig = _new_figure((7.5, 8.0))
    ax_loss, ax_lr, ax_map = fig.subplots(3, 1, sharex=True)
    epochs = [r["epoch"] for r in rows]
    terms = sorted({t for r in rows for t in r["train"]}, key=lambda t: (t != "total", t))
    for t in terms:
        ax_loss.plot(epochs, [np.nan if r["train"].get(t) is None else r["train"][t] for r in rows],
                     label=t, linewidth=2.0 if t == "total" else 1.0)
    ax_loss.set_ylabel("training loss (epoch mean)")
    ax_loss.legend(fontsize="x-small", ncol=4)
    ax_lr.plot(epochs, [np.nan if r["lr"] is None else r["lr"] for r in rows])
    ax_lr.set_ylabel("learning rate")
    for key, label in (("val_map", "val mAP@0.5"), ("coco_map", "val COCO mAP@[.5:.95]")):
        pts = [(r["epoch"], r[key]) for r in rows if r[key] is not None]
        if pts:
            ax_map.plot(*zip(*pts), marker="o", label=label)
    ax_map.set_ylim(0.0, 1.02)
    ax_map.set_ylabel("mAP")
    ax_map.set_xlabel("epoch")
    if ax_map.lines:
        ax_map.legend(fontsize="small")
    for ax in (ax_loss, ax_lr, ax_map):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or "training curves")
    return _write_pair(fig, path, {"epochs": rows})


# ------------------------------------------------------------------------------ the tools' set
def write_eval_plots(folder: str, result: Mapping[str, Any], detections: Sequence[Mapping[str, Any]],
                     ground_truths: Sequence[Mapping[str, Any]], class_names: Sequence[str],
                     conf_thresh: float = CONFUSION_CONF_THRESH, title: str = "") -> List[str]:
    """What ``tools/eval_voc.py --plots`` and ``tools/chip_eval.py --plots`` write in ``folder``:
    ``pr_curves.png/.json`` (:func:`plot_pr_curves`) and ``confusion_matrix.png/.json``
    (:func:`confusion_matrix` at ``conf_thresh``, IoU 0.5, :func:`plot_confusion_matrix`).

    Args:
        folder: output folder (created if missing).
        result: ``evaluate_detections(detections, ground_truths, C, return_curves=True)``.
        detections, ground_truths: what ``result`` was computed from (see :func:`confusion_matrix`).
        class_names: ``C`` names.
        conf_thresh: the confusion matrix's score threshold.
        title: a prefix for both figure titles (e.g. the checkpoint and split).
    Returns:
        the four paths written.
    Raises:
        PlotError, ValueError: as the plot functions.
    """
    prepare_plot_dir(folder)
    prefix = f"{title}: " if title else ""
    written = plot_pr_curves(result, class_names, os.path.join(folder, "pr_curves.png"),
                             title=f"{prefix}precision-recall, VOC AP@0.5, mAP "
                                   + ("n/a" if _finite_or_none(result["map"]) is None else f"{result['map']:.4f}"))
    cm = confusion_matrix(detections, ground_truths, len(class_names), conf_thresh)
    written += plot_confusion_matrix(cm, class_names, os.path.join(folder, "confusion_matrix.png"), conf_thresh,
                                     title=f"{prefix}score > {conf_thresh:g}, IoU >= 0.5")
    return written
