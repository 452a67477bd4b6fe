"""The recomputed stem (gnetmdk.layers.stem): conv -> BatchNorm -> activation (-> 2x2 max pool) that
keeps only its input. Equality with the plain block (forward, gradients, running statistics, frozen
statistics, bf16 autocast, channels_last, several chunks), what the backward keeps, 1 vs 2 gloo
processes, the model switches and the config switch. Every test runs on the CPU.

Tolerances (float32, unit roundoff u = 2^-24), against a float64 reference of the same block. The
conv of 27 products rounds each output by <= 28 u of ``cabs = conv(|x|, |w|) + |b|``; BatchNorm's
per-channel sums of n <= 2^10 terms are float32 cascade sums (<= log2(n) u of the sum of |terms|);
each elementwise step rounds once. The conv error moves xhat by ``chat = cabs invstd`` times 28 u.
So every quantity errs by less than ``K u`` (K = 64, as tests/layers/test_inplace_abn.py) times the
magnitude of its terms, with xhat's magnitude taken as ``|xhat| + chat``:
  y:           K u (cabs |scale| + |shift| + |y|)                                     per element
  grad c:      K u |gamma| invstd (|dz| + mean|dz| + X mean(|dz| X)),  X = |xhat| + chat  (batch stats)
  grad gamma:  K u sum |dz| X;   grad beta: K u sum |dz|
  grad w, b, x: the conv's backward of grad c: K u conv_backward(|x|, |w|, |grad c| + its bound / (K u))
The ReLU's signs and the pool's positions are taken as the reference's: the data are checked to keep
every ``|z|`` and every window's gap between its largest and second value above the y bound.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gnetmdk.layers.stem as stem
from dist_helpers import ROOT, free_port, run
from gnetmdk.dist.syncbn import DistBatchNorm2d, convert_sync_batchnorm
from gnetmdk.layers.stem import conv_bn_act, convert_recompute_stem, count_recompute_stem
from gnetmdk.models.gnetdet.model import GNetDet
from gnetmdk.models.ppyolo.common import ConvBNLayer
from test_inplace_abn import K, U, UB, _act, assert_one_sgd_step_apart, saved_storages, two_short_sgd_runs  # the unit roundoffs and the float64 activation

pytestmark = pytest.mark.usefixtures("one_thread")

ACTS = [("relu", 0.0), ("leaky_relu", 0.1), ("identity", 0.0)]


@pytest.fixture
def small_chunks(monkeypatch):
    """One image per chunk (the tests' images are small), so that the chunked paths run."""
    monkeypatch.setattr(stem, "CHUNK_ELEMENTS", 1)


def _block(seed, cin=3, cout=6, stride=1, bias=True):
    torch.manual_seed(seed)
    conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=bias)
    bn = DistBatchNorm2d(cout)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-1, 1)
    return conv, bn


