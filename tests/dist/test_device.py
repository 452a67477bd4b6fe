"""The device path of the quantizers and the trainer's loader, checked on the CPU (device cpu).

On an accelerator the quantizers keep shifts and scales on the device (gnetmdk.gti.quantize.device_path)
so that a training step never waits for it; these tests force that path on the CPU and check that it
gives the host path's numbers bit for bit and reads nothing back. The same code on CUDA is the cuda
lane's (tests/test_cuda.py).
"""
import collections
import inspect
import os
import traceback

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gnetmdk.engine import runtime as R
from gnetmdk.engine.stages import STAGES, apply_stage
from gnetmdk.gti import quantize as Q
from gnetmdk.models.gnetdet.model import GNetDet

torch.set_num_threads(1)

#: ops that read a tensor's value back to the host (on CUDA: wait for the device)
_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
          torch.ops.aten.nonzero.default)


class HostReads(TorchDispatchMode):
    """Records every op that reads a tensor back to the host, with the project frames that called it."""

    def __init__(self):
        super().__init__()
        self.where = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            frames = [f for f in traceback.extract_stack() if "gnetmdk" in f.filename]
            self.where[" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[-3:])] += 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------- histogram
def test_value_histogram_equals_histc_device_cpu():
    """value_histogram (deterministic on CUDA, no host read) bins exactly as torch.histc on the CPU,
    including values on every bin edge and one float32 step either side of it."""
    g = torch.Generator().manual_seed(0)
    for trial in range(8):
        x = torch.randn(50000, generator=g) * 10.0 ** (trial % 4 - 2)
        vmax = float(x.max()) * (0.6 + 0.1 * trial)
        hi = torch.tensor(vmax, dtype=torch.float32)
        edges = torch.linspace(0, float(hi), 4097)
        x = torch.cat([x, edges, torch.nextafter(edges, torch.tensor(-1.0)), torch.nextafter(edges, torch.tensor(1e30)),
                       torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), float(hi)])])
        ref = torch.histc(x[x > 0], bins=4096, min=0.0, max=vmax).double()
        got = Q.value_histogram(x, 4096, vmax)
        assert got.dtype == torch.float64 and torch.equal(got, ref), trial


def test_mse_cap_accepts_counts_on_any_device_cpu():
    counts = Q.value_histogram(torch.linspace(0, 4, 1000), 64, 4.0)
    assert Q.mse_cap_from_histogram(counts, 4.0) == Q.mse_cap_from_histogram(counts.cpu().double(), 4.0)


# ---------------------------------------------------------------------------------------------- shifts, weights
def test_tensor_shift_equals_int_shift_device_cpu():
    cases = [(torch.full((1, 1, 3, 3), 127.0 / 128.0), None, 8, 20),       # r exactly 2^7
             (torch.full((1, 1, 3, 3), 1e-4), None, 8, 20),                 # clipped at 12
             (torch.zeros(1, 1, 3, 3), torch.zeros(1), 8, 20),              # nothing constrains: 12
             (torch.full((1, 1, 3, 3), 1000.0), None, 8, 20),               # clipped at 0
             (torch.full((2, 1, 3, 3), 0.3), torch.tensor([1.0, -40.0]), 12, 12),   # the bias limits
             (torch.full((2, 1, 3, 3), 0.3), torch.tensor([1e9]), 8, 20)]
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        w = torch.randn(4, 2, 3, 3, generator=g) * 10.0 ** float(torch.empty(1).uniform_(-3, 2, generator=g))
        b = torch.randn(4, generator=g) * 10.0 ** float(torch.empty(1).uniform_(-3, 3, generator=g))
        cases.append((w, b, 8, 20))
        cases.append((w, b, 12, 12))
    for w, b, bw, bb in cases:
        t = Q.compute_shift(w, b, bw, bb, as_tensor=True)
        assert t.dtype == torch.int64 and t.dim() == 0
        assert int(t) == Q.compute_shift(w, b, bw, bb)


