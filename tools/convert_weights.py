#!/usr/bin/env python3
"""Convert PaddlePaddle PP-YOLO weights (.pdparams / .pdema) into a gnetmdk checkpoint, without paddle.

    python3 tools/convert_weights.py -f examples/ppyolo_voc.py -c ppyolo_r50vd_dcn_2x_coco.pdparams -oc 00.pth -nc 20
    python3 tools/convert_weights.py -f examples/ppyolo_cards.py -c ResNet18_vd_pretrained.pdparams \\
        -oc checkpoint/step0/best.pth --only-backbone

-f CONFIG: the configs.py whose PP-YOLO (``model_name ppyolo`` and its ``ppyolo`` section) receives the
weights; -c: the Paddle file (read by a restricted unpickler that admits only dicts, numpy arrays and
scalars: a file that asks for anything else is refused, never executed; gnetmdk.checkpoint.paddle);
-oc: the checkpoint to write (a gnetmdk checkpoint of stage "step0": ``load`` it, or put it at
checkpoint/step0/best.pth as step 1's pretrained model); -nc N: the class count of the converted head
(default the config's; the file's class rows are kept for the first min(C, N) classes, the rest
initialised as our head initialises them); --only-backbone: take the backbone alone (ImageNet files).

Every mapped tensor is checked for its shape; unmatched Paddle tensors, model tensors left unset and
mis-shaped ones are listed, and the tool exits 1 without writing when there are any (outside what
--only-backbone leaves out on purpose). Exit status: 0 written; 1 mismatches; 2 a user error.
"""
from __future__ import annotations

import os
import sys

from gnetmdk.config.cli import Parser, at_least, fail
from gnetmdk.engine.cli import tool_main


def parse_args(argv):
    """Parse the command line (see the module docstring); config overrides are returned separately."""
    p = Parser(description=__doc__.split("\n")[0], formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
               epilog=__doc__)
    p.add_argument("-f", "--config", required=True, help="configs.py of the PP-YOLO that receives the weights")
    p.add_argument("-c", "--ckpt", required=True, help="Paddle weights: .pdparams or .pdema")
    p.add_argument("-oc", "--out", required=True, help="the gnetmdk checkpoint to write (.pth)")
    p.add_argument("-nc", "--num-classes", type=at_least(1), default=None,
                   help="classes of the converted head (default: the config's VOC_CLASSES)")
    p.add_argument("--only-backbone", action="store_true", help="take the backbone alone (ImageNet weights)")
    p.add_argument("--class-rows", choices=["keep", "init"], default="keep",
                   help="keep the file's class rows for the first min(C, N) classes, or initialise all of them")
    return p.parse_with_overrides(argv)


@tool_main
def main(argv) -> int:
    """Run the tool; returns the exit status (0 written, 1 mismatches, 2 user error)."""
    args, overrides = parse_args(argv)
    import torch
    from gnetmdk.checkpoint.io import CheckpointError, save_checkpoint
    from gnetmdk.checkpoint.paddle import PaddleFormatError, read_paddle_params
    from gnetmdk.config import ConfigError, load_config
    from gnetmdk.models import model_from_config
    from gnetmdk.models.ppyolo.convert import convert_paddle_state
    cfg = load_config(args.config, overrides)
    if cfg.model_name != "ppyolo":
        raise ConfigError(f"config '{args.config}' trains {cfg.model_name!r}: convert_weights maps PaddleDetection "
                          "PP-YOLO weights, so the config needs model_name 'ppyolo'")
    n = args.num_classes or cfg.num_classes
    torch.manual_seed(cfg.seed)
    model = model_from_config(cfg, num_classes=n)
    try:
        params = read_paddle_params(args.ckpt)
    except PaddleFormatError as exc:
        raise CheckpointError(str(exc)) from None
    state, report = convert_paddle_state(params, model, n, args.only_backbone, class_rows=args.class_rows)
    print(report.format())
    if not report.ok:
        print(f"error: {args.ckpt} does not map onto this PP-YOLO (above); nothing was written: check the config's "
              "ppyolo section (depth, dcn_v2_stages, iou_aware, anchors) against the file's model", file=sys.stderr)
        return 1
    model.load_state_dict(state, strict=True)
    config = cfg.to_dict()
    if n != cfg.num_classes:
        config["VOC_CLASSES"] = [f"class{i}" for i in range(n)]
    try:
        save_checkpoint(args.out, {"stage": "step0", "step": 0, "model_meta": model.meta(),
                                   "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                                   "caps": [], "config": config, "epoch": 0, "iteration": 0, "best_map": None,
                                   "map": None, "entry_map": None, "world_size": 1,
                                   "source": {"paddle_file": os.path.abspath(args.ckpt),
                                              "only_backbone": bool(args.only_backbone)}})
    except OSError as exc:
        return fail(f"cannot write '{args.out}' ({exc.strerror or exc}): free disk space or choose another -oc")
    print(f"wrote {args.out} ({n} classes{', backbone only' if args.only_backbone else ''})")
    if cfg.ppyolo.coord_conv and not args.only_backbone:
        print(f"note: CoordConv channels span {'[-1, 1]' if cfg.ppyolo.coord_range == 'full' else '[-1, -0.5]'} "
              f"(ppyolo.coord_range {cfg.ppyolo.coord_range}); PaddleDetection's add_coord spans [-1, -0.5] since "
              "2021: weights trained by it compute their outputs with ppyolo.coord_range paddle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
