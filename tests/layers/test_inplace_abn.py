"""In-place activated BatchNorm (gnetmdk.layers.inplace_abn): equality with BatchNorm2d + activation
(forward, gradients, running statistics, frozen statistics, bf16 autocast, channels_last), what the
backward keeps, the synchronised form over 2 gloo processes, checkpoints, BN folding and model
conversion. Every test runs on the CPU.

Tolerances (float32, unit roundoff u = 2^-24). Ours and the float64 reference compute the same
formulas; every float32 step rounds once (<= u relative) and the per-channel sums of n terms are
float32 cascade sums (<= ~log2(n) u of the sum of the terms' absolute values, n <= 2^11 here).
Recovering ``x - mean = (z - beta) / (gamma invstd)`` from the output loses about
``(2 + |beta| / |gamma|)`` ulps; the data keep |beta| / |gamma| <= 2. Hence each quantity's error is
below ``K u`` times the magnitude of its terms taken in absolute value, with
``K = log2(n) + 2 + 2 + (a handful of roundings) < 32``; we assert ``K = 64``:
  y:        64 u (|x| |scale| + |shift| + |y|)                              per element
  grad x:   64 u |gamma| invstd (|dz| + mean|dz| + |xhat| mean|dz xhat|)  per element (batch stats)
            64 u |gamma| invstd |dz|                                        (running stats)
  grad gamma: 64 u sum |dz xhat|;  grad beta: 64 u sum |dz|                 per channel
bfloat16 (autocast): the output and the kept output are rounded to bfloat16 (unit roundoff
u_b = 2^-8): the bounds are derived in test_bf16_autocast_device_cpu.
"""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_helpers import ROOT, free_port, run
from gnetmdk.dist.parallel import freeze_biases_before_bn
from gnetmdk.dist.syncbn import convert_sync_batchnorm
from gnetmdk.gti.transforms import fold_bn
from gnetmdk.models.gnetdet.model import GNetDet
from gnetmdk.layers.inplace_abn import BatchNormAct2d, convert_inplace_abn, count_inplace_abn
from gnetmdk.models.ppyolo.common import ConvBNLayer

CPU = torch.device("cpu")
U = 2.0 ** -24
UB = 2.0 ** -8
K = 64
ACTS = [("relu", 0.01), ("leaky_relu", 0.1), ("identity", 0.01)]


pytestmark = pytest.mark.usefixtures("one_thread")


def _act(z, act, slope):
    if act == "relu":
        return F.relu(z)
    if act == "leaky_relu":
        return F.leaky_relu(z, slope)
    return z


def _data(seed, shape=(4, 6, 5, 7), channels_last=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 2 + 3).to(dtype)
    up = torch.randn(*shape, generator=g)                       # upstream gradient dL/dy
    gamma = torch.empty(shape[1]).uniform_(0.5, 1.5, generator=g)
    beta = torch.empty(shape[1]).uniform_(-1, 1, generator=g)  # |beta| / |gamma| <= 2
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.to(CPU), up, gamma, beta


def _reference(x, gamma, beta, act, slope, up, running=None, eps=1e-5):
    """float64 BatchNorm + activation on x's values; returns outputs, gradients and error scales."""
    x64 = x.detach().double().requires_grad_(True)
    w = gamma.double().requires_grad_(True)
    b = beta.double().requires_grad_(True)
    if running is None:
        mean = x64.detach().mean((0, 2, 3))
        var = x64.detach().var((0, 2, 3), unbiased=False)
        z = F.batch_norm(x64, None, None, w, b, True, 0.0, eps)
    else:
        mean, var = running[0].double(), running[1].double()
        z = F.batch_norm(x64, mean, var, w, b, False, 0.0, eps)
    y = _act(z, act, slope)
    y.backward(up.double())
    c = x.shape[1]
    v = (1, c, 1, 1)
    invstd = (var + eps).rsqrt()
    scale = (w.detach() * invstd).view(v)
    shift = (b.detach() - mean * w.detach() * invstd).view(v)
    xhat = (x64.detach() - mean.view(v)) * invstd.view(v)
    dz = up.double() * {"relu": (z > 0).double(), "leaky_relu": torch.where(z > 0, 1.0, slope),
                        "identity": torch.ones_like(z)}[act]
    dz = dz.detach()
    n = x.numel() // c
    a = scale.abs()
    if running is None:
        gx_scale = a * (dz.abs() + dz.abs().sum((0, 2, 3), keepdim=True) / n
                        + xhat.abs() * (dz * xhat).abs().sum((0, 2, 3), keepdim=True) / n)
    else:
        gx_scale = a * dz.abs()
    # the part of grad x's error that comes from |beta| / |gamma| (recovering x - mean from a rounded z)
    gx_extra = a * ((dz * xhat).abs().sum((0, 2, 3), keepdim=True) / n
                    + dz.abs().sum((0, 2, 3), keepdim=True) / n * xhat.abs())
    return dict(gx_extra=gx_extra, y=y.detach(), gx=x64.grad, gw=w.grad, gb=b.grad, z=z.detach(),
                y_scale=x64.detach().abs() * scale.abs() + shift.abs() + y.detach().abs(), gx_scale=gx_scale,
                gw_scale=(dz * xhat).abs().sum((0, 2, 3)), gb_scale=dz.abs().sum((0, 2, 3)))


