#!/usr/bin/env python3
"""Peak memory and step time of a training step: BatchNorm + activation as built, in-place activated
BatchNorm (gnetmdk.layers.inplace_abn), the recomputed stem (gnetmdk.layers.stem), both, and
activation checkpointing of the same blocks. Prints a table; asserts nothing.

    python3 benchmarks/bench_memory.py [--batch 8] [--steps 2] [--rounds 3] [--threads 2]
        [--variants bn,dist_bn,abn,stem,abn_stem,ckpt,ckpt_stem] [--gpu-batch-ppyolo 8] [--gpu-batch-gnetdet 64]
        [--gpu-only]

Variants (the model's function is the same in all):
  bn       the model as built (torch BatchNorm2d, then the activation);
  dist_bn  BatchNorm converted to DistBatchNorm2d (the trainer's CPU BatchNorm, float64 statistics);
  abn      convert_inplace_abn: BatchNormAct2d in place of BatchNorm + activation;
  stem     convert_recompute_stem (config ``recompute_stem``): the first conv-BN-activation(-pool)
           block keeps only the image and recomputes its conv in the backward pass, chunk by chunk
           (gnetmdk.layers.stem); the other layers as ``dist_bn``;
  abn_stem both;
  ckpt     torch.utils.checkpoint (non-reentrant) around every conv-BN-activation block that ``abn``
           converts (a GNetDet sublayer, pool included; a PP-YOLO ConvBNLayer with an activation):
           only the block's input is kept, the block runs its forward twice. (A caveat outside this
           benchmark: the recomputation updates BatchNorm's running statistics a second time.)
  ckpt_stem the same around the first block only (what ``stem`` recomputes), other layers as ``dist_bn``.

CPU (always): GNetDet 448 px, width 1.0, 20 classes, channels_last, AdamW, one training step =
forward + loss + backward + optimizer step. Peak memory is the peak resident set (VmHWM of
/proc/self/status, or ru_maxrss) of a fresh subprocess per variant (RSS never shrinks, so variants
cannot share a process), printed whole and as "step memory", less the RSS before the first step
(Python, torch, model, batch). Each variant runs twice: with glibc's default allocator (what a
training run sees; freed heap blocks below glibc's dynamic mmap threshold stay in RSS) and with
``MALLOC_MMAP_THRESHOLD_=131072`` (every freed tensor leaves RSS: the peak of live memory). The
subprocess also reports the bytes autograd keeps for backward after one forward (distinct storages,
through saved_tensors_hooks), with the int64 max-pool indices apart. Step times come from one
process that runs the variants in alternating blocks (A B C, C B A, ...), the median per variant,
so a change of machine speed meets all variants alike. On a machine whose cores other jobs share,
``--threads 1`` gives steadier times (every parallel op waits for its slowest thread).

GPU (when torch sees one): torch.cuda.max_memory_allocated over one step after a warm-up step, and
the step time (synchronised), for PP-YOLO r50vd at 608 px batch 8 and GNetDet 448 x1.0 batch 64,
bfloat16 autocast off (float32). Without a GPU those lines say they were skipped.

Goal: at least 35% less peak training memory at no more than 10% more step time. On the CPU the
variants that leave torch's BatchNorm (dist_bn, stem, abn_stem, ckpt_stem) use DistBatchNorm2d, as the trainer
does; on a GPU, torch's BatchNorm2d (one GPU, as the trainer).
"""
import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

ALL_VARIANTS = ("bn", "dist_bn", "abn", "stem", "abn_stem", "ckpt", "ckpt_stem")


# ------------------------------------------------------------------------------ models and batches
def build(model_name: str, variant: str, device: str, seed: int = 0):
    """(model, images, targets) for one variant, same weights for every variant (seeded)."""
    torch.manual_seed(seed)
    if model_name == "gnetdet":
        from gnetmdk.models.gnetdet.model import GNetDet
        model = GNetDet(20, 448, 1.0, channels_last=True)
    elif model_name == "ppyolo":
        from gnetmdk.models.ppyolo.model import ppyolo_r50vd
        model = ppyolo_r50vd()
    else:
        raise ValueError(f"unknown model {model_name!r}")
    if variant in ("dist_bn", "stem", "abn_stem", "ckpt_stem") and device == "cpu":
        from gnetmdk.dist.syncbn import convert_sync_batchnorm
        convert_sync_batchnorm(model)                                # the trainer's CPU BatchNorm
    if variant in ("abn", "abn_stem"):
        from gnetmdk.layers.inplace_abn import convert_inplace_abn, count_inplace_abn
        convert_inplace_abn(model)
        assert count_inplace_abn(model) > 0
    if variant in ("stem", "abn_stem"):
        from gnetmdk.layers.stem import convert_recompute_stem
        assert convert_recompute_stem(model) == 1
    elif variant in ("ckpt", "ckpt_stem"):
        blocks = checkpoint_blocks(model)
        for block in blocks[:1] if variant == "ckpt_stem" else blocks:
            block.forward = functools.partial(_checkpointed, block.forward)
    elif variant not in ("bn", "dist_bn", "abn", "abn_stem"):
        raise ValueError(f"unknown variant {variant!r} (one of {ALL_VARIANTS})")
    return model.to(device).train()