def _data(seed, shape=(4, 3, 10, 12), channels_last=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, shape, generator=g).float() + torch.rand(shape, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


def _reference(x, conv, bn, act, slope, pool, up, frozen=False):
    """float64 block on x's values; returns outputs, gradients and the error magnitudes above."""
    x64 = x.detach().double().requires_grad_(True)
    w = conv.weight.detach().double().requires_grad_(True)
    b = conv.bias.detach().double().requires_grad_(True) if conv.bias is not None else None
    g = bn.weight.detach().double().requires_grad_(True)
    bt = bn.bias.detach().double().requires_grad_(True)
    c = F.conv2d(x64, w, b, conv.stride, conv.padding)
    c.retain_grad()
    eps = bn.eps
    if frozen:
        mean, var = bn.running_mean.double(), bn.running_var.double()
        z = F.batch_norm(c, mean, var, g, bt, False, 0.0, eps)
    else:
        mean, var = c.detach().mean((0, 2, 3)), c.detach().var((0, 2, 3), unbiased=False)
        z = F.batch_norm(c, None, None, g, bt, True, 0.0, eps)
    y = _act(z, act, slope)
    out = F.max_pool2d(y, 2, 2) if pool else y
    out.backward(up.double())
    v = (1, c.shape[1], 1, 1)
    invstd = (var + eps).rsqrt().view(v)
    scale, shift = g.detach().view(v) * invstd, bt.detach().view(v) - mean.view(v) * g.detach().view(v) * invstd
    cabs = F.conv2d(x64.detach().abs(), w.detach().abs(), b.detach().abs() if b is not None else None,
                    conv.stride, conv.padding)
    xhat = (c.detach() - mean.view(v)) * invstd
    big_x = xhat.abs() + cabs * invstd
    # |dz| = |d loss / d z|: the activation's and the pool's backward of the reference
    zz = z.detach().requires_grad_(True)
    o2 = _act(zz, act, slope)
    o2 = F.max_pool2d(o2, 2, 2) if pool else o2
    o2.backward(up.double())
    dz = zz.grad.abs()
    n = c.numel() // c.shape[1]
    a = scale.abs()
    mean_dz = dz.sum((0, 2, 3), keepdim=True) / n
    if frozen:
        gc_scale = a * dz
    else:
        gc_scale = a * (dz + mean_dz + big_x * (dz * big_x).sum((0, 2, 3), keepdim=True) / n)
    y_scale = cabs * scale.abs() + shift.abs() + y.detach().abs()
    gc_mag = c.grad.abs() + gc_scale
    _, gw_mag, gb_mag = torch.ops.aten.convolution_backward(
        gc_mag, x64.detach().abs(), w.detach().abs(), [w.shape[0]], list(conv.stride), list(conv.padding),
        [1, 1], False, [0, 0], 1, [False, True, True])
    gx_mag = torch.ops.aten.convolution_backward(
        gc_mag, x64.detach().abs(), w.detach().abs(), None, list(conv.stride), list(conv.padding),
        [1, 1], False, [0, 0], 1, [True, False, False])[0]
    return dict(out=out.detach(), z=z.detach(), y=y.detach(), y_scale=y_scale, gx=x64.grad, gw=w.grad,
                gb=None if b is None else b.grad, gg=g.grad, gbt=bt.grad, gx_mag=gx_mag, gw_mag=gw_mag,
                gb_mag=gb_mag, gg_mag=(dz * big_x).sum((0, 2, 3)), gbt_mag=dz.sum((0, 2, 3)),
                mean=mean, var_unbiased=c.detach().var((0, 2, 3), unbiased=True))


def _margins_ok(ref, pool, k=K, u=U):
    """The reference's ReLU signs and pool positions cannot flip under the y bound (k u y_scale)."""
    bound = k * u * ref["y_scale"]
    if (ref["z"].abs() <= bound).any():
        return False
    if pool:
        y, bd = ref["y"], bound
        q = [y[..., i::2, j::2] for i in (0, 1) for j in (0, 1)]
        qb = [bd[..., i::2, j::2] for i in (0, 1) for j in (0, 1)]
        vals = torch.stack(q)
        top2 = vals.topk(2, dim=0).values
        nonzero = top2[0] > 0                     # windows of zeros route nothing (dz = 0 there)
        gap = top2[0] - top2[1]
        if ((gap <= 2 * torch.stack(qb).max(0).values) & nonzero).any():
            return False
    return True


def _ours(x, conv, bn, act, slope, pool, up, train=True, autocast=False):
    conv, bn = copy.deepcopy(conv), copy.deepcopy(bn)
    bn.train(train)
    xx = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = conv_bn_act(xx, conv, bn, act, slope, pool=pool)
    y.backward(up.to(y.dtype))
    return y.detach(), xx.grad, conv, bn


def _plain(x, conv, bn, act, slope, pool, up, train=True, autocast=False):
    conv, bn = copy.deepcopy(conv), copy.deepcopy(bn)
    bn.train(train)
    xx = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = _act(bn(conv(xx)), act, slope)
        y = F.max_pool2d(y, 2, 2) if pool else y
    y.backward(up.to(y.dtype))
    return y.detach(), xx.grad, conv, bn


def _check(y, gx, conv, bn, ref, k=K, u=U):
    pool_scale = ref["y_scale"] if ref["out"].shape == ref["y"].shape else F.max_pool2d(ref["y_scale"], 2, 2)
    assert ((y.double() - ref["out"]).abs() <= k * u * pool_scale).all()
    assert ((gx.double() - ref["gx"]).abs() <= k * u * ref["gx_mag"]).all()
    assert ((conv.weight.grad.double() - ref["gw"]).abs() <= k * u * ref["gw_mag"]).all()
    if ref["gb"] is not None:
        assert ((conv.bias.grad.double() - ref["gb"]).abs() <= k * u * ref["gb_mag"]).all()
    assert ((bn.weight.grad.double() - ref["gg"]).abs() <= k * u * ref["gg_mag"]).all()
    assert ((bn.bias.grad.double() - ref["gbt"]).abs() <= k * u * ref["gbt_mag"]).all()


# ------------------------------------------------------------------------------ equality with the block
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("pool", [True, False])
@pytest.mark.parametrize("act,slope", ACTS)
def test_forward_and_gradients_equal_the_block_device_cpu(small_chunks, act, slope, pool, channels_last):
    conv, bn = _block(1)
    x = _data(2, channels_last=channels_last)
    shape = (4, 6, 5, 6) if pool else (4, 6, 10, 12)
    up = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    ref = _reference(x, conv, bn, act, slope, pool, up)
    assert _margins_ok(ref, pool)
    y, gx, c2, b2 = _ours(x, conv, bn, act, slope, pool, up)
    assert y.shape == shape and y.is_contiguous(memory_format=torch.channels_last) == channels_last
    _check(y, gx, c2, b2, ref)
    # running statistics as torch updates them (momentum 0.1, unbiased variance), float32 rounding
    assert int(b2.num_batches_tracked) == 1
    assert torch.allclose(b2.running_mean.double(), 0.1 * ref["mean"], rtol=K * U, atol=0)
    assert torch.allclose(b2.running_var.double(), 0.9 + 0.1 * ref["var_unbiased"], rtol=K * U, atol=0)


@pytest.mark.parametrize("act,slope", ACTS)
def test_frozen_statistics_device_cpu(small_chunks, act, slope):
    """BatchNorm in eval mode inside a training step: running statistics, one backward pass."""
    conv, bn = _block(4)
    with torch.no_grad():
        bn.running_mean.uniform_(50, 70), bn.running_var.uniform_(100, 400)
    x = _data(5)
    up = torch.randn(4, 6, 5, 6, generator=torch.Generator().manual_seed(6))
    ref = _reference(x, conv, bn, act, slope, True, up, frozen=True)
    assert _margins_ok(ref, True)
    before = copy.deepcopy(bn.state_dict())
    y, gx, c2, b2 = _ours(x, conv, bn, act, slope, True, up, train=False)
    _check(y, gx, c2, b2, ref)
    for k, v in b2.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_stride_two_like_the_ppyolo_stem_device_cpu(small_chunks):
    conv, bn = _block(7, cout=5, stride=2, bias=False)
    x = _data(8, shape=(3, 3, 13, 11), channels_last=True)
    up = torch.randn(3, 5, 7, 6, generator=torch.Generator().manual_seed(9))
    ref = _reference(x, conv, bn, "leaky_relu", 0.1, False, up)
    assert _margins_ok(ref, False)
    y, gx, c2, b2 = _ours(x, conv, bn, "leaky_relu", 0.1, False, up)
    assert c2.bias is None and y.shape == (3, 5, 7, 6)
    _check(y, gx, c2, b2, ref)


@pytest.mark.parametrize("act,slope", ACTS[:2])
def test_bf16_autocast_device_cpu(small_chunks, act, slope):
    """Under bfloat16 autocast ours and the plain block (conv in bf16, torch's BatchNorm kernel)
    compute the same conv; the statistics differ by float32 rounding (ours float64 sums), so z
    agrees to ~K u before it is rounded to bf16 (u_b = 2^-8): y differs by at most one bf16
    rounding, <= 2 u_b |y| (+ K u y_scale). The gradients pass through bf16 roundings of grad c
    (<= u_b each, twice: ours and the plain one) and bf16 products in the conv's backward: the weight
    gradients differ by <= 4 u_b of their magnitudes (float64 reference, K u part included)."""
    conv, bn = _block(10)
    x = _data(11, channels_last=True)
    up = torch.randn(4, 6, 5, 6, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16).float()
    ref = _reference(x, conv, bn, act, slope, True, up)
    y, gx, c2, b2 = _ours(x, conv, bn, act, slope, True, up, autocast=True)
    yp, gxp, cp, bp = _plain(x, conv, bn, act, slope, True, up, autocast=True)
    assert y.dtype == torch.bfloat16 and c2.weight.grad.dtype == torch.float32
    ys = F.max_pool2d(ref["y_scale"], 2, 2)
    assert ((y.double() - yp.double()).abs() <= 2 * UB * yp.double().abs() + K * U * ys).all()
    assert ((c2.weight.grad.double() - cp.weight.grad.double()).abs() <= 4 * UB * ref["gw_mag"]).all()
    assert ((b2.bias.grad.double() - bp.bias.grad.double()).abs() <= 4 * UB * ref["gbt_mag"]).all()
    assert ((b2.weight.grad.double() - bp.weight.grad.double()).abs() <= 4 * UB * ref["gg_mag"]).all()


def test_bad_arguments_device_cpu():
    conv, bn = _block(0)
    with pytest.raises(ValueError, match="activation"):
        conv_bn_act(_data(0), conv, bn, "gelu")
    with pytest.raises(ValueError, match="even sizes"):
        conv_bn_act(_data(0, shape=(2, 3, 9, 12)), conv, bn, "relu", pool=True)
    with pytest.raises(ValueError, match="groups 1"):
        conv_bn_act(torch.zeros(2, 4, 8, 8), nn.Conv2d(4, 6, 3, padding=1, groups=2), bn, "relu")
    with pytest.raises(ValueError, match="1 value"):
        conv_bn_act(torch.zeros(1, 3, 1, 1), nn.Conv2d(3, 6, 1), bn, "relu")


# ------------------------------------------------------------------------------ what the backward keeps
def _saved(fn, x, params):
    """{storage: (bytes, dtype)} autograd keeps after ``fn(x)`` (``params`` and vectors of <= 64
    values left out), and the output."""
    return saved_storages(fn, x, params)


def test_backward_keeps_the_input_and_pool_codes_only_device_cpu():
    conv, bn = _block(13, cout=16)
    x = _data(14, shape=(4, 3, 32, 32), channels_last=True)
    params = list(conv.parameters()) + list(bn.parameters())
    seen, out = _saved(lambda t: conv_bn_act(t, conv, bn, "relu", pool=True), x, params)
    full = 4 * 16 * 32 * 32                                   # elements of the conv's output
    # the image (float32) and one uint8 code per pooled value: 3 * 4 / 64 + 1 / 4 = 0.44 bytes per
    # output element, against 4 + 4 (BatchNorm's input, the ReLU's output) for the plain block
    assert sorted(seen.values(), key=str) == sorted([(x.numel() * 4, torch.float32), (full // 4, torch.uint8)], key=str)
    seen_plain, _ = _saved(lambda t: F.max_pool2d(F.relu(bn(conv(t))), 2, 2), x, params)
    assert sum(b for b, _ in seen_plain.values()) >= 2 * full * 4
    assert out.shape == (4, 16, 16, 16)


# ------------------------------------------------------------------------------ models, checkpoints, config
def _gnetdet_batch(seed=0, n=4, size=224):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (n, 3, size, size), generator=g).float()
    target = torch.zeros(n, 14, 14, 13)
    target[:, 3:9, 4:10, 0:2] = 0.5
    target[:, 3:9, 4:10, 2:4] = 0.3
    target[:, 3:9, 4:10, 4] = 1.0
    target[:, 3:9, 4:10, 10] = 1.0
    return x, target


@pytest.mark.parametrize("size", [224, 448])
def test_gnetdet_switch_keeps_outputs_and_gradients_device_cpu(size):
    """GNetDet's first sublayer only (448: with its pool; 224: without): the same outputs and running
    statistics, gradients to float32 rounding (1e-5 of each tensor's largest gradient: ~170 u, the
    per-chunk sums and the other layers' float32 backward), conv biases that feed a BatchNorm left
    out (their gradient is round-off: the trainer freezes them). No new state_dict keys."""
    torch.manual_seed(0)
    plain = GNetDet(3, size, 0.0625, channels_last=True)
    convert_sync_batchnorm(plain)
    ours = copy.deepcopy(plain)
    assert convert_recompute_stem(ours) == 1 and count_recompute_stem(ours) == 1
    assert ours.layers[0].recompute_stem and not ours.layers[1].recompute_stem   # layer 1 reads 4 channels too
    x, target = _gnetdet_batch(size=size)
    for m in (plain, ours):
        m.train()
        m.loss(m(x), target)["total"].backward()
    assert torch.equal(plain(x), ours(x))
    for (n, p), (_, q) in zip(plain.named_parameters(), ours.named_parameters()):
        if n.endswith("conv.bias") and "15" not in n:
            continue
        assert (p.grad - q.grad).abs().max() <= 1e-5 * p.grad.abs().max(), n
    for (n, b), (_, c) in zip(plain.named_buffers(), ours.named_buffers()):
        assert torch.allclose(b.double(), c.double(), rtol=1e-6, atol=1e-7), n
    assert list(plain.state_dict()) == list(ours.state_dict())
    # evaluation and steps with BN folded take the block's own forward
    ours.eval()
    with torch.no_grad():
        assert torch.equal(plain.eval()(x), ours(x))
    assert not ours.layers[0].stem_ok(x.requires_grad_(True)) or ours.layers[0].bn is not None


def test_ppyolo_stem_is_marked_and_equal_device_cpu(small_chunks):
    torch.manual_seed(0)
    unit = ConvBNLayer(3, 8, 3, 2, act="relu")
    ours = copy.deepcopy(unit)
    seq_plain, seq_ours = nn.Sequential(unit, ConvBNLayer(8, 8)), nn.Sequential(ours, ConvBNLayer(8, 8))
    seq_ours[1].load_state_dict(seq_plain[1].state_dict())
    assert convert_recompute_stem(seq_ours) == 1 and ours.recompute_stem and not seq_ours[1].recompute_stem
    x = _data(3, shape=(4, 3, 16, 18))
    ya, yb = seq_plain(x), seq_ours(x)
    assert torch.allclose(ya, yb, rtol=0, atol=1e-5)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for (n, p), (_, q) in zip(seq_plain.named_parameters(), seq_ours.named_parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * p.grad.abs().max(), n


# ------------------------------------------------------------------------------ 2 processes
SYNC_SCRIPT = r'''
import sys, torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp
from gnetmdk.dist.syncbn import DistBatchNorm2d
from gnetmdk.layers.stem import conv_bn_act

N = 8

def work(rank, world, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32, (N, 3, 12, 14), generator=g).float()
    w = torch.randn(N, 5, 6, 7, generator=g)
    torch.manual_seed(1)
    conv, bn = nn.Conv2d(3, 5, 3, padding=1), DistBatchNorm2d(5)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5); bn.bias.uniform_(-1, 1)
    b = N // world
    sl = slice(rank * b, (rank + 1) * b)
    xs = x[sl].clone().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    for it in range(2):
        conv.zero_grad(); bn.zero_grad(); xs.grad = None
        y = conv_bn_act(xs, conv, bn, "relu", pool=True)
        ((y * w[sl]).sum(dim=(1, 2, 3)).mean()).backward()
    grads = {p + n: t.grad.clone() for p, m in (("conv.", conv), ("bn.", bn)) for n, t in m.named_parameters()}
    for g_ in grads.values():
        dist.all_reduce(g_); g_ /= world
    ys = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(ys, y.detach().contiguous())
    if rank == 0:
        torch.save({"y": torch.cat(ys), "grads": grads, "state": {k: v.clone() for k, v in bn.state_dict().items()}}, out)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(work, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2)
'''


def test_sync_two_processes_equal_one_process_device_cpu(tmp_path):
    """2 x B/2 against 1 x B, with the thresholds of the DistBatchNorm2d 2-process test (1e-5 of
    each tensor's largest value): the statistics merge the same per-image moments in another
    grouping (float64), the backward's per-channel sums are float32 per chunk (~8 u apart)."""
    script = tmp_path / "stem_sync.py"
    script.write_text(SYNC_SCRIPT)
    out = tmp_path / "out.pt"
    run([str(script), str(free_port()), str(out)], cwd=ROOT, timeout=120).check()
    two = torch.load(out, weights_only=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32, (8, 3, 12, 14), generator=g).float()
    w = torch.randn(8, 5, 6, 7, generator=g)
    torch.manual_seed(1)
    conv, bn = nn.Conv2d(3, 5, 3, padding=1), DistBatchNorm2d(5)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-1, 1)
    xs = x.clone().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    for _ in range(2):
        conv.zero_grad(), bn.zero_grad()
        y = conv_bn_act(xs, conv, bn, "relu", pool=True)
        (y * w).sum(dim=(1, 2, 3)).mean().backward()
    assert (two["y"] - y.detach()).abs().max() <= 1e-5 * y.abs().max()
    for n, p in [("conv." + k, t) for k, t in conv.named_parameters()] + [("bn." + k, t) for k, t in bn.named_parameters()]:
        if n == "conv.bias":
            continue                                            # round-off only: it feeds a BatchNorm
        assert (two["grads"][n] - p.grad).abs().max() <= 1e-5 * p.grad.abs().max(), n
    for k, v in bn.state_dict().items():
        assert (two["state"][k].double() - v.double()).abs().max() <= 1e-5 * max(1.0, float(v.double().abs().max())), k


def test_config_switch_trains_like_the_plain_model_device_cpu(tmp_path_factory, capsys):
    """``recompute_stem true`` in a training run: the log names it, the checkpoint has the plain
    model's keys, and one SGD step ends where the plain run's step ends, within the gradients'
    rounding (test_inplace_abn.assert_one_sgd_step_apart)."""
    ckpts, logs, path = two_short_sgd_runs(tmp_path_factory, capsys, "stem", "recompute_stem")
    assert "recomputed stem: 1 block" in logs["true"] and "recomputed stem" not in logs["false"]
    assert_one_sgd_step_apart(ckpts["false"]["model"], ckpts["true"]["model"], path)


def test_float64_gradients_keep_float64_over_the_chunks_device_cpu(small_chunks):
    """A float64 block sums its chunks' weight and bias gradients in float64 (they were rounded to
    float32): every gradient within 2 n u64 of the float64 reference's magnitudes, n = 4 x 10 x 12
    terms in the longest sum (any summation order: Higham, 2nd ed., sec. 4.2)."""
    conv, bn = _block(7)
    x = _data(8)
    up = torch.randn(4, 6, 5, 6, generator=torch.Generator().manual_seed(9))
    ref = _reference(x, conv, bn, "relu", 0.0, True, up)
    n, u = 4 * 10 * 12, 2.0 ** -53
    assert _margins_ok(ref, True, k=2 * n, u=u)
    y, gx, c2, b2 = _ours(x.double(), copy.deepcopy(conv).double(), copy.deepcopy(bn).double(), "relu", 0.0,
                          True, up.double())
    assert c2.weight.grad.dtype == torch.float64 and c2.bias.grad.dtype == torch.float64
    _check(y, gx, c2, b2, ref, k=2 * n, u=u)