@pytest.mark.parametrize("method", ["gti", "mse"])
def test_device_path_quantizes_like_the_host_path_device_cpu(method):
    g = torch.Generator().manual_seed(2)
    for _ in range(30):
        w = torch.randn(6, 4, 3, 3, generator=g) * 10.0 ** float(torch.empty(1).uniform_(-3, 1, generator=g))
        b = torch.randn(6, generator=g) * 10.0 ** float(torch.empty(1).uniform_(-3, 1, generator=g))
        for weight_format, bw, bb in ((1, 8, 20), (2, 12, 12), (3, 8, 20), (5, 12, 16), (8, 8, 20), (12, 12, 20)):
            wq, bq, s = Q.quantize_conv_params(w, b, weight_format, bw, bb, method)
            with Q.force_device_path():
                wq2, bq2, s2 = Q.quantize_conv_params(w, b, weight_format, bw, bb, method)
            assert isinstance(s, int) and isinstance(s2, torch.Tensor) and int(s2) == s
            assert torch.equal(wq, wq2) and torch.equal(bq, bq2), (weight_format, method)


def _tiny_model(method, stage):
    torch.manual_seed(0)
    m = GNetDet(3, 224, 0.0625, use_bn=False, weight_scale=method, gain_aware=True)
    for i, r in enumerate(m.relus()):
        r.cap.fill_(2.0 + i % 3)
    apply_stage(m, STAGES[stage])
    return m.train()


def _target():
    t = torch.zeros(2, 14, 14, 13)
    t[:, 3, 4, 0:5] = torch.tensor([0.5, 0.5, 0.2, 0.3, 1.0])
    t[:, 3, 4, 5:10] = t[:, 3, 4, 0:5]
    t[:, 3, 4, 10] = 1.0
    return t


class _NoAmp:
    amp = False
    amp_dtype = "bf16"


@pytest.mark.parametrize("method", ["gti", "mse"])
@pytest.mark.parametrize("stage", ["step2", "step3", "step4"])
def test_training_step_reads_nothing_back_on_the_device_path_device_cpu(method, stage):
    """Forward, loss, backward, gradient clipping and the optimizer step of a quantized stage read no
    tensor back to the host on the device path: on CUDA such a step never waits for the GPU.
    (SGD here: Adam's step counters live on the CPU unless ``capturable``, so reading them costs no
    wait on a GPU but would be counted on this CPU-only check.)"""
    m = _tiny_model(method, stage)
    x = torch.randint(0, 32, (2, 3, 224, 224)).float()
    p = R.Precision(_NoAmp, torch.device("cpu"))
    opt = torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9)
    with Q.force_device_path():
        m(x)                                              # first forward: the caps are read once
        with HostReads() as reads:
            for _ in range(2):
                loss = m.loss(m(x), _target())["total"]
                p.backward(loss)
                norm = p.step(opt, list(m.parameters()), 10.0)
                opt.zero_grad(set_to_none=True)
    assert not reads.where, dict(reads.where)
    assert norm.dim() == 0 and torch.isfinite(norm)


@pytest.mark.parametrize("stem", [False, True])
def test_step1_training_step_with_batchnorm_reads_nothing_back_device_cpu(stem):
    """Step 1 with the synchronised BatchNorm the trainer uses (DistBatchNorm2d; and with the memory
    switch's recomputed stem), in one process: forward, loss and backward read no tensor back to the
    host (the global count per channel comes from the host's shapes, not from the device), so on CUDA
    the host queues a whole step ahead. (InPlace-ABN reads one flag per layer by design: its check of
    ill-conditioned channels, gnetmdk.layers.inplace_abn._ill_conditioned.)"""
    from gnetmdk.dist.syncbn import convert_sync_batchnorm
    from gnetmdk.layers.stem import convert_recompute_stem
    torch.manual_seed(0)
    m = convert_sync_batchnorm(GNetDet(3, 224, 0.0625, use_bn=True))
    if stem:
        assert convert_recompute_stem(m) > 0
    apply_stage(m, STAGES["step1"])
    m.train()
    x = torch.randint(0, 32, (2, 3, 224, 224)).float()
    m(x)
    with HostReads() as reads:
        m.loss(m(x), _target())["total"].backward()
    assert not reads.where, dict(reads.where)