def _ours(x, gamma, beta, act, slope, up, train=True, **kw):
    m = BatchNormAct2d(x.shape[1], act, slope, **kw)
    with torch.no_grad():
        m.weight.copy_(gamma), m.bias.copy_(beta)
    m.train(train)
    xx = x.detach().clone().requires_grad_(True)
    y = m(xx)
    y.backward(up.to(y.dtype))
    return m, y.detach(), xx.grad


def _check(ours_y, gx, m, ref, k=K, u=U):
    assert ((ours_y.double() - ref["y"]).abs() <= k * u * ref["y_scale"]).all()
    assert ((gx.double() - ref["gx"]).abs() <= k * u * ref["gx_scale"]).all()
    assert ((m.weight.grad.double() - ref["gw"]).abs() <= k * u * ref["gw_scale"]).all()
    assert ((m.bias.grad.double() - ref["gb"]).abs() <= k * u * ref["gb_scale"]).all()


# ------------------------------------------------------------------------------ equality with BN + act
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act,slope", ACTS)
def test_forward_and_gradients_equal_batchnorm_and_activation_device_cpu(act, slope, channels_last):
    x, up, gamma, beta = _data(0, channels_last=channels_last)
    ref = _reference(x, gamma, beta, act, slope, up)
    # precondition of an elementwise comparison: no pre-activation within float32 rounding of 0 (a
    # flipped ReLU / leaky branch would be a different, equally valid, float32 answer)
    assert (ref["z"].abs() > K * U * ref["y_scale"]).all()
    m, y, gx = _ours(x, gamma, beta, act, slope, up)
    _check(y, gx, m, ref)
    assert y.dtype == x.dtype and y.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert gx.is_contiguous(memory_format=torch.channels_last) == channels_last or not channels_last
    # torch's float32 kernels land within the same bounds: the bounds are not loose for ours only
    bn = nn.BatchNorm2d(x.shape[1])
    with torch.no_grad():
        bn.weight.copy_(gamma), bn.bias.copy_(beta)
    xx = x.clone().requires_grad_(True)
    yt = _act(bn(xx), act, slope)
    yt.backward(up)
    _check(yt.detach(), xx.grad, bn, ref)


