#!/usr/bin/env python3
"""Step time of step 3 (quantized weights and 5-bit activations) over step 1 (float), same model and
batch, and data-loading images/s against training images/s. Prints ratios; asserts nothing.

The two steps are timed in alternating blocks (step 1, step 3, then step 3, step 1, ...), and the
ratio printed is the median of the blocks' ratios: on a shared or throttling machine, timing all of
step 1 and then all of step 3 let a change of speed in between pass for a difference between them
(one box gave 1.10, 1.26 and 1.58 in three back-to-back runs of the old sequential form).

The loader is timed twice: alone (can it keep up at all?) and in the loop, as the trainer runs it,
with each step's batch drawn from the DataLoader (that loop is timed in one block, after the rounds).
On a small machine the two can disagree: workers that load fast alone may still take cores from the
training threads (docs/training.md).

    python3 benchmarks/bench_step_time.py --config examples/cards.py [--device cpu|cuda] [--iters 20]
        [--rounds 4] [--batchnorm] [--trainer] [overrides...]

On CUDA every timed block ends with torch.cuda.synchronize(), and the run also times step 1 under
bf16 autocast against float32 (--device cuda, or --amp on any device). ``--trainer`` times the real
trainer (gnetmdk.engine.trainer.Trainer: its loader, logging and one read-back per iteration) on the
same model and batch size, against its bare step.

For GNetDet the step-3 ratio has a peer beside it: torch.ao's eager-mode QAT of the same float model
(fused conv + ReLU with per-channel int8 weight fake quantization and fused observer + fake-quantize
activations, :func:`ao_peer`) over its own float step, timed the same way; ours should be the smaller.

Goals: step3 / step1 <= 1.15; on a GPU also trainer / bare step >= 0.9, loader / bare step >= 1.5,
bf16 / fp32 step-1 speed >= 1.25 (448 px, width 1.0, batch 32 on the cards images).
"""
import argparse
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader

from gnetmdk.config import build_config, load_config_class
from gnetmdk.config.cli import Parser
from gnetmdk.dataset.dataset import build_dataset, collate, seed_worker
from gnetmdk.dist.sampler import EpochBatches, GlobalBatchSampler
from gnetmdk.engine.calibration import calibrate_caps
from gnetmdk.engine.cli import tool_main
from gnetmdk.engine.device import configure_backends, resolve_device
from gnetmdk.engine.runtime import keep_freed_memory
from gnetmdk.engine.stages import STAGES, apply_stage
from gnetmdk.models import model_from_config


#: epochs the loader is timed over, in one chained iteration (EpochBatches.chain_to)
LOAD_EPOCHS = 4

#: autocast dtype of the timed steps (None: float32); set by main for the bf16 comparison
AUTOCAST = {}