@pytest.mark.parametrize("rows", [1, 3])
def test_combined_moments_never_read_the_count_back_device_cpu(rows):
    """combine_moments with the host's counts: without sync the global count is their sum, with sync
    (the gathered table; here one process, so the table itself) it stays a device tensor; neither
    reads anything back, and both give the count, mean and variance of the plain fold bit for bit.
    A process whose own count is 1 still gets the one-line refusal when the global count is 1."""
    from gnetmdk.dist.syncbn import batch_moments, combine_moments
    g = torch.Generator().manual_seed(rows)
    xs = [torch.randn(2 + i, 5, 3, 4, generator=g) * 3 + 1 for i in range(rows)]
    table = torch.stack([batch_moments(x)[0] for x in xs])
    counts = [x.numel() // 5 for x in xs]
    ref = combine_moments(table, False, "t")                        # the count read from the table
    for sync in (False, True):
        with HostReads() as reads:
            n, mean, var = combine_moments(table, sync, "t", counts=counts)
        assert not reads.where, dict(reads.where)
        assert float(n) == ref[0] and torch.equal(mean, ref[1]) and torch.equal(var, ref[2])
    one = batch_moments(torch.randn(1, 5, 1, 1, generator=g))[0]
    for sync in (False, True):
        with pytest.raises(ValueError, match="t: 1 value"):
            combine_moments(one, sync, "t", counts=[1])


def test_device_path_training_step_equals_the_host_path_device_cpu():
    """The same two training steps of step 3 on both paths: the same weights bit for bit."""
    x = torch.randint(0, 32, (2, 3, 224, 224)).float()
    out = []
    for forced in (False, True):
        m = _tiny_model("mse", "step3")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        p = R.Precision(_NoAmp, torch.device("cpu"))
        with (Q.force_device_path() if forced else _nothing()):
            for _ in range(2):
                p.backward(m.loss(m(x), _target())["total"])
                p.step(opt, list(m.parameters()), 10.0)
                opt.zero_grad(set_to_none=True)
        out.append(m.state_dict())
    for k in out[0]:
        assert torch.equal(out[0][k], out[1][k]), k


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------------- backends, DDP
def test_wrap_ddp_keeps_buffers_synced_once_whatever_the_torch_version(monkeypatch):
    """torch 2.13 has forward_sync_buffers, 2.11 only broadcast_buffers: wrap_ddp picks what exists."""
    from gnetmdk.dist import parallel
    seen = {}

    class FakeNew:
        def __init__(self, module, device_ids=None, broadcast_buffers=None, forward_sync_buffers=None):
            seen["new"] = (broadcast_buffers, forward_sync_buffers)

    class FakeOld:
        def __init__(self, module, device_ids=None, broadcast_buffers=True):
            seen["old"] = broadcast_buffers

    import torch.nn.parallel as tnp
    for fake in (FakeNew, FakeOld):
        monkeypatch.setattr(tnp, "DistributedDataParallel", fake)
        parallel.wrap_ddp(torch.nn.Linear(2, 2), torch.device("cpu"))
    assert seen == {"new": (None, False), "old": False}
    real = inspect.signature(torch.nn.parallel.distributed.DistributedDataParallel.__init__).parameters
    assert "broadcast_buffers" in real


def test_configure_backends_tf32_and_deterministic(monkeypatch):
    from gnetmdk.engine.device import configure_backends, tf32_enabled

    class Cfg:
        tf32 = True
        deterministic = False
        augment = True

    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode: seen.append(mode))
    seen = []
    try:
        configure_backends(Cfg, torch.device("cpu"))
        assert tf32_enabled() and not seen
        Cfg.deterministic = True
        notes = configure_backends(Cfg, torch.device("cpu"))
        assert not tf32_enabled() and seen == [True] and Cfg.augment is False
        assert any("deterministic" in n for n in notes)
        Cfg.tf32, Cfg.deterministic = False, False
        configure_backends(Cfg, torch.device("cpu"))
        assert not tf32_enabled()
    finally:
        from gnetmdk.engine.device import set_tf32
        set_tf32(False)