def test_running_statistics_update_like_batchnorm_device_cpu():
    for momentum in (0.1, None):                               # None: cumulative moving average
        ours = BatchNormAct2d(6, "relu", momentum=momentum)
        ref = nn.BatchNorm2d(6, momentum=momentum).double()
        for step in range(3):
            x, up, _, _ = _data(10 + step, channels_last=step == 1)
            ours(x.requires_grad_(True)).backward(up)
            ref(x.double())
        assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 3
        for name in ("running_mean", "running_var"):
            got, want = getattr(ours, name).double(), getattr(ref, name)
            # each update: 3 roundings of (1 - f) r + f s plus the statistic's own (log2 n + 4) u
            assert ((got - want).abs() <= K * U * (want.abs() + 1)).all(), name
    # no affine parameters: gamma 1, beta 0
    x, up, _, _ = _data(2)
    m = BatchNormAct2d(6, "leaky_relu", 0.1, affine=False)
    xx = x.clone().requires_grad_(True)
    y = m(xx)
    y.backward(up)
    ref = _reference(x, torch.ones(6), torch.zeros(6), "leaky_relu", 0.1, up)
    assert ((y.detach().double() - ref["y"]).abs() <= K * U * ref["y_scale"]).all()
    assert ((xx.grad.double() - ref["gx"]).abs() <= K * U * ref["gx_scale"]).all()
    # no tracking: batch statistics in training and evaluation, no buffers
    m = BatchNormAct2d(6, "relu", track_running_stats=False).eval()
    x, up, gamma, beta = _data(3)
    with torch.no_grad():
        m.weight.copy_(gamma), m.bias.copy_(beta)
    xx = x.clone().requires_grad_(True)
    y = m(xx)
    y.backward(up)
    _check(y.detach(), xx.grad, m, _reference(x, gamma, beta, "relu", 0.0, up))


@pytest.mark.parametrize("act,slope", ACTS)
def test_frozen_statistics_device_cpu(act, slope):
    # eval-mode BatchNorm inside training (e.g. PP-YOLO freeze_norm): running statistics, the forward
    # bit for bit that of BatchNorm2d.eval() + activation, gradients to float32 rounding
    x, up, gamma, beta = _data(4, channels_last=True)
    rm, rv = torch.randn(6) + 3, torch.rand(6) * 3 + 2
    bn = nn.BatchNorm2d(6).eval()
    with torch.no_grad():
        bn.weight.copy_(gamma), bn.bias.copy_(beta), bn.running_mean.copy_(rm), bn.running_var.copy_(rv)
    ours = BatchNormAct2d(6, act, slope).eval()
    ours.load_state_dict(bn.state_dict())
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = _act(bn(xa), act, slope), ours(xb)
    assert torch.equal(ya, yb)
    ya.backward(up), yb.backward(up)
    ref = _reference(x, gamma, beta, act, slope, up, running=(rm, rv))
    _check(yb.detach(), xb.grad, ours, ref)
    assert torch.equal(ours.running_mean, rm) and int(ours.num_batches_tracked) == 0     # not updated
    with torch.no_grad():                                     # evaluation: BatchNorm2d + activation exactly
        assert torch.equal(ours(x), _act(bn(x), act, slope))


def test_small_and_negative_gamma_are_exact_device_cpu():
    # gamma = 0 (not invertible), gamma tiny against beta (ill-conditioned), gamma < 0: those channels
    # keep their input, so the layer stays BatchNorm2d's function and its gradients stay exact
    x, up, _, _ = _data(5)
    gamma = torch.tensor([1.0, 0.0, 1e-6, -0.8, 0.7, 1e-30])
    beta = torch.tensor([0.3, 0.5, 0.4, -0.2, 0.1, 0.0])
    for act, slope in ACTS:
        ref = _reference(x, gamma, beta, act, slope, up)
        m, y, gx = _ours(x, gamma, beta, act, slope, up)
        assert torch.isfinite(gx).all()
        _check(y, gx, m, ref)
    # float64 gradcheck of the same cases (ReLU, batch and running statistics); beta != 0 where gamma
    # is ~0, so that the numerical derivative in gamma is not taken across ReLU's kink at z = 0
    beta[5] = 0.2
    xd = (torch.randn(3, 6, 3, 4, dtype=torch.double) + 1).requires_grad_(True)
    for train in (True, False):
        m = BatchNormAct2d(6, "relu").double().train(train)
        with torch.no_grad():
            m.weight.copy_(gamma), m.bias.copy_(beta)
            m.running_mean.uniform_(0, 2), m.running_var.uniform_(0.5, 2)
        m.momentum = 0.0                                       # gradcheck reruns forward: keep buffers fixed
        # the parameters are inputs of gradcheck (perturbed in place, the module reads them)
        assert torch.autograd.gradcheck(lambda t, *p: m(t), (xd, m.weight, m.bias))


