#!/usr/bin/env python3
"""Where an iteration of the real trainer spends its host time: torch.profiler over a few epochs of
step 1, split into the trainer's named spans (gnetmdk.engine.trainer.SPANS: the copy to the device,
forward + loss, backward, the optimizer step, the hooks' after_step, the read-back and logging of the
iteration before) and the DataLoader's hand-over of the next batch; what is left is host time outside
all of them (Python between the spans, the progress bar). On CUDA it also prints how busy the GPU was
(kernel time over wall time): a busy GPU is the goal, a read-back span that holds most of the wall time
means the host waits for the GPU (good), forward and backward spans that hold it mean the host cannot
launch kernels fast enough.

    python3 benchmarks/profile_trainer.py --config examples/cards.py [--device cpu|cuda] [--iters 40]
        [--top 15] [--json FILE] [overrides...]

The trainer is set up by ``bench_step_time.ready_trainer`` (its hooks, the EMA when the config has it,
no evaluation); one untraced epoch warms it up (workers start, caches fill, cuDNN picks its
kernels), then whole epochs are traced until ``--iters`` iterations ran. Prints milliseconds per
iteration per span, their share of the wall time, and the operators with the most host time.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gnetmdk.config import ConfigError, build_config, load_config_class
from gnetmdk.config.cli import Parser, fail
from gnetmdk.engine.cli import tool_main
from gnetmdk.engine.device import resolve_device
from gnetmdk.engine.trainer import SPANS


def _sibling(name: str):
    """The benchmark script ``name``.py beside this file, as a module: found by its path, so it loads the
    same way when this script runs and when the tests load this file by its path."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                     name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ready_trainer = _sibling("bench_step_time").ready_trainer

#: the DataLoader's own span around handing over a batch (torch.utils.data names it so)
LOADER_SPAN = "enumerate(DataLoader)"


def split_spans(events, wall_us: float, iters: int) -> dict:
    """Host time per iteration in each span, from a profiler's events.

    Args:
        events: ``profile.events()`` (FunctionEvent list); spans are matched by name: the trainer's
            (``SPANS`` values) exactly, the loader's by the prefix ``LOADER_SPAN``.
        wall_us: wall time of the traced iterations, microseconds.
        iters: iterations traced (> 0).
    Returns:
        {"wall_ms": per-iteration wall, "spans": {name: ms per iteration}, "outside_ms": the wall not in
        any span, "share": {name: fraction of the wall}} (names: the SPANS keys and "loader").
    Raises:
        ValueError: iters < 1 or wall_us <= 0.
    """
    if iters < 1 or wall_us <= 0:
        raise ValueError(f"split_spans: iters {iters} and wall_us {wall_us} must be positive")
    names = {v: k for k, v in SPANS.items()}
    total = {k: 0.0 for k in list(SPANS) + ["loader"]}
    for e in events:
        key = names.get(e.name) or ("loader" if e.name.startswith(LOADER_SPAN) else None)
        if key is not None:
            total[key] += e.cpu_time_total        # microseconds; the spans do not nest in one another
    spans = {k: v / iters / 1000.0 for k, v in total.items()}
    wall = wall_us / iters / 1000.0
    outside = wall - sum(spans.values())
    share = {k: v / wall for k, v in spans.items()}
    share["outside"] = outside / wall
    return {"wall_ms": wall, "spans": spans, "outside_ms": outside, "share": share}


def device_busy_us(prof) -> float:
    """The GPU's time over the traced region, microseconds: the "Self CUDA time total" under the
    profiler's table (each kernel counted once); 0 on a CPU."""
    return float(sum(getattr(k, "self_device_time_total", 0.0) or 0.0 for k in prof.key_averages()))


#: aten operators that launch no kernel (views, allocation, metadata): left out of the count
NO_KERNEL = {"aten::" + k for k in (
    "detach", "detach_", "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "slice", "select",
    "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "alias", "empty", "empty_strided",
    "empty_like", "unflatten", "flatten", "split", "chunk", "unbind", "narrow", "resolve_conj", "resolve_neg",
    "lift_fresh", "item", "_local_scalar_dense", "is_nonzero", "result_type", "set_", "contiguous")}