def test_tf32_auto_is_the_float_stage_only_device_cpu(tmp_path):
    """``tf32 auto`` (the default) sets TF32 for step 1 and the float control, IEEE float32 for the
    calibration run and steps 2-4; on / off (and true / false, also as a bool in configs.py) everywhere;
    deterministic mode never; any other value is one config error naming the field. (The flags are
    torch's global switches; a CPU build keeps them, so this runs with device cpu.)"""
    from gnetmdk.config import ConfigError, build_config, load_config_class
    from gnetmdk.engine.control import control_configs
    from gnetmdk.engine.device import configure_backends, set_tf32, tf32_enabled
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    klass = load_config_class(os.path.join(root, "examples", "cards.py"))
    cpu = torch.device("cpu")

    def on(overrides=(), **where):
        cfg = build_config(klass, ["device", "cpu", *overrides], **where)
        configure_backends(cfg, cpu)
        return tf32_enabled()

    try:
        assert build_config(klass, ["device", "cpu"], step=1).tf32 == "auto"
        assert on(step=1) and not on(step=2) and not on(step=3) and not on(step=4) and not on(cal=True)
        assert on(["tf32", "on"], step=3) and on(["tf32", "true"], step=2) and not on(["tf32", "off"], step=1)
        assert not on(["deterministic", "true"], step=1)
        for cfg in control_configs(klass, ["device", "cpu"]):
            configure_backends(cfg, cpu)
            assert tf32_enabled()

        class Old(klass):                    # a configs.py of the time tf32 was a bool
            tf32 = True
        assert build_config(Old, ["device", "cpu"], step=3).tf32 == "on"
        with pytest.raises(ConfigError, match="'tf32' = 'fast'.*auto.*on.*off"):
            build_config(klass, ["device", "cpu", "tf32", "fast"], step=1)
    finally:
        set_tf32(False)


def test_device_cuda_without_a_gpu_is_a_config_error():
    from gnetmdk.config import ConfigError
    from gnetmdk.engine.device import resolve_device

    class Cfg:
        device = "cuda"
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match="device cpu or auto"):
        resolve_device(Cfg)


def test_device_auto_is_cuda_only_where_torch_sees_a_gpu_and_the_suite_refuses_it(monkeypatch):
    """device auto means CUDA exactly where torch sees a GPU (the trainer, the launcher and the chip
    tools ask the same function); the test suite sets GNETMDK_AUTO_DEVICE=refuse, so a test that does
    not pin its device fails on every machine instead of moving to the GPU on one."""
    from gnetmdk.config import ConfigError
    from gnetmdk.config.base import cuda_wanted
    from gnetmdk.dist.launch import spec_from_args
    from gnetmdk.chip.cli_util import eval_device

    class Cfg:
        device, threads, dist_timeout, batch_size, tf32 = "auto", 1, 60.0, 4, False
    assert os.environ.get("GNETMDK_AUTO_DEVICE") == "refuse"          # conftest
    with pytest.raises(ConfigError, match="device auto refused .*pin device cpu or device cuda"):
        cuda_wanted("auto")
    with pytest.raises(ConfigError, match="device auto refused"):
        spec_from_args(type("Args", (), {})(), Cfg)
    monkeypatch.delenv("GNETMDK_AUTO_DEVICE")
    for seen in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: seen)
        assert cuda_wanted("auto") is seen and cuda_wanted("cuda") and not cuda_wanted("cpu")
        assert spec_from_args(type("Args", (), {})(), Cfg).use_cuda is seen
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert eval_device(Cfg).type == "cpu"


