#!/usr/bin/env python3
"""Export a PP-YOLO step-4 checkpoint as an integer ONNX model, and check it against step 4.

    python3 tools/export_int.py --config examples/ppyolo_cards.py           # checkpoint/step4/best.pth -> model/int_model.onnx
    python3 tools/export_int.py CKPT --config C --out DIR --name NAME
    python3 tools/export_int.py --config C --check                          # + every layer on the valid split
    python3 tools/export_int.py --config C --check --split train max_train_images=20
    python3 tools/export_int.py --config C --format qdq --check             # model/qdq_model.onnx, measured against step 4
    python3 tools/export_int.py --config C --format qdq --weights uint8 --provider cuda --check

The ONNX graph holds integer operators only from the uint8 image to the head's int32 accumulators
(gnetmdk.intq.onnx_export), which it dequantizes to float32 ("out0", "out1", ..: the model's raw
head outputs, decoded as the checkpoint's model decodes them). --check runs the split through the
step-4 model's integer program (gnetmdk.intq.program, what step 4 evaluates) and through onnxruntime,
and compares every layer's uint8 codes and the float outputs of every image (mismatch count per layer,
0 required), then the mAP of both (must be equal). GNetDet checkpoints go to tools/convert_to_chip.py.

`--format qdq` writes the QDQ form instead (gnetmdk.intq.qdq_export: QuantizeLinear / DequantizeLinear
around float operators, per-channel int8 weights, uint8 activations with zero points, int32 biases),
which onnxruntime's providers, OpenVINO and other int8 runtimes take and execute with their own
arithmetic. Its --check runs the split through step 4 and through onnxruntime on --provider and
measures the distance: per layer the share of equal uint8 codes and the largest code difference, the
head outputs' largest difference, and the mAP of both; it passes when at least 99.9% of all codes are
equal and the mAPs differ by at most 0.001. `--weights uint8` stores the weights as codes + 128 with
zero point 128 (the same values), for onnxruntime on x86 CPUs without VNNI (docs/ppyolo.md, "QDQ
export"); a step 4 trained with `ppyolo.requant float` rounds its convs as onnxruntime does.
Exit status: 0 ok; 1 the check found a difference (int) or missed the goal (qdq); 2 a user error (one
line on stderr).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from gnetmdk.config.cli import Parser, at_least, fail
from gnetmdk.engine.cli import tool_main


def parse_args(argv):
    """Parse the command line (module docstring); config overrides (KEY VALUE / KEY=VALUE) come back apart."""
    p = Parser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=__doc__)
    p.add_argument("checkpoint", nargs="?", default=None, help="step-4 checkpoint (default checkpoint/step4/best.pth)")
    p.add_argument("--config", default=None, help="configs.py (default ./configs.py)")
    p.add_argument("--out", default=None, help="output folder (default the config's model_root)")
    p.add_argument("--name", default=None, help="base name of the ONNX file (default int_model, or qdq_model)")
    p.add_argument("--format", choices=["int", "qdq"], default="int",
                   help="int: integer operators, equal to step 4 (default); qdq: QuantizeLinear / DequantizeLinear")
    p.add_argument("--weights", choices=["int8", "uint8"], default="int8",
                   help="qdq weights: int8 with zero point 0 (default) or uint8 with zero point 128")
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu", help="onnxruntime provider of --check")
    p.add_argument("--check", action="store_true", help="compare every layer with step 4 on --split")
    p.add_argument("--split", choices=["valid", "train"], default="valid")
    p.add_argument("--batch-size", type=at_least(1), default=8)
    p.add_argument("--threads", type=int, default=0, help="torch / onnxruntime threads (0 = the config's)")
    args, rest = p.parse_with_overrides(argv)
    if args.format != "qdq" and args.weights != "int8":
        p.error("--weights applies to --format qdq only")
    if args.name is None:
        args.name = "qdq_model" if args.format == "qdq" else "int_model"
    return args, rest


class OnnxModel:
    """The exported model behind the evaluator's model interface: ``forward`` runs onnxruntime on the
    images (float pixels 0..255 -> uint8) and returns the head outputs as float32 tensors; ``decode``
    and ``loss`` are the step-4 model's."""

    def __init__(self, data: bytes, model, threads: int = 0, provider: str = "cpu"):
        from gnetmdk.intq.onnx_export import OUTPUT_PREFIX, make_session
        self.sess = make_session(data, threads, provider)
        self.outs = sorted((o.name for o in self.sess.get_outputs() if o.name.startswith(OUTPUT_PREFIX)),
                           key=lambda n: int(n[len(OUTPUT_PREFIX):]))
        self.model, self.training = model, False

    def __call__(self, images):
        import numpy as np
        import torch
        res = self.sess.run(self.outs, {"image": images.cpu().round().clamp(0, 255).to(torch.uint8).numpy()})
        return [torch.from_numpy(np.ascontiguousarray(r)) for r in res]

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def loss(self, pred, targets):
        return self.model.loss(pred, targets.cpu())

    def decode(self, *a, **kw):
        return self.model.decode(*a, **kw)


