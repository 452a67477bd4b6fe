#!/usr/bin/env python3
"""Data-parallel throughput on this machine: 1 process x 2 threads against 2 processes x 1 thread
(gloo, DistributedDataParallel + synchronised BatchNorm), and the communication share of a step.

    python3 benchmarks/bench_dist.py                      # GNetDet width 0.25 at 224 px, global batch 16
    python3 benchmarks/bench_dist.py --width 0.0625 --batch 8 --iters 10 --json out.json

Also timed, as a reference: 1 process x 1 thread.

What is timed: a full training step (forward, loss, backward, AdamW step) on synthetic chip codes
and targets already in memory (no data loading), median over ``--iters`` steps after ``--warmup``.
Step-1 model (15 BatchNorm layers, DistBatchNorm2d in every mode, so the arithmetic is the same).

Communication share (2 processes): the same step is also timed with DDP's gradient all-reduce off
(``no_sync``) and BatchNorm statistics per process (no collective), the compute-only time;
share = 1 - compute_only / full. The gradient all-reduce alone is also timed on a buffer of the
model's parameter count (the bucket DDP sends).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from gnetmdk.config.cli import Parser
from gnetmdk.engine.cli import tool_main


def _model(width: float, image_size: int):
    from gnetmdk.dist.parallel import freeze_biases_before_bn
    from gnetmdk.dist.syncbn import convert_sync_batchnorm
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.models.gnetdet.model import GNetDet
    torch.manual_seed(0)
    m = GNetDet(3, image_size, width, channels_last=True).to(memory_format=torch.channels_last)
    convert_sync_batchnorm(m)
    freeze_biases_before_bn(m)
    apply_stage(m, STAGES["step1"])
    return m.train()


def _data(n: int, image_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 32, (n, 3, image_size, image_size), generator=g).float()
    targets = torch.zeros(n, 14, 14, 13)
    cells = torch.randint(0, 14, (n, 3, 2), generator=g)
    for i in range(n):
        for r, c in cells[i].tolist():
            targets[i, r, c, 0:5] = torch.tensor([0.5, 0.5, 0.2, 0.2, 1.0])
            targets[i, r, c, 5:10] = targets[i, r, c, 0:5]
            targets[i, r, c, 10 + (r + c) % 3] = 1.0
    return images, targets


def _time_steps(step, iters: int, warmup: int, sync=lambda: None):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return times


def _one_process(args, threads: int) -> dict:
    torch.set_num_threads(threads)
    m = _model(args.width, args.image_size)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    images, targets = _data(args.batch, args.image_size, 0)

    def step():
        loss = m.loss(m(images), targets)["total"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    t = statistics.median(_time_steps(step, args.iters, args.warmup))
    return {"processes": 1, "threads": threads, "step_s": t, "images_per_s": args.batch / t}


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    from gnetmdk.dist.parallel import wrap_ddp
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    m = _model(args.width, args.image_size)
    ddp = wrap_ddp(m, torch.device("cpu"))
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    local = args.batch // world
    images, targets = _data(args.batch, args.image_size, 0)
    images, targets = images[rank * local:(rank + 1) * local], targets[rank * local:(rank + 1) * local]
    barrier = dist.barrier

    def full():
        loss = m.loss(ddp(images), targets)["total"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def compute_only():
        import gnetmdk.dist.syncbn as sb
        old = sb._world
        sb._world = lambda: 1                       # BatchNorm statistics of this process only
        try:
            with ddp.no_sync():                     # no gradient all-reduce
                loss = m.loss(ddp(images), targets)["total"]
                opt.zero_grad(set_to_none=True)
                loss.backward()
            opt.step()
        finally:
            sb._world = old

    t_full = _time_steps(full, args.iters, args.warmup, barrier)
    t_comp = _time_steps(compute_only, args.iters, args.warmup, barrier)
    nparam = sum(p.numel() for p in m.parameters() if p.requires_grad)
    buf = torch.zeros(nparam)
    t_ar = _time_steps(lambda: dist.all_reduce(buf), args.iters, args.warmup)
    # the median over ranks' medians of the slowest rank is what a step costs
    res = torch.tensor([statistics.median(t_full), statistics.median(t_comp), statistics.median(t_ar)],
                       dtype=torch.float64)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)
    if rank == 0:
        f, c, a = res.tolist()
        with open(out, "w") as fh:
            json.dump({"processes": world, "threads": 1, "step_s": f, "images_per_s": args.batch / f,
                       "compute_only_step_s": c, "comm_share": max(0.0, 1 - c / f),
                       "grad_allreduce_s": a, "grad_allreduce_share": a / f, "parameters": nparam}, fh)
    del ddp, full, compute_only   # DDP must be gone before the process group (else SIGABRT at exit)
    import gc
    gc.collect()
    dist.destroy_process_group()


def _two_processes(args) -> dict:
    import tempfile
    import torch.multiprocessing as mp
    from gnetmdk.dist.launch import free_port
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        mp.spawn(_worker, args=(2, free_port(), args, out), nprocs=2)
        with open(out) as fh:
            return json.load(fh)


@tool_main
def main(argv) -> int:
    """Time one process and two, print the table (and --json); returns the exit status."""
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=float, default=0.25, help="GNetDet width_mult (default 0.25, the example model)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=16, help="global batch (split over the processes)")
    p.add_argument("--iters", type=int, default=12, help="timed steps per mode (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads-single", type=int, default=2, help="threads of the one-process run")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    one = _one_process(args, args.threads_single)
    single = _one_process(args, 1)
    two = _two_processes(args)
    load = os.getloadavg()
    res = {"model": f"GNetDet {args.image_size}px width {args.width}", "global_batch": args.batch,
           "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "load_avg_1min_after": round(load[0], 2), "torch": torch.__version__, "one": one, "one_1thread": single,
           "two": two,
           "speedup": two["images_per_s"] / one["images_per_s"]}
    print(f"model {res['model']}, global batch {args.batch}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"load average {load[0]:.2f} after the runs")
    print("| run | step (s) | images/s |")
    print("|---|---|---|")
    print(f"| 1 process x {one['threads']} threads | {one['step_s']:.3f} | {one['images_per_s']:.1f} |")
    print(f"| 2 processes x 1 thread (gloo, DDP + SyncBN) | {two['step_s']:.3f} | {two['images_per_s']:.1f} |")
    print(f"| (reference) 1 process x 1 thread | {single['step_s']:.3f} | {single['images_per_s']:.1f} |")
    print(f"speed-up 2x1 over 1x2: {res['speedup']:.2f}; communication share of a 2-process step: "
          f"{100 * two['comm_share']:.1f}% (compute-only step {two['compute_only_step_s']:.3f} s); gradient "
          f"all-reduce of {two['parameters']} floats alone {1e3 * two['grad_allreduce_s']:.2f} ms "
          f"({100 * two['grad_allreduce_share']:.1f}% of a step)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