def top_level_ops(events) -> int:
    """aten operators that compute (not in NO_KERNEL), called from outside any other aten operator:
    what Python and autograd dispatch, on CUDA about one kernel launch each; the host's operator
    count per run, the same on any device."""
    n = 0
    for e in events:
        if e.name.startswith("aten::") and e.name not in NO_KERNEL:
            parent = e.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            n += parent is None
    return n


def parse_args(argv):
    """The command line (module docstring): options first, then config overrides (KEY VALUE / KEY=VALUE).

    Returns:
        (argparse.Namespace, [override words]).
    Raises:
        SystemExit(2): one ``error:`` line for a bad option or count.
    """
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=__doc__)
    p.add_argument("--config", default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--iters", type=int, default=40, help="iterations traced, at least (whole epochs; default 40)")
    p.add_argument("--top", type=int, default=15, help="operators listed by host time (default 15)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the split as JSON")
    args, overrides = p.parse_with_overrides(argv)
    if args.iters < 1 or args.top < 0:
        p.error(f"--iters must be at least 1 and --top at least 0 (got {args.iters}, {args.top})")
    return args, overrides


@tool_main
def main(argv) -> int:
    """Profile the trainer (module docstring); returns the exit status (0, or 2 for a bad option or config)."""
    args, overrides = parse_args(argv)
    if args.device:
        overrides = list(overrides) + ["device", args.device]
    with tempfile.TemporaryDirectory() as tmp:
        try:                                        # a user's mistake (config, override, device): one line
            cfg = build_config(load_config_class(args.config), list(overrides) + [
                "checkpoint_root", tmp + "/ck", "log_root", tmp + "/log", "progress", "false",
                "eval_before", "false"], step=1)
            device = resolve_device(cfg)
        except (ConfigError, OSError) as exc:
            return fail(str(exc))
        t = ready_trainer(cfg)                      # as Trainer.run sets it up: the EMA when the config has it
        t.train_one_epoch(0)                        # untraced warm-up
        cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        done, epoch = 0, 1
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            while done < args.iters:
                t.train_one_epoch(epoch)
                done += t.iters_per_epoch
                epoch += 1
            if cuda:
                torch.cuda.synchronize()
            wall_us = (time.perf_counter() - t0) * 1e6
        if t.writer is not None:
            t.writer.close()
    events = prof.events()
    split = split_spans(events, wall_us, done)
    where = torch.cuda.get_device_name(device) if cuda else f"cpu, threads {torch.get_num_threads()}"
    print(f"device {where}, torch {torch.__version__}; {cfg.model_name} {cfg.image_size}px, batch {cfg.batch_size}, "
          f"{cfg.num_workers} loader workers, ema {cfg.ema}; {done} iterations traced")
    print(f"{'span':<12} {'ms/iter':>9} {'share':>7}")
    for k, v in split["spans"].items():
        print(f"{k:<12} {v:9.2f} {split['share'][k]:7.1%}")
    print(f"{'outside':<12} {split['outside_ms']:9.2f} {split['share']['outside']:7.1%}")
    print(f"{'wall':<12} {split['wall_ms']:9.2f}   ({cfg.batch_size * 1000.0 / split['wall_ms']:.1f} img/s under the profiler)")
    split["ops_per_iter"] = top_level_ops(events) / done
    print(f"aten operators {split['ops_per_iter']:7.0f} per iteration, called from outside other operators "
          "and computing (about one kernel launch each on CUDA)")
    if cuda:
        busy = device_busy_us(prof)
        split["gpu_busy"] = busy / wall_us
        print(f"GPU kernels {busy / done / 1000.0:9.2f} ms/iter, busy {split['gpu_busy']:.1%} of the wall")
    if args.top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.json:
        with open(args.json + ".tmp", "w") as fh:     # whole or not at all: a previous file stays until then
            json.dump({"device": where, "torch": torch.__version__, "iters": done, **split}, fh, indent=1)
        os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