@tool_main
def main(argv) -> int:
    """Run the tool; returns the exit status (0 ok, 1 check failed, 2 user error)."""
    args, overrides = parse_args(argv)
    from gnetmdk.chip.cli_util import load_eval_model
    if args.check:
        from gnetmdk.intq.onnx_export import check_provider
        try:
            check_provider(args.provider)
        except ValueError as exc:
            return fail(f"--provider {args.provider}: {exc}")
    import torch
    from gnetmdk.checkpoint.io import CheckpointError, load_checkpoint
    from gnetmdk.utils.atomic import atomic_write_set
    from gnetmdk.config import load_config
    from gnetmdk.intq.program import ProgramError
    cfg = load_config(args.config, overrides)
    from gnetmdk.checkpoint.outputs import check_output_folder
    check_output_folder(args.out or cfg.model_root, "the ONNX model", "--out")   # before any work
    threads = args.threads or cfg.threads
    if threads > 0:
        torch.set_num_threads(threads)
    path = args.checkpoint or os.path.join(cfg.checkpoint_dir(4), "best.pth")
    ckpt = load_checkpoint(path, "train the PP-YOLO stages first (train.py --step 2, --cal, --step 3, --step 4)")
    name = (ckpt.get("model_meta") or {}).get("name")
    if name != "ppyolo":
        raise CheckpointError(f"checkpoint '{path}' is a {name!r} model: tools/export_int.py exports PP-YOLO; a "
                              "GNetDet step-4 checkpoint becomes a chip model with tools/convert_to_chip.py")
    model, ckpt = load_eval_model(path, cfg, require_stage="step4")
    try:
        prog = model.integer_program()
    except ProgramError as exc:
        raise CheckpointError(f"checkpoint '{path}': {exc}") from None
    meta = {"classes": list(cfg.VOC_CLASSES), "model_meta": model.meta(), "stage": ckpt.get("stage"),
            "best_map": ckpt.get("best_map"), "tensors": prog["tensors"], "format": args.format}
    if args.format == "qdq":
        meta["weights"] = args.weights
    data = builder(args)(prog, meta=meta).SerializeToString()
    out = args.out or cfg.model_root
    os.makedirs(out, exist_ok=True)
    onnx_path = os.path.join(out, args.name + ".onnx")
    try:
        atomic_write_set({onnx_path: lambda fh: fh.write(data)})
    except OSError as exc:
        raise CheckpointError(f"cannot write '{onnx_path}' ({exc.strerror or exc}): free disk space or pass "
                              "another --out; the previous file is unchanged") from None
    n_ops = len(prog["ops"])
    kind = "QDQ model of" if args.format == "qdq" else "integer ops:"
    print(f"exported {path} (step4, best mAP {ckpt.get('best_map')}, requant {prog['requant']}) -> {onnx_path}: "
          f"{kind} {n_ops} ops, {len(prog['outputs'])} outputs, {len(data) / 2 ** 20:.1f} MiB")
    if not args.check:
        return 0
    report = check(model, prog, cfg, args, threads)
    return 0 if report else 1


def builder(args):
    """The ONNX writer of ``args.format``: ``f(prog, all_layers=False, meta=None) -> ModelProto``."""
    import functools
    from gnetmdk.intq.onnx_export import build_onnx
    from gnetmdk.intq.qdq_export import build_qdq
    return build_onnx if args.format == "int" else functools.partial(build_qdq, weights=args.weights)


#: the QDQ check's goal: share of equal uint8 codes over all layers, and the largest mAP difference
QDQ_MIN_EQUAL = 0.999
QDQ_MAP_TOL = 0.001