def test_bad_arguments_device_cpu():
    with pytest.raises(ValueError, match="activation must be one of"):
        BatchNormAct2d(4, "elu")
    with pytest.raises(ValueError, match="slope 0 is ReLU"):
        BatchNormAct2d(4, "leaky_relu", 0.0)
    m = BatchNormAct2d(4)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        m(torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="got 5 channels"):
        m(torch.zeros(2, 5, 3, 3))
    with pytest.raises(ValueError, match="1 value"):
        m(torch.zeros(1, 4, 1, 1))


# ------------------------------------------------------------------------------ bfloat16
@pytest.mark.parametrize("act,slope", ACTS)
def test_bf16_autocast_device_cpu(act, slope):
    # bfloat16 input under autocast (a bf16 conv's output): statistics and the affine map in float32,
    # z rounded to bfloat16 and activated there (as torch's kernel + activation), the gradient
    # returned in bfloat16. Reference: float64 on the same bf16 input and the same (bf16) incoming
    # gradient. bfloat16 keeps 8 significant bits: each rounding errs by <= u_b = 2^-8 relative.
    #   y: z to bf16, and leaky's product: <= 2 u_b |y|.
    #   x - mean recovered from the bf16 y: z is off by <= 2 u_b |z| (rounding of z, and of y for
    #   leaky's y / slope), so xhat by <= 2 u_b (|xhat| + |beta|/|gamma|), |beta|/|gamma| <= 2. It
    #   enters grad x through b (x - m) and through the sum that defines b, each <= 2 u_b (gx_scale
    #   + 2 gx_extra) (gx_extra: the |beta|/|gamma| part, see _reference); the bf16 result adds
    #   u_b gx_scale: <= 5 u_b gx_scale + 8 u_b gx_extra (+ the float32 bound).
    #   grad gamma = sum dz xhat: <= 2 u_b (sum|dz xhat| + 2 sum|dz|); grad beta = sum dz: float32 only.
    x, up, gamma, beta = _data(6, channels_last=True, dtype=torch.bfloat16)
    up = up.to(torch.bfloat16).float()
    ref = _reference(x, gamma, beta, act, slope, up)
    assert (ref["z"].abs() > K * U * ref["y_scale"]).all()      # bf16 rounding keeps z's sign
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m, y, gx = _ours(x, gamma, beta, act, slope, up)
    assert y.dtype == torch.bfloat16 and gx.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.float32
    assert ((y.double() - ref["y"]).abs() <= 2 * UB * ref["y"].abs() + K * U * ref["y_scale"]).all()
    assert ((gx.double() - ref["gx"]).abs()
            <= 5 * UB * ref["gx_scale"] + 8 * UB * ref["gx_extra"] + K * U * ref["gx_scale"]).all()
    assert ((m.weight.grad.double() - ref["gw"]).abs()
            <= 2 * UB * (ref["gw_scale"] + 2 * ref["gb_scale"]) + K * U * ref["gw_scale"]).all()
    assert ((m.bias.grad.double() - ref["gb"]).abs() <= K * U * ref["gb_scale"]).all()


# ------------------------------------------------------------------------------ what the backward keeps
def saved_storages(fn, x, own):
    """{storage pointer: (bytes, dtype)} of the distinct storages autograd keeps for backward after
    ``fn(x)``, and the output; the storages of the tensors in ``own`` (parameters, buffers) and
    per-channel vectors (<= 64 values) left out; tensors of graph branches dropped during the forward,
    such as an output a hook replaced, not counted."""
    mine = {t.untyped_storage().data_ptr() for t in own}
    packed = []

    def pack(t):
        alias = t.detach()                                     # no grad_fn: no reference cycle
        packed.append(weakref.ref(alias))
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    seen = {}
    for ref in packed:
        t = ref()
        if t is not None and t.numel() > 64 and t.untyped_storage().data_ptr() not in mine:
            seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
    return seen, out


def _saved_bytes(model, x):
    """Bytes of the distinct storages autograd keeps for backward after one forward of ``model``
    (saved_storages, its parameters and buffers left out), and the output."""
    seen, out = saved_storages(model, x, list(model.parameters()) + list(model.buffers()))
    return sum(b for b, _ in seen.values()), out