# ---------------------------------------------------------------------------------------------- loader
def test_persistent_workers_draw_each_epochs_augmentation_device_cpu(tmp_path):
    """The trainer's loader keeps its workers over the epochs; the epoch travels with every index
    (EpochBatches), so a persistent worker draws epoch 1's augmentation in epoch 1, exactly what a
    loader without workers gives. Images come as uint8 codes."""
    from torch.utils.data import DataLoader
    from gnetmdk.dataset.dataset import GNetDetDataset, collate
    from gnetmdk.dataset.shapes import make_shapes_dataset
    from gnetmdk.dataset.voc import convert_voc_to_meta
    from gnetmdk.dist.sampler import EpochBatches, GlobalBatchSampler
    root = tmp_path / "shapes"
    make_shapes_dataset(str(root), num_train=8, num_val=2, image_size=(64, 96), seed=0)
    meta = tmp_path / "meta"
    convert_voc_to_meta(str(root), ["circle", "square", "triangle"], str(meta / "t.txt"), str(meta / "v.txt"))
    ds = GNetDetDataset(str(meta / "t.txt"), str(root / "JPEGImages"), 3, 224, 14, train=True)

    def epochs(workers):
        sampler = GlobalBatchSampler(len(ds), 4, shuffle=False)
        kw = dict(persistent_workers=True) if workers else {}
        loader = DataLoader(ds, batch_sampler=EpochBatches(sampler), collate_fn=collate, num_workers=workers, **kw)
        out = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            ds.set_epoch(epoch)          # what the trainer does; persistent workers never see it
            out.append([(b[0].clone(), b[1].clone()) for b in loader])
        return out

    plain, persistent = epochs(0), epochs(1)
    assert plain[0][0][0].dtype == torch.uint8 and int(plain[0][0][0].max()) <= 31
    for e in range(2):
        for (a, ta), (b, tb) in zip(plain[e], persistent[e]):
            assert torch.equal(a, b) and torch.equal(ta, tb)
    assert not torch.equal(plain[0][0][0], plain[1][0][0])     # same images, each epoch its own draws


def test_chained_epochs_give_each_epochs_own_batches_device_cpu():
    """EpochBatches with chain_to: one iteration yields epoch after epoch exactly the batches each epoch
    gives alone (a resumed first epoch from its start batch, the next ones from batch 0), and leaves the
    trainer's sampler at its epoch."""
    from gnetmdk.dist.sampler import EpochBatches, GlobalBatchSampler
    sampler = GlobalBatchSampler(20, 4, shuffle=True, seed=3, accumulate=2)
    eb = EpochBatches(sampler)
    alone = []
    for epoch, start in ((1, 2), (2, 0), (3, 0)):
        sampler.set_epoch(epoch, start)
        alone += list(eb)
    sampler.set_epoch(1, 2)
    eb.chain_to = 4
    chained = iter(eb)
    eb.chain_to = None                        # read when the iteration starts, not later
    assert list(chained) == alone and len(alone) == (3 + 5 + 5) * 2
    assert (sampler.epoch, sampler.start_batch) == (1, 2)
    assert [b[0][1] for b in alone] == [1] * 6 + [2] * 10 + [3] * 10        # (micro-batches, accumulate 2)
    assert [b[0][2] for b in alone][:6] == [2, 2, 3, 3, 4, 4] and alone[-1][0][1:] == (3, 4)


def test_trainer_with_chained_loader_workers_trains_as_without_workers_device_cpu(tmp_path):
    """Loader workers that prefetch across epochs (Trainer._epoch_batches) feed the trainer the same
    batches as loading in the process: the same indices in every iteration of three epochs, with an
    evaluation between them, and the same weights bit for bit."""
    from dist_helpers import make_workspace
    from gnetmdk.config import build_config, load_config_class
    from gnetmdk.engine.hooks import HookBase
    from gnetmdk.engine.trainer import Trainer
    path = make_workspace(str(tmp_path), num_train=12, num_val=2)

    class Seen(HookBase):
        def __init__(self):
            self.indices = []

        def after_iteration(self, it):
            self.indices.append(it["batch"][2].tolist())

    def train(workers):
        out = tmp_path / f"w{workers}"
        cfg = build_config(load_config_class(path), [
            "num_workers", str(workers), "batch_size", "4", "num_epochs", "3", "eval_interval", "2", "threads", "1",
            "checkpoint_root", str(out / "ck"), "log_root", str(out / "log"), "progress", "false"], step=1)
        t = Trainer(cfg)
        seen = Seen()
        t.register(seen)
        t.run()
        chain = t._chain
        return seen.indices, {k: v.clone() for k, v in t.model.state_dict().items()}, chain

    (i0, w0, c0), (i2, w2, c2) = train(0), train(2)
    assert c0 is None and c2 is not None                  # workers: one iteration over the epochs
    assert i0 == i2 and len(i0) == 9
    assert all(torch.equal(w0[k], w2[k]) for k in w0)