def check(model, prog, cfg, args, threads) -> bool:
    """Every layer's codes and every output, step 4's program (torch) vs onnxruntime, over the split;
    then mAP. ``int``: nothing may differ; ``qdq``: the goal :data:`QDQ_MIN_EQUAL` / :data:`QDQ_MAP_TOL`."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader
    from gnetmdk.dataset.dataset import build_dataset, collate
    from gnetmdk.evaluation.evaluator import evaluate_model
    from gnetmdk.intq.onnx_export import make_session
    from gnetmdk.intq.program import run_program
    dataset = build_dataset(cfg, args.split)
    dataset.augment = False
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, num_workers=0, collate_fn=collate)
    write = builder(args)
    sess = make_session(write(prog, all_layers=True), threads, args.provider)
    names = [o.name for o in sess.get_outputs()]
    t0 = time.time()
    mismatches = {op["output"]: 0 for op in prog["ops"]}
    values = {op["output"]: 0 for op in prog["ops"]}
    largest = {op["output"]: 0 for op in prog["ops"]}
    out_bad, out_diff, out_abs = 0, 0.0, 0.0
    n_images = 0
    for images, _, _, _ in loader:
        outs, kept = run_program(prog, images, keep=True)
        res = dict(zip(names, sess.run(names, {"image": images.round().clamp(0, 255).to(torch.uint8).numpy()})))
        for k, v in kept.items():
            d = np.abs(res[k].astype(np.int64) - v.numpy().astype(np.int64))
            mismatches[k] += int((d > 0).sum())
            values[k] += int(d.size)
            largest[k] = max(largest[k], int(d.max()) if d.size else 0)
        for i, o in enumerate(outs):
            d = np.abs(res[f"out{i}"].astype(np.float64) - o.numpy().astype(np.float64))
            out_bad += int((d > 0).sum())
            out_diff = max(out_diff, float(d.max()))
            out_abs = max(out_abs, float(np.abs(o.numpy()).max()))
        n_images += images.shape[0]
    runtime = f"{args.format.upper()} ONNX (onnxruntime {args.provider}" + (
        f", {args.weights} weights)" if args.format == "qdq" else ")")
    print(f"check on {n_images} {args.split} images ({time.time() - t0:.1f}s): codes of every layer, step 4 "
          f"(torch, requant {prog['requant']}) vs {runtime}")
    print(f"{'layer':<36} {'op':<8} {'values':>12} {'mismatches':>10} {'equal':>9} {'max diff':>8}")
    for op in prog["ops"]:
        k = op["output"]
        eq = 1.0 - mismatches[k] / values[k] if values[k] else 1.0
        print(f"{k:<36} {op['op']:<8} {values[k]:>12} {mismatches[k]:>10} {100 * eq:>8.4f}% {largest[k]:>8}")
    total, n_values = sum(mismatches.values()), sum(values.values())
    equal = 1.0 - total / n_values if n_values else 1.0
    print(f"outputs: {out_bad} float32 values differ, largest difference {out_diff:.3g} (largest |output| "
          f"{out_abs:.3g})")
    m4 = evaluate_model(model, loader, dataset, torch.device("cpu"), cfg.conf_thresh, cfg.nms_thresh,
                        cfg.max_detections)["map"]
    mo = evaluate_model(OnnxModel(write(prog).SerializeToString(), model, threads, args.provider), loader, dataset,
                        torch.device("cpu"), cfg.conf_thresh, cfg.nms_thresh, cfg.max_detections)["map"]
    print(f"mAP@0.5: step 4 {m4:.4f}, ONNX {mo:.4f} (difference {mo - m4:+.4f})")
    if args.format == "int":
        ok = total == 0 and out_bad == 0 and m4 == mo
        print(f"{'EQUAL' if ok else 'DIFFERENT'}: {total} code mismatches in {len(mismatches)} layers, {out_bad} output "
              "differences")
        return ok
    ok = equal >= QDQ_MIN_EQUAL and abs(mo - m4) <= QDQ_MAP_TOL
    worst = max(largest.values()) if largest else 0
    print(f"{'WITHIN GOAL' if ok else 'OUTSIDE GOAL'}: {100 * equal:.4f}% of {n_values} codes equal (goal >= "
          f"{100 * QDQ_MIN_EQUAL:g}%), largest code difference {worst}, mAP difference {mo - m4:+.4f} (goal within "
          f"{QDQ_MAP_TOL:g})")
    return ok


if __name__ == "__main__":
    sys.exit(main())