@pytest.mark.parametrize("act", ["relu", "leaky"])
def test_backward_keeps_the_output_not_the_input_device_cpu(act):
    torch.manual_seed(0)
    plain = nn.Sequential(ConvBNLayer(8, 16, 3, 1, act=act), ConvBNLayer(16, 16, 3, 1, act=act)).to(CPU)
    ours = convert_inplace_abn(copy.deepcopy(plain))
    assert count_inplace_abn(ours) == 2 and all(l.act is None for l in ours)
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    n_act = 4 * 16 * 16 * 16 * 4                               # bytes of one 16-channel activation
    b_plain, y_plain = _saved_bytes(plain, x)
    b_ours, y_ours = _saved_bytes(ours, x)
    # plain: x (8 channels: half an activation), and per unit the conv output (BN's input) and the
    # ReLU's output (ReLU's backward reads its output, which the next conv keeps anyway); leaky ReLU's
    # backward reads its *input*, so out of place it also keeps BatchNorm's output: 3 per unit
    assert b_plain == n_act // 2 + (4 if act == "relu" else 5) * n_act
    if act == "leaky":                                          # invertible: the outputs alone
        assert b_ours == n_act // 2 + 2 * n_act
    else:                                                       # ReLU: plus the input where y == 0
        with torch.no_grad():
            zeros = sum(int((m.bn(m.conv(t)) <= 0).sum()) for m, t in ((ours[0], x), (ours[1], ours[0](x))))
        assert b_ours == n_act // 2 + 2 * n_act + 4 * zeros
        assert 0.3 < zeros * 4 / (2 * n_act) < 0.7                # about half the outputs are 0 here
    assert torch.allclose(y_plain, y_ours, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ 2 processes
SYNC_SCRIPT = r'''
import sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from gnetmdk.dist.syncbn import DistBatchNorm2d
from gnetmdk.layers.inplace_abn import BatchNormAct2d

N, C = 8, 5

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, C, 6, 7, generator=g) * 3 + 20          # a large mean, as the DistBatchNorm2d test
    w = torch.randn(N, C, 6, 7, generator=g)
    return x, w

def init(m):
    torch.manual_seed(1)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5); m.bias.uniform_(-1, 1)
    return m

def work(rank, world, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x, w = data()
    b = N // world
    sl = slice(rank * b, (rank + 1) * b)
    res = {}
    for name, m in (("relu", BatchNormAct2d(C, "relu", sync=True)),
                    ("leaky", BatchNormAct2d(C, "leaky_relu", 0.1, sync=True)),
                    ("dist", DistBatchNorm2d(C))):
        init(m)
        xs = x[sl].clone().contiguous(memory_format=torch.channels_last).requires_grad_(True)
        for it in range(2):                                    # two steps: running stats twice
            m.zero_grad(); xs.grad = None
            y = m(xs)
            ((y * w[sl]).sum(dim=(1, 2, 3)).mean()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        for g_ in grads.values():                              # what DDP does: average over ranks
            dist.all_reduce(g_); g_ /= world
        ys = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(ys, y.detach().contiguous())
        gx = [torch.empty_like(xs.grad) for _ in range(world)]
        dist.all_gather(gx, xs.grad.contiguous())
        res[name] = {"y": torch.cat(ys), "gx": torch.cat(gx) / world, "grads": grads,
                     "state": {k: v.clone() for k, v in m.state_dict().items()}}
    if rank == 0:
        torch.save(res, out)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(work, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2)
'''


def test_sync_two_processes_equal_one_process_device_cpu(tmp_path):
    script = tmp_path / "abn_sync.py"
    script.write_text(SYNC_SCRIPT)
    out = tmp_path / "out.pt"
    run([str(script), str(free_port()), str(out)], cwd=ROOT, timeout=120).check()
    r = torch.load(out, weights_only=True)
    # the statistics are DistBatchNorm2d's, bit for bit: same running buffers, and the output is the
    # activation of DistBatchNorm2d's output
    for name, act in (("relu", F.relu), ("leaky", lambda t: F.leaky_relu(t, 0.1))):
        for k, v in r["dist"]["state"].items():
            assert torch.equal(r[name]["state"][k], v), (name, k)
        assert torch.equal(r[name]["y"], act(r["dist"]["y"])), name
    # 2 x B/2 against 1 x B in one process, with the thresholds of the DistBatchNorm2d 2-process test
    # (test_dist_units: 1e-5 absolute on outputs of magnitude ~2, 1e-5 of the largest gradient): ours
    # rounds in float32 (u = 6e-8) with per-channel sums of 168 (2 ranks) or 336 terms, ~8 u apart, and
    # the recovery of x - mean adds ~4 u; 1e-5 is ~170 u
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, 6, 7, generator=g) * 3 + 20
    w = torch.randn(8, 5, 6, 7, generator=g)
    for name, act, slope in (("relu", "relu", 0.01), ("leaky", "leaky_relu", 0.1)):
        m = BatchNormAct2d(5, act, slope, sync=True)
        torch.manual_seed(1)
        with torch.no_grad():
            m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-1, 1)
        xr = x.clone().contiguous(memory_format=torch.channels_last).requires_grad_(True)
        for _ in range(2):
            m.zero_grad()
            xr.grad = None
            y = m(xr)
            (y * w).sum(dim=(1, 2, 3)).mean().backward()
        two = r[name]
        assert (two["y"] - y.detach()).abs().max() < 1e-5, name
        assert (two["gx"] - xr.grad).abs().max() / xr.grad.abs().max() < 1e-5, name
        for pname, p in m.named_parameters():
            assert (two["grads"][pname] - p.grad).abs().max() / p.grad.abs().max() < 1e-5, (name, pname)
        for k, v in m.state_dict().items():
            bound = 1e-5 * max(1.0, float(v.double().abs().max()))
            assert (two["state"][k].double() - v.double()).abs().max() <= bound, k