def checkpoint_blocks(model):
    """The conv-BN-activation blocks that convert_inplace_abn converts (GNetDet sublayers with BN,
    PP-YOLO ConvBNLayers with an activation)."""
    from gnetmdk.models.gnetdet.model import Sublayer
    from gnetmdk.models.ppyolo.common import ConvBNLayer
    return [m for m in model.modules()
            if (isinstance(m, Sublayer) and m.bn is not None) or (isinstance(m, ConvBNLayer) and m.act)]


def _checkpointed(forward, x):
    from torch.utils.checkpoint import checkpoint
    return checkpoint(forward, x, use_reentrant=False)


def make_batch(model_name: str, batch: int, device: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    if model_name == "gnetdet":
        images = torch.randint(0, 32, (batch, 3, 448, 448), generator=g).float()
        targets = torch.zeros(batch, 14, 14, 30)
        targets[:, 4:9, 5:10, [0, 1, 5, 6]] = 0.5                    # one object region per image
        targets[:, 4:9, 5:10, [2, 3, 7, 8]] = 0.3
        targets[:, 4:9, 5:10, [4, 9, 10]] = 1.0
    else:
        images = torch.rand(batch, 3, 608, 608, generator=g) * 255
        targets = torch.full((batch, 50, 5), -1.0)
        xy = torch.rand(batch, 8, 2, generator=g) * 0.6
        wh = torch.rand(batch, 8, 2, generator=g) * 0.3 + 0.05
        targets[:, :8, 0] = torch.randint(0, 80, (batch, 8), generator=g).float()
        targets[:, :8, 1:3], targets[:, :8, 3:5] = xy, xy + wh
    return images.to(device), targets.to(device)


def train_step(model, opt, images, targets):
    loss = model.loss(model(images), targets)["total"]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ measurements
def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident set (``VmRSS``) or its peak (``VmHWM``) in MiB."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024     # Linux: KiB


def saved_bytes(model, images, targets):
    """(all, int64) bytes of the distinct storages that autograd keeps for backward after one forward
    + loss (parameters and buffers excluded; tensors saved by graph branches that were dropped
    during the forward, e.g. a discarded output, are not counted); the graph is then freed."""
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    packed = []

    def pack(t):
        alias = t.detach()              # an alias without grad_fn: no reference cycle through the graph
        packed.append(weakref.ref(alias))
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(model(images), targets)["total"]
    seen = {}
    for ref in packed:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
    del loss
    total = sum(b for b, _ in seen.values())
    int64 = sum(b for b, d in seen.values() if d == torch.int64)
    return total, int64


def child(args) -> None:
    """One variant's memory in this (fresh) process; prints one JSON line."""
    torch.set_num_threads(args.threads)
    model = build("gnetdet", args.child, "cpu")
    images, targets = make_batch("gnetdet", args.batch, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    before = rss_mb()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_step(model, opt, images, targets)
        times.append(time.perf_counter() - t0)
    peak = rss_mb("VmHWM")
    saved, int64 = saved_bytes(model, images, targets)          # after the peak was read
    print(json.dumps({"variant": args.child, "peak_mb": peak, "before_mb": before,
                      "saved_mb": saved / 2 ** 20, "int64_mb": int64 / 2 ** 20, "step_s": times}))


def cpu_memory(args, variants, env_extra=None):
    """{variant: child's JSON} with one fresh subprocess per variant (``env_extra``: added environment)."""
    out = {}
    env = dict(os.environ, **(env_extra or {}))
    for v in variants:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", v, "--batch", str(args.batch),
               "--steps", str(args.steps), "--threads", str(args.threads)]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if r.returncode:
            raise SystemExit(f"variant {v} failed:\n{r.stderr[-3000:]}")
        out[v] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def interleaved_times(model_name, variants, batch, device, steps, rounds, warmup=1):
    """Median seconds per step of each variant, timed in alternating blocks in one process."""
    images, targets = make_batch(model_name, batch, device)
    models = {v: build(model_name, v, device) for v in variants}
    opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-5) for v, m in models.items()}
    for v in variants:
        for _ in range(warmup):
            train_step(models[v], opts[v], images, targets)
    times = {v: [] for v in variants}
    for r in range(rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                train_step(models[v], opts[v], images, targets)
            sync(device)
            times[v].append((time.perf_counter() - t0) / steps)
    return {v: statistics.median(t) for v, t in times.items()}


def gpu_run(model_name, variants, batch, steps, rounds):
    """{variant: (max_memory_allocated MiB of one step, median step seconds)} on cuda."""
    res = {}
    for v in variants:
        torch.cuda.empty_cache()
        model = build(model_name, v, "cuda")
        images, targets = make_batch(model_name, batch, "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        train_step(model, opt, images, targets)                 # warm-up: optimizer state, kernels
        sync("cuda")
        torch.cuda.reset_peak_memory_stats()
        train_step(model, opt, images, targets)
        sync("cuda")
        peak = torch.cuda.max_memory_allocated() / 2 ** 20
        del model, opt, images, targets
        res[v] = [peak, None]
    t = interleaved_times(model_name, variants, batch, "cuda", steps, rounds)
    for v in variants:
        res[v][1] = t[v]
    return res


def report(title, rows, base):
    """Print rows {variant: (peak, step_s, extra)} relative to ``base``."""
    print(title)
    b_peak, b_time = rows[base][0], rows[base][1]
    for v, (peak, step, extra) in rows.items():
        print(f"  {v:8s} peak {peak:9.1f} MiB ({100 * (peak / b_peak - 1):+6.1f}%)   step {step:7.3f} s "
              f"({100 * (step / b_time - 1):+6.1f}%)   {extra}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8, help="CPU GNetDet batch (default 8)")
    p.add_argument("--steps", type=int, default=2, help="steps per timed block / per memory run")
    p.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    p.add_argument("--threads", type=int, default=max(1, torch.get_num_threads()))
    p.add_argument("--variants", default=",".join(ALL_VARIANTS))
    p.add_argument("--gpu-batch-ppyolo", type=int, default=8)
    p.add_argument("--gpu-batch-gnetdet", type=int, default=64)
    p.add_argument("--gpu-only", action="store_true", help="skip the CPU part (the GPU lines only)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in ALL_VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choose from {ALL_VARIANTS}")
    torch.set_num_threads(args.threads)
    if not args.gpu_only:
        cpu_part(args, variants)
    gpu_part(args, variants)


def cpu_part(args, variants):
    """The CPU table (module docstring)."""
    print(f"torch {torch.__version__}, {args.threads} CPU thread(s); GNetDet 448 x1.0, batch {args.batch}, "
          f"channels_last, AdamW")
    mem = cpu_memory(args, variants)
    # glibc keeps freed heap memory below its (dynamic, up to 32 MiB) mmap threshold: RSS then counts
    # tensors already freed. A fixed 128 KiB threshold returns every freed tensor to the system, so
    # that peak RSS is the peak of live memory (plus the process's fixed part).
    live = cpu_memory(args, variants, {"MALLOC_MMAP_THRESHOLD_": "131072"})
    times = interleaved_times("gnetdet", variants, args.batch, "cpu", args.steps, args.rounds)
    base = "dist_bn" if "dist_bn" in variants else variants[0]
    print(f"CPU, relative to {base} (the trainer's CPU BatchNorm); peak RSS of a fresh process per variant, "
          "step memory = peak - RSS before the first step:")
    pct = lambda a, b: f"{100 * (a / b - 1):+6.1f}%"  # noqa: E731
    for v in variants:
        m, l = mem[v], live[v]
        sm, sl = m["peak_mb"] - m["before_mb"], l["peak_mb"] - l["before_mb"]
        bm = mem[base]["peak_mb"] - mem[base]["before_mb"]
        bl = live[base]["peak_mb"] - live[base]["before_mb"]
        print(f"  {v:8s} step memory: glibc default {sm:7.1f} MiB ({pct(sm, bm)}), live (fixed mmap threshold) "
              f"{sl:7.1f} MiB ({pct(sl, bl)});  peak RSS {m['peak_mb']:7.1f} / {l['peak_mb']:7.1f} MiB;  "
              f"step {times[v]:6.3f} s ({pct(times[v], times[base])});  saved for backward {m['saved_mb']:7.1f} MiB "
              f"(pool indices {m['int64_mb']:.1f})")


def gpu_part(args, variants):
    """The GPU tables (module docstring), or the line saying they were skipped."""
    if torch.cuda.is_available():
        for name, batch in (("ppyolo", args.gpu_batch_ppyolo), ("gnetdet", args.gpu_batch_gnetdet)):
            gv = [v for v in variants if v != "dist_bn"]
            res = gpu_run(name, gv, batch, args.steps, args.rounds)
            label = "PP-YOLO r50vd 608 px" if name == "ppyolo" else "GNetDet 448 x1.0"
            report(f"GPU {torch.cuda.get_device_name()}: {label}, batch {batch}, max_memory_allocated:",
                   {v: (pk, st, "") for v, (pk, st) in res.items()}, gv[0])
    else:
        print("GPU: skipped (torch sees no CUDA device): PP-YOLO r50vd 608 px batch 8 and GNetDet 448 x1.0 batch 64")


if __name__ == "__main__":
    main()