def sync(device) -> None:
    """Wait for the device (CUDA): a timer read after this measures the work, not its queueing."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train_step(model, opt, images, targets):
    """One training step as the trainer takes it: forward, loss, backward, optimizer step (under
    autocast when ``AUTOCAST`` names a dtype for this model)."""
    dtype = AUTOCAST.get(id(model))
    if dtype is not None:
        with torch.autocast(images.device.type, dtype=dtype):
            loss = model.loss(model(images), targets)["total"]
    else:
        loss = model.loss(model(images), targets)["total"]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def time_interleaved(models, batch, iters, rounds, warmup=3):
    """Seconds per training step of each model, timed in alternating blocks.

    Each of the ``rounds`` rounds runs one block of ``max(1, iters // rounds)`` steps of every model
    (the remainder of ``iters`` is not run), in the order given for even rounds and reversed for odd
    ones (A B, B A, ...; an even number of rounds puts each model first equally often), so that a
    change in the machine's speed during the run reaches all models alike instead of whichever ran
    last. Returns one list per model of its per-round seconds per step.
    """
    images, targets = batch
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-5) for m in models]
    for model, opt in zip(models, opts):
        model.train()
        for _ in range(warmup):
            train_step(model, opt, images, targets)
    per_round = max(1, iters // rounds)
    times = [[] for _ in models]
    for r in range(rounds):
        order = range(len(models)) if r % 2 == 0 else reversed(range(len(models)))
        for j in order:
            sync(images.device)
            t0 = time.perf_counter()
            for _ in range(per_round):
                train_step(models[j], opts[j], images, targets)
            sync(images.device)
            times[j].append((time.perf_counter() - t0) / per_round)
    return times


def summarize_rounds(base, other):
    """Per-round seconds of two models -> (median base, median other, median of the rounds' ratios
    other / base, lowest ratio, highest ratio). A round's two blocks ran back to back, so its ratio is
    what a drift of the machine's speed disturbs least; the median drops the rounds a burst hit.
    """
    ratios = [b / a for a, b in zip(base, other)]
    return (statistics.median(base), statistics.median(other), statistics.median(ratios), min(ratios),
            max(ratios))


def time_loop(model, loader, iters, device, warmup=2):
    """Seconds per training step with each batch drawn from ``loader`` and copied to ``device`` as the
    trainer copies it (uint8 codes, non-blocking, float there); with an EpochBatches sampler, in one
    iteration over as many epochs as it takes (the trainer's chained loading), else a new pass when
    the loader runs out."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()
    chain = isinstance(loader.batch_sampler, EpochBatches)
    if chain:
        loader.batch_sampler.chain_to = 1 + (warmup + iters) // max(1, len(loader))
    batches = iter(loader)
    if chain:
        loader.batch_sampler.chain_to = None
    for i in range(warmup + iters):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
        try:
            images, targets, _, _ = next(batches)
        except StopIteration:
            batches = iter(loader)
            images, targets, _, _ = next(batches)
        train_step(model, opt, images.to(device, non_blocking=True).float(), targets.to(device, non_blocking=True))
    sync(device)
    return (time.perf_counter() - t0) / iters


def ready_trainer(cfg):
    """A step-1 Trainer of ``cfg`` set up as Trainer.run sets it up before its first epoch (data, a
    fresh model, optimizer and schedule, every hook's before_train: the EMA when the config has it),
    for timing train_one_epoch; also used by benchmarks/profile_trainer.py."""
    from gnetmdk.engine.trainer import Trainer
    t = Trainer(cfg)
    t.build_data()
    t.build_model()
    t.iteration, t.start_epoch, t.start_batch = 0, 0, 0
    t.setup_optimizer()
    for hook in t.hooks:
        hook.before_train()
    return t


def time_trainer(cfg, overrides, iters: int, batch=None, rounds: int = 4):
    """Images/s of the real trainer (step 1, a fresh model, no evaluation) over ``iters`` iterations
    after one warm-up epoch: its loader (persistent workers), its per-iteration work (deferred
    read-back, EMA when on, tensorboard) and the device it resolves. ``overrides``: the command line's,
    so the trainer's config is the benchmark's.

    With ``batch`` ((images, targets) on the device) it also times the bare step (:func:`time_interleaved`,
    ``rounds`` rounds) of a copy of the trainer's own model, built and prepared as the trainer trains it
    (its BatchNorm as gnetmdk.layers.prepare.prepare_model converts it: DistBatchNorm2d on a CPU, whose
    exact statistics cost more than torch's BatchNorm2d kernel), and returns (images/s, seconds per bare
    step); without, (images/s, None)."""
    import copy
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        t = ready_trainer(build_config(type(cfg), list(overrides) + [
            "checkpoint_root", tmp + "/ck", "log_root", tmp + "/log", "progress", "false", "eval_before", "false"],
            step=1))
        bare = None
        if batch is not None:
            twin = copy.deepcopy(t.model)
            bare = statistics.median(time_interleaved([twin], batch, iters, rounds)[0])
            del twin
        t.train_one_epoch(0)                               # warm-up: workers start, caches fill
        rates, epoch, done = [], 1, 0
        while done < iters:
            r = t.train_one_epoch(epoch)
            rates.append((r["images_per_s"], t.iters_per_epoch))
            done += t.iters_per_epoch
            epoch += 1
        if t.writer is not None:
            t.writer.close()
    return sum(r * n for r, n in rates) / sum(n for _, n in rates), bare


def ao_peer(float_model):
    """The peer for the step-3 ratio: torch.ao's eager-mode QAT of the same float GNetDet.

    A twin of ``float_model`` (a BatchNorm-less GNetDet in step 1's mode) with each sublayer's conv a
    plain ``nn.Conv2d`` holding the same weights and its activation an ``nn.ReLU``, and a copy of that
    twin through ``fuse_modules_qat`` (conv + ReLU) and ``prepare_qat`` with torch's x86 QAT qconfig:
    per-channel int8 weight fake quantization and fused moving-average observer + fake-quantize
    modules on the activations. Returns (twin, its QAT model), both in training mode on the model's
    device.
    """
    import copy
    from torch.ao.quantization import fuse_modules_qat, get_default_qat_qconfig, prepare_qat
    twin = copy.deepcopy(float_model)
    for sub in twin.layers:
        old = sub.conv
        conv = torch.nn.Conv2d(old.in_channels, old.out_channels, old.kernel_size, old.stride, old.padding,
                               bias=old.bias is not None).to(old.weight.device)
        conv.load_state_dict({k: v for k, v in old.state_dict().items() if k in ("weight", "bias")})
        sub.conv, sub.relu = conv, torch.nn.ReLU()
    twin.set_gains = lambda: False           # the chip's gains belong to our quantizers, not to the peer's
    twin._code_output_scale = None
    qat = copy.deepcopy(twin)
    for sub in qat.layers:
        fuse_modules_qat(sub, [["conv", "relu"]], inplace=True)
    import warnings
    with warnings.catch_warnings():          # torch's notes that eager-mode QAT is deprecated in favour of torchao
        warnings.simplefilter("ignore")
        qat.qconfig = get_default_qat_qconfig("x86")
        prepare_qat(qat, inplace=True)
    return twin.train(), qat.train()


#: aten operators that only describe memory (views, aliases, empty buffers): no kernel is launched for them
VIEW_OPS = frozenset({"view", "_unsafe_view", "as_strided", "t", "transpose", "permute", "expand", "unsqueeze",
                      "squeeze", "slice", "select", "alias", "detach", "reshape", "split", "unbind",
                      "split_with_sizes", "unflatten", "_reshape_alias", "lift_fresh", "empty", "empty_like",
                      "empty_strided"})


def count_ops(model, batch, warmup: int = 2) -> int:
    """Computing operators of one training step of ``model`` (forward, loss, backward, AdamW step; the
    aten calls that reach the dispatcher, less :data:`VIEW_OPS`) on the quantizers' device path
    (gnetmdk.gti.quantize.force_device_path, so that a CPU counts what an accelerator runs; there each
    is at least one kernel launch), after ``warmup`` steps (caches filled, optimizer state made)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from gnetmdk.gti.quantize import force_device_path

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in VIEW_OPS:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    images, targets = batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)   # as on CUDA, where foreach is the default
    model.train()
    one_pass = getattr(model, "batch_weight_quant", False)
    if one_pass is None:        # GNetDet's default: one pass for every conv's weights off the CPU
        model.batch_weight_quant = True
    try:
        with force_device_path():
            for _ in range(warmup):
                train_step(model, opt, images, targets)
            with Count():
                train_step(model, opt, images, targets)
    finally:
        if one_pass is None:
            model.batch_weight_quant = None
    return Count.n


def time_batchnorm(cfg, batch, iters, rounds):
    """Step 1 of the same model with no BatchNorm, torch's BatchNorm2d and DistBatchNorm2d (what
    every CPU run trains with), timed in alternating blocks; then single passes over a tensor of the
    first layer's output shape (batch x 16 x 224 x 224 at width 0.25), to compare the reductions a
    BatchNorm could be built from. Prints ms; returns nothing."""
    from gnetmdk.dist.syncbn import convert_sync_batchnorm
    models = []
    for kind in ("none", "torch", "dist"):
        torch.manual_seed(0)
        m = model_from_config(cfg, use_bn=kind != "none").to(batch[0].device)
        apply_stage(m, STAGES["step1"])
        if kind == "dist":
            convert_sync_batchnorm(m)
        if cfg.channels_last:
            m.to(memory_format=torch.channels_last)
        models.append(m)
    times = time_interleaved(models, batch, iters, rounds)
    for name, ts in zip(("no BatchNorm", "torch BatchNorm2d", "DistBatchNorm2d"), times):
        print(f"step 1, {name:<18} {statistics.median(ts) * 1000:8.1f} ms/step (median of rounds)")
    images = batch[0]
    c = next(mod for mod in models[0].modules() if isinstance(mod, torch.nn.Conv2d)).out_channels
    x = (torch.randn(images.shape[0], c, *images.shape[2:], device=images.device) + 3).contiguous(
        memory_format=torch.channels_last)
    m0 = x.mean((0, 2, 3)).view(1, -1, 1, 1)
    x2 = x.permute(0, 2, 3, 1).reshape(-1, c)
    passes = {
        "elementwise x - mean": lambda: torch.sub(x, m0),
        "per-channel sum, float32": lambda: x.sum(dim=(0, 2, 3)),
        "per-channel sum, float64": lambda: x.sum(dim=(0, 2, 3), dtype=torch.float64),
        "torch.var_mean": lambda: torch.var_mean(x, dim=(0, 2, 3), correction=0),
        "vector_norm": lambda: torch.linalg.vector_norm(x, dim=(0, 2, 3)),
        "x^T x (matrix product)": lambda: x2.T @ x2,
    }
    print(f"one pass over a {tuple(x.shape)} channels-last float32 tensor:")
    for name, fn in passes.items():
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        print(f"  {name:<26} {(time.perf_counter() - t0) / 20 * 1000:7.2f} ms")


def parse_args(argv):
    """The command line (module docstring): options first, then config overrides (KEY VALUE / KEY=VALUE).

    Returns:
        (argparse.Namespace, [override words]).
    Raises:
        SystemExit(2): one ``error:`` line for a bad option or count.
    """
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None)
    p.add_argument("--iters", type=int, default=20, help="timed steps per model (default 20)")
    p.add_argument("--rounds", type=int, default=4,
                   help="blocks the timed steps are split into, alternating step 1 and step 3 (default 4)")
    p.add_argument("--batchnorm", action="store_true",
                   help="also time step 1 with no BatchNorm, torch's and DistBatchNorm2d, and single reductions")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where to time (default: the config's device, auto = cuda when torch sees a GPU)")
    p.add_argument("--amp", action="store_true", help="also time step 1 under bf16 autocast (always on CUDA)")
    p.add_argument("--trainer", action="store_true", help="also time the real trainer's images/s (always on CUDA)")
    p.add_argument("--ops", action="store_true",
                   help="also count the operators of one training step of step 1, step 3 and torch.ao's pair "
                        "(on the quantizers' device path: what an accelerator launches)")
    args, overrides = p.parse_with_overrides(argv)
    if args.iters < 1 or args.rounds < 1:
        p.error(f"--iters and --rounds must be at least 1 (got --iters {args.iters} --rounds {args.rounds})")
    return args, overrides


@tool_main
def main(argv) -> int:
    """Time the steps (module docstring); returns the exit status (0, or 2 for a bad option or config)."""
    args, overrides = parse_args(argv)
    if args.device:
        overrides = list(overrides) + ["device", args.device]
    cfg = build_config(load_config_class(args.config), overrides, step=1)
    device = resolve_device(cfg)                    # ConfigError (no GPU for --device cuda): one line, 2
    configure_backends(cfg, device)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    if cfg.cpu_keep_memory and device.type == "cpu":   # as the trainer does on CPU (docs/training.md)
        print(keep_freed_memory())
    ds = build_dataset(cfg, "train")
    # the trainer's sampling: global batches of shuffled indices, each carrying its epoch (EpochBatches)
    batches = EpochBatches(GlobalBatchSampler(len(ds), cfg.batch_size, shuffle=True, seed=cfg.seed))
    loader = DataLoader(ds, batch_sampler=batches, num_workers=cfg.num_workers,
                        collate_fn=collate, worker_init_fn=seed_worker,
                        pin_memory=device.type == "cuda", persistent_workers=cfg.num_workers > 0)
    images, targets, _, _ = next(iter(loader))
    batch = (images.to(device).float(), targets.to(device))
    images = batch[0]

    torch.manual_seed(0)
    float_model = model_from_config(cfg, use_bn=False).to(device)
    apply_stage(float_model, STAGES["step1"])
    quant_model = model_from_config(cfg, use_bn=False).to(device)
    quant_model.load_state_dict(float_model.state_dict())
    # caps from a calibration forward so step 3 runs with realistic clipping
    calibrate_caps(quant_model, lambda: [images])

    rounds = max(1, min(args.rounds, args.iters))
    r1, r3 = time_interleaved([float_model, quant_model], batch, args.iters, rounds)
    t1, t3, ratio, low, high = summarize_rounds(r1, r3)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, threads {torch.get_num_threads()}"
    print(f"device {where}, torch {torch.__version__}")
    print(f"model {cfg.model_name} {cfg.image_size}px x{cfg.gnetdet.width_mult}, batch {cfg.batch_size}, "
          f"weight_scale {cfg.gnetdet.weight_scale}, channels_last {cfg.channels_last}; "
          f"{rounds} rounds of {max(1, args.iters // rounds)} steps per model, alternating")
    print(f"step 1 (float)      {t1 * 1000:8.1f} ms/step  {cfg.batch_size / t1:7.1f} img/s  (median of rounds)")
    print(f"step 3 (quantized)  {t3 * 1000:8.1f} ms/step  {cfg.batch_size / t3:7.1f} img/s  (median of rounds)")
    print(f"ratio step3/step1   {ratio:8.3f}   (median of the rounds' ratios, not the quotient of the two "
          f"lines above; rounds {low:.3f}-{high:.3f}; goal <= 1.15)")
    if cfg.model_name == "gnetdet":
        twin, qat = ao_peer(float_model)
        ra, rq = time_interleaved([twin, qat], batch, args.iters, rounds)
        _, _, ao_ratio, alow, ahigh = summarize_rounds(ra, rq)
        print(f"ratio torch.ao QAT  {ao_ratio:8.3f}   (torch.ao's QAT of the same float model over its float step, "
              f"rounds {alow:.3f}-{ahigh:.3f}; ours {'smaller' if ratio < ao_ratio else 'NOT smaller'}: "
              f"{ratio:.3f})")
        if args.ops:
            n1, n3, na, nq = (count_ops(m, batch) for m in (float_model, quant_model, twin, qat))
            print(f"operators per step  step 1 {n1}, step 3 {n3} ({n3 / n1:.2f}x); torch.ao float {na}, "
                  f"QAT {nq} ({nq / na:.2f}x)  (device path; on an accelerator at least one launch each)")

    if args.amp or device.type == "cuda":
        torch.manual_seed(0)
        amp_model = model_from_config(cfg, use_bn=False).to(device)
        apply_stage(amp_model, STAGES["step1"])
        amp_model.load_state_dict(float_model.state_dict())
        AUTOCAST[id(amp_model)] = torch.bfloat16
        r32, r16 = time_interleaved([float_model, amp_model], batch, args.iters, rounds)
        a16, a32, amp_ratio, alow, ahigh = summarize_rounds(r16, r32)   # ratio: fp32 time / bf16 time
        print(f"step 1 bf16 autocast {a16 * 1000:7.1f} ms/step  {cfg.batch_size / a16:7.1f} img/s")
        print(f"speed bf16/fp32     {amp_ratio:8.3f}   (fp32 time / bf16 time, median of rounds {alow:.3f}-{ahigh:.3f}; "
              "goal >= 1.25 on a GPU)")

    # data loading alone (augmentation on, as in training), then training throughput: LOAD_EPOCHS epochs
    # in one iteration of the loader, as the trainer draws them with workers (one epoch alone would time
    # its start: every worker's first batch at once, a latency that a small dataset never amortizes)
    batches.chain_to = LOAD_EPOCHS
    it = iter(loader)
    batches.chain_to = None
    next(it)                                          # the workers start (persistent afterwards)
    n = 0
    t0 = time.perf_counter()
    for imgs, _, _, _ in it:
        n += imgs.shape[0]
    load_rate = n / (time.perf_counter() - t0)
    train_rate = cfg.batch_size / t1
    print(f"data loading        {load_rate:8.1f} img/s ({cfg.num_workers} workers, cache_images={cfg.cache_images}, "
          f"{LOAD_EPOCHS} epochs of {len(ds)} images in one pass)")
    print(f"training (step 1)   {train_rate:8.1f} img/s (bare step, batch on the device)")
    print(f"ratio load/train    {load_rate / train_rate:8.2f}   (> 1: the loader keeps up when alone; goal >= 1.5 on a GPU)")
    t_loop = time_loop(float_model, loader, args.iters, device)
    print(f"step 1 + loading    {cfg.batch_size / t_loop:8.1f} img/s (the same BN-less model, batches drawn "
          f"from the loader as the trainer draws them)")
    print(f"ratio loop/step     {t1 / t_loop:8.2f}   (1: loading costs the training loop nothing)")
    if args.trainer or device.type == "cuda":
        # the reference is the bare step of the trainer's own model (a copy, with its BatchNorm as the
        # trainer prepares it: on a CPU DistBatchNorm2d, about 20% slower than torch's kernel at the
        # demo's size), so the ratio is the trainer's own overhead
        rate, tb = time_trainer(cfg, overrides, args.iters, batch, rounds)
        print(f"trainer (step 1)    {rate:8.1f} img/s (train_one_epoch, after a warm-up epoch; BatchNorm "
              f"{'on' if cfg.gnetdet.use_bn else 'off'})")
        print(f"bare step (same)    {cfg.batch_size / tb:8.1f} img/s (a copy of the trainer's model, its "
              f"BatchNorm as the trainer converts it)")
        print(f"ratio trainer/step  {rate / (cfg.batch_size / tb):8.2f}   (against the bare step of the same model; "
              "goal >= 0.9 on a GPU)")
    if args.batchnorm:
        time_batchnorm(cfg, batch, args.iters, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