# ------------------------------------------------------------------------------ checkpoints, folding, models
def _gnetdet_batch(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (n, 3, 224, 224), generator=g).float()
    target = torch.zeros(n, 14, 14, 13)
    target[:, 3:9, 4:10, 0:2] = 0.5
    target[:, 3:9, 4:10, 2:4] = 0.3
    target[:, 3:9, 4:10, 4] = 1.0
    target[:, 3:9, 4:10, 10] = 1.0
    return x, target


def test_state_dict_loads_into_plain_model_and_folds_alike_device_cpu():
    torch.manual_seed(0)
    plain = GNetDet(3, 224, 0.0625)
    ours = convert_inplace_abn(copy.deepcopy(plain))
    assert count_inplace_abn(ours) == 15 and list(ours.state_dict()) == list(plain.state_dict())
    x, target = _gnetdet_batch()
    opt = torch.optim.SGD(ours.parameters(), lr=1e-3)
    for _ in range(2):                                         # train with it: parameters and statistics move
        opt.zero_grad()
        ours.loss(ours(x), target)["total"].backward()
        opt.step()
    assert int(ours.layers[0].bn.num_batches_tracked) == 2
    state = copy.deepcopy(ours.state_dict())
    fresh = GNetDet(3, 224, 0.0625)
    fresh.load_state_dict(state)                               # strict: the keys of BatchNorm2d
    ours.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(ours(x), fresh(x))                  # evaluation: BatchNorm2d + ReLU exactly
    # BN folding reads the same buffers and parameters: the same folded convs, bit for bit
    assert fold_bn(ours) == fold_bn(fresh) == 15
    for a, b in zip(ours.convs(), fresh.convs()):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    with torch.no_grad():
        assert torch.equal(ours(x), fresh(x))                  # after folding the QReLU computes again


def _grads(model, x, target):
    model.zero_grad(set_to_none=True)
    pred = model(x)
    model.loss(pred, target)["total"].backward()
    return pred.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_convert_gnetdet_keeps_outputs_and_gradients_device_cpu():
    torch.manual_seed(0)
    base = GNetDet(3, 224, 0.0625)
    freeze_biases_before_bn(base)                              # as training does: those biases' gradients are round-off
    x, target = _gnetdet_batch(1)
    # against the trainer's CPU BatchNorm (DistBatchNorm2d): the same forward arithmetic -> equal outputs
    dist_model = convert_sync_batchnorm(copy.deepcopy(base))
    ours = convert_inplace_abn(copy.deepcopy(dist_model))
    assert all(isinstance(l.bn, BatchNormAct2d) and l.bn.sync for l in ours.layers[:-1])
    p_ref, g_ref = _grads(dist_model, x, target)
    p_ours, g_ours = _grads(ours, x, target)
    assert torch.equal(p_ref, p_ours)
    assert g_ref.keys() == g_ours.keys()
    # gradients: each of the 15 BatchNorm backwards differs by <= K u of its terms' scale (module
    # docstring of this file), and the differences add along the chain: <= 15 K u ~ 6e-5 of each
    # parameter's largest gradient (the ReLU masks are the same: the forwards are equal)
    for name, g in g_ref.items():
        assert (g_ours[name] - g).abs().max() <= 15 * K * U * g.abs().max(), name
    for a, b in zip(dist_model.modules(), ours.modules()):
        if isinstance(a, nn.BatchNorm2d):
            assert torch.equal(a.running_mean, b.running_mean) and torch.equal(a.running_var, b.running_var)
    # memory: the converted model keeps no BatchNorm input, and for each ReLU only z where y == 0;
    # the QReLU's hook leaves no second copy of the output
    bn_in, zeros = [], []

    def record(m, inputs, out):
        bn_in.append(inputs[0].numel() * 4)
        zeros.append(int((out <= 0).sum()) * 4)

    hooks = [l.bn.register_forward_hook(record) for l in dist_model.layers[:-1]]
    b_ref, _ = _saved_bytes(dist_model, x)
    for h in hooks:
        h.remove()
    b_ours, _ = _saved_bytes(ours, x)
    assert b_ours == b_ref - sum(bn_in) + sum(zeros)
    assert b_ours < 0.9 * b_ref
    # against torch's BatchNorm2d (float32 statistics): the same function to float32 rounding. The
    # forwards differ by ~15 x 2 x K u ~ 1e-4 relative; the gradients also see the few ReLU outputs
    # within that of 0 take the other branch, hence 1e-3 of each parameter's largest gradient
    plain = copy.deepcopy(base)
    p_plain, g_plain = _grads(plain, x, target)
    assert (p_plain - p_ours).abs().max() <= 1e-4 * p_plain.abs().max()
    for name, g in g_plain.items():
        assert (g_ours[name] - g).abs().max() <= 1e-3 * g.abs().max(), name


def test_convert_units_and_sequential_device_cpu():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.LeakyReLU(0.2),
                        nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))   # the last BN has no activation: kept
    units = nn.Sequential(ConvBNLayer(3, 8, 3, 1, act="relu"), ConvBNLayer(8, 8, 3, 1, act="leaky"),
                          ConvBNLayer(8, 8, 1, 1, act=None))
    x = torch.randn(4, 3, 12, 12)
    for model in (seq, units):
        ref = copy.deepcopy(model)
        weights = [m.weight for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
        assert convert_inplace_abn(model) is model and count_inplace_abn(model) == 2
        assert [m.weight for m in model.modules() if isinstance(m, nn.BatchNorm2d)] == weights   # shared
        assert list(model.state_dict()) == list(ref.state_dict())
        # training mode, batch statistics: torch's float32 kernels against ours, 3 layers, each within
        # K u of its terms' scale (~3 |y|) of float64: 6 x 64 u x 3 ~ 7e-5 of the largest output
        y_ref, y_ours = ref.train()(x), model.train()(x)
        assert (y_ref - y_ours).abs().max() <= 1e-4 * y_ref.abs().max()
    acts = [(m.activation, m.slope) for m in seq.modules() if isinstance(m, BatchNormAct2d)]
    assert acts == [("relu", 0.01), ("leaky_relu", 0.2)]
    assert isinstance(seq[2], nn.Identity) and isinstance(seq[5], nn.Identity) and type(seq[7]) is nn.BatchNorm2d
    assert [u.act for u in units] == [None, None, None] and type(units[2].bn) is nn.BatchNorm2d
    # evaluation: a converted ConvBNLayer computes exactly what it computed before
    torch.manual_seed(1)
    unit = ConvBNLayer(3, 8, 3, 1, act="leaky").eval()
    with torch.no_grad():
        unit.bn.running_mean.uniform_(-1, 1), unit.bn.running_var.uniform_(0.5, 2)
        before = unit(x)
        convert_inplace_abn(unit)
        assert unit.act is None and unit.bn.activation == "leaky_relu" and unit.bn.slope == 0.1
        assert torch.equal(unit(x), before)


def two_short_sgd_runs(tmp_path_factory, capsys, name: str, switch: str):
    """The cards work folder's step 1 twice, with the config field ``switch`` false and true: one SGD
    iteration at lr 0.01 from the same start, one thread. Returns ({value: last.pth checkpoint},
    {value: the run's stdout}, the config file's path)."""
    from test_pipeline import make_cards_workdir
    from gnetmdk.checkpoint.io import load_checkpoint
    from gnetmdk.config import build_config, load_config_class
    from gnetmdk.engine.cli import run_stage
    torch.set_num_threads(1)
    root, path = make_cards_workdir(tmp_path_factory, name)
    tmp = tmp_path_factory.mktemp(name + "-runs")
    ckpts, logs = {}, {}
    for on in ("false", "true"):
        cfg = build_config(load_config_class(path), [
            "checkpoint_root", str(tmp / on), "log_root", str(tmp / ("log-" + on)), switch, on,
            "max_iters", "1", "eval_before", "false", "optimizer", "sgd", "learning_rate", "0.01",
            "warmup_epochs", "0"], step=1)
        run_stage(cfg)
        ckpts[on] = load_checkpoint(str(tmp / on / "step1" / "last.pth"))
        logs[on] = capsys.readouterr().out
    return ckpts, logs, path


def assert_one_sgd_step_apart(plain: dict, other: dict, path: str) -> None:
    """Two runs' weights after :func:`two_short_sgd_runs`' one SGD step from the same start (the
    config's seed-0 model), one computing the gradients with float32 kernels of another summation
    order: ``w1 = fl(w0 - lr g)``, so per tensor they differ by lr x the gradients' rounding plus the
    two roundings of the update. The gradients' rounding is at most K u of the magnitude of their
    terms (module docstring), which exceeds the gradient itself where its terms cancel; allowing a
    cancellation factor of 25 on K u = 3.8e-6 gives 1e-4 of the tensor's largest step, plus one ulp
    (2^-23 relative) of each value for the update's roundings. The running statistics take one batch's
    mean and variance (K u of their terms): 1e-5 relative. A second step is not compared: it starts
    from weights that differ, and the loss's curvature carries that difference on without a bound.
    The weights must have moved by more than 1e-3 (the check is not of two unchanged models)."""
    from gnetmdk.config import build_config, load_config_class
    from gnetmdk.models import model_from_config
    torch.manual_seed(0)
    start = model_from_config(build_config(load_config_class(path), [])).state_dict()
    assert list(plain) == list(other)
    moved = 0.0
    for k, v in plain.items():
        if not v.is_floating_point():
            continue
        if k.endswith(("running_mean", "running_var")):
            assert torch.allclose(other[k], v, rtol=1e-5, atol=1e-6), k
            continue
        step = float((v - start[k]).abs().max())
        bound = 1e-4 * step + 2.0 ** -23 * v.abs()
        assert bool(((other[k] - v).abs() <= bound).all()), (k, float((other[k] - v).abs().max()), step)
        moved = max(moved, step)
    assert moved > 1e-3


def test_config_switch_converts_and_trains_like_batchnorm_device_cpu(tmp_path_factory, capsys):
    """``inplace_abn true`` in a training run: the log names the fused layers, the checkpoint has the
    plain model's keys, and one SGD step ends where the BatchNorm2d + ReLU run's step ends, within the
    gradients' rounding (:func:`assert_one_sgd_step_apart`; SGD, because Adam would turn round-off
    in near-zero gradients into steps of ~lr)."""
    from gnetmdk.models.rebuild import build_model_from_checkpoint
    ckpts, logs, path = two_short_sgd_runs(tmp_path_factory, capsys, "abn", "inplace_abn")
    for ck in ckpts.values():
        assert count_inplace_abn(build_model_from_checkpoint(ck)) == 0      # loads into the plain model
    assert "in-place activated BatchNorm: 15 BatchNorm + activation pairs fused" in logs["true"]
    assert "in-place activated" not in logs["false"]
    assert_one_sgd_step_apart(ckpts["false"]["model"], ckpts["true"]["model"], path)
