"""The CUDA lane (marker ``cuda``): every stage, the chip check, mixed precision, exact resume, record and
replay in deterministic mode, train-dist.py and torchrun, on a GPU. Skipped where torch sees no GPU.

    python3 -m pytest -q -m cuda                 # this lane alone, on a GPU machine

Each test compares the GPU with the CPU on the same checkpoints where the arithmetic allows it: step 4
(float64, integer-valued) and the chip model bit for bit, the calibrated caps within the float32
rounding of a CUDA convolution (derivation at CAP_RTOL), deterministic runs against themselves bit for
bit. ``GNETMDK_CUDA_LANE_DEVICE=cpu`` runs the lane's logic on the CPU (no skip), to check the tests
themselves on a machine without a GPU; the GPU-only checks (sync debug mode, NCCL) then pass through.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from gnetmdk.checkpoint.io import load_checkpoint
from gnetmdk.config import build_config, load_config_class
from gnetmdk.engine.cli import run_stage

from test_pipeline import ROOT, make_cards_workdir

DEV = os.environ.get("GNETMDK_CUDA_LANE_DEVICE", "cuda")
pytestmark = pytest.mark.cuda

#: relative tolerance of a calibrated cap, GPU against CPU. The caps are order statistics (percentile)
#: or histogram minimisers (MSE) of the pre-ReLU values, and an order statistic moves by at most the
#: largest change of the values (it is 1-Lipschitz in the max norm). A value differs between devices
#: by the float32 rounding of its convolution sum in another order: at most n u sum|terms| with
#: n = 9 x 16 = 144 products (the tiny model's widest input) and u = 2^-24, about 1e-5 of the sum of
#: magnitudes per layer; over 16 layers in series, and with the sum of magnitudes a few times the
#: value itself, about 1e-3 relative. The MSE cap is the best of 400 candidates vmax j / 400: a
#: histogram that moves by a few counts can move it by one or two candidates, 0.5%; the bound is 1%.
CAP_RTOL = {"percentile": 1e-3, "mse": 1e-2}


@pytest.fixture(scope="module")
def lane(tmp_path_factory):
    """A tiny cards workspace with a CPU-trained step-1 model (the shared starting point)."""
    torch.set_num_threads(1)
    root, path = make_cards_workdir(tmp_path_factory, "cuda_lane")
    run_stage(_cfg(path, root, "cpu", "base", step=1, extra=["num_epochs", 2]))
    return root, path


def _cfg(path, root, device, name, step=None, cal=False, extra=()):
    over = ["device", device, "checkpoint_root", os.path.join(root, name, "checkpoint"),
            "log_root", os.path.join(root, name, "log"), "model_root", os.path.join(root, name, "model"), *extra]
    return build_config(load_config_class(path), [str(x) for x in over], step=step, cal=cal)


def _seed_from_base(root, name):
    """Copy the shared step-1 checkpoint into run ``name``'s checkpoint folder."""
    dst = os.path.join(root, name, "checkpoint", "step1")
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(root, "base", "checkpoint", "step1", "best.pth"), dst)


@pytest.mark.parametrize("cap_method", ["percentile", "mse"])
def test_every_stage_on_the_gpu_matches_the_cpu(lane, cap_method):
    """step 2 -> cal -> step 3 -> step 4 on the GPU and on the CPU from one step-1 model: the caps agree
    within CAP_RTOL; step 4 built from one step-3 checkpoint gives the same outputs bit for bit."""
    root, path = lane
    caps = {}
    for device in ("cpu", DEV):
        name = f"{cap_method}-{device}"
        _seed_from_base(root, name)
        extra = ["cap_method", cap_method]
        run_stage(_cfg(path, root, device, name, step=2, extra=extra))
        caps[device] = run_stage(_cfg(path, root, device, name, cal=True, extra=extra))["caps"]
        run_stage(_cfg(path, root, device, name, step=3, extra=extra))
        s4 = run_stage(_cfg(path, root, device, name, step=4, extra=extra))
        best = load_checkpoint(os.path.join(root, name, "checkpoint", "step4", "best.pth"))
        assert all(torch.isfinite(v.float()).all() for v in best["model"].values())
        assert 0.0 <= s4["best_map"] <= 1.0
    assert caps[DEV] == pytest.approx(caps["cpu"], rel=CAP_RTOL[cap_method])
    # step 4 from the CPU's step-3 checkpoint, evaluated on both devices: float64 with integer values
    from gnetmdk.chip.cli_util import load_eval_model
    cfg = _cfg(path, root, "cpu", f"{cap_method}-cpu", step=4)
    model, _ = load_eval_model(os.path.join(root, f"{cap_method}-cpu", "checkpoint", "step4", "best.pth"), cfg)
    x = torch.randint(0, 32, (2, 3, 224, 224)).float()
    with torch.no_grad():
        ref = model(x)
        model.to(DEV)
        got = model(x.to(DEV)).cpu()
    assert torch.equal(ref, got)


def test_chip_check_is_bit_exact_with_the_model_on_the_gpu(lane, tmp_path):
    """convert_to_chip, then chip_eval --check with the step-4 model on the GPU: 0 mismatches, equal mAP."""
    root, path = lane
    name = f"pct-{DEV}"
    _seed_from_base(root, name)
    for step, cal in ((2, False), (None, True), (3, False), (4, False)):
        run_stage(_cfg(path, root, DEV, name, step=step, cal=cal))
    ck = os.path.join(root, name, "checkpoint", "step4", "best.pth")
    out = tmp_path / "chip"
    r = _tool("convert_to_chip.py", ck, "--out", out, "--config", path)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _tool("chip_eval.py", out / "chip_model.json", "--check", ck, "--config", path, "device", DEV)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "bit-exact: every activation code of every layer agrees" in r.stdout and "| equal" in r.stdout


@pytest.mark.parametrize("amp_dtype", ["fp16", "bf16"])
def test_mixed_precision_on_the_gpu(lane, amp_dtype):
    """Step 1 under autocast (fp16 with GradScaler, or bf16) trains to finite weights; the quantized
    layers compute in float32 under autocast, so step 2/3 outputs do not change with it."""
    from gnetmdk.engine import runtime as R
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.models import model_from_config
    root, path = lane
    cfg = _cfg(path, root, DEV, f"amp-{amp_dtype}", step=1, extra=["amp", "true", "amp_dtype", amp_dtype,
                                                                   "eval_before", "false"])
    p = R.Precision(cfg, torch.device(DEV))
    if DEV == "cuda":
        assert (p.scaler is not None) == (amp_dtype == "fp16")
    run_stage(cfg)
    last = load_checkpoint(os.path.join(root, f"amp-{amp_dtype}", "checkpoint", "step1", "last.pth"))
    assert all(torch.isfinite(v.float()).all() for v in last["model"].values())
    torch.manual_seed(0)
    model = model_from_config(build_config(load_config_class(path), ["use_bn", "false"])).to(DEV)
    for i, relu in enumerate(model.relus()):
        relu.cap.fill_(2.0 + i % 3)
    x = torch.randint(0, 32, (2, 3, 224, 224)).float().to(DEV)
    for stage in ("step2", "step3"):
        apply_stage(model, STAGES[stage])
        model.train()
        plain = model(x)
        with torch.autocast(DEV, dtype=p.dtype):
            mixed = model(x)
        assert torch.equal(plain, mixed), stage


def test_resume_on_the_gpu_is_exact(lane):
    """Deterministic mode: 2 epochs in one go, and 1 epoch + --resume, give the same weights bit for bit."""
    root, path = lane
    extra = ["deterministic", "true", "num_epochs", 2, "eval_before", "false", "eval_interval", 5,
             "ema", "true", "ema_ramp", 0]
    _seed_from_base(root, "resume-a")
    _seed_from_base(root, "resume-b")
    run_stage(_cfg(path, root, DEV, "resume-a", step=2, extra=extra))
    iters = 8 // 4                                       # max_train_images 8, batch 4
    run_stage(_cfg(path, root, DEV, "resume-b", step=2, extra=extra + ["max_iters", iters]))
    run_stage(_cfg(path, root, DEV, "resume-b", step=2, extra=extra + ["resume", "true"]))
    a = load_checkpoint(os.path.join(root, "resume-a", "checkpoint", "step2", "last.pth"))
    b = load_checkpoint(os.path.join(root, "resume-b", "checkpoint", "step2", "last.pth"))
    assert a["iteration"] == b["iteration"] == 2 * iters
    for part in ("model",):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), k
    for k in a["ema"]["model"]:
        assert torch.equal(a["ema"]["model"][k], b["ema"]["model"][k]), k


def test_record_and_replay_on_the_gpu_bit_for_bit(lane):
    """--deterministic on the GPU: a recorded run and its replay from the recorded weights, step 3 with the
    MSE weight scale (scatter-add, prefix sums and histograms on the device), give the same losses and
    weights bit for bit."""
    root, path = lane
    rec = os.path.join(root, "rec")
    for step, cal in ((2, False), (None, True)):
        _seed_from_base(root, "rr")
        run_stage(_cfg(path, root, DEV, "rr", step=step, cal=cal, extra=["weight_scale", "mse", "cap_method", "mse"]))
    common = ["--config", path, "--step", "3", "--deterministic", "device", DEV, "weight_scale", "mse", "num_epochs", 5,
              "model_root", os.path.join(root, "rr", "model")]
    start = os.path.join(root, "rr", "checkpoint", "step2", "cal.pth")
    a = _train("train.py", *common, "load", start, "--max-iters", 4, "--save-npz", rec, *_out(root, "rr-a"))
    assert a.returncode == 0, a.stderr[-2000:]
    b = _train("train.py", *common, "--replay-npz", rec, *_out(root, "rr-b"))
    assert b.returncode == 0, b.stderr[-2000:]
    lines = [l for l in b.stdout.splitlines() if l.startswith("[replay] iteration")]
    assert len(lines) == 4 and all("diff +0.000e+00" in l for l in lines), lines
    sa = load_checkpoint(os.path.join(root, "rr-a", "checkpoint", "step3", "last.pth"))["model"]
    sb = load_checkpoint(os.path.join(root, "rr-b", "checkpoint", "step3", "last.pth"))["model"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_virtual_ranks_on_the_gpu_record_and_replay_bit_for_bit(lane):
    """Virtual ranks on the GPU (docs/alignment.md): one process with 2 virtual ranks records 3
    deterministic step-1 iterations (each synchronised BatchNorm one autograd node over the ranks, whose
    backward runs on CUDA's engine thread: no rank waits inside it); the replay runs the recording's 2
    ranks as virtual ranks again and gives the same loss terms and the same weights, BatchNorm buffers
    and optimizer state, bit for bit."""
    root, path = lane
    _seed_from_base(root, "virt")
    rec = os.path.join(root, "virt-rec")
    common = ["--config", path, "--step", "1", "--deterministic", "device", DEV, "ema", "true"]
    a = _train("train.py", *common, "virtual_ranks", 2, "--max-iters", 3, "--save-npz", rec,
               "load", os.path.join(root, "virt", "checkpoint", "step1", "best.pth"), *_out(root, "virt-a"))
    assert a.returncode == 0, a.stderr[-2000:]
    assert "2 virtual ranks in each of 1 process(es)" in a.stdout
    b = _train("train.py", *common, "--replay-npz", rec, *_out(root, "virt-b"))
    assert b.returncode == 0, b.stderr[-2000:]
    assert "every loss term equal" in b.stdout
    res = _run([sys.executable, os.path.join(ROOT, "tools", "diff_weights.py"), "--atol", "0", "--state",
                os.path.join(root, "virt-a", "checkpoint", "step1", "last.pth"),
                os.path.join(root, "virt-b", "checkpoint", "step1", "last.pth")])
    assert res.returncode == 0, res.stdout[-2000:]


def test_train_dist_one_gpu_and_torchrun_equal_train_py(lane):
    """train-dist.py --gpus 1 and torchrun --nproc_per_node 1 run the same deterministic computation as
    train.py: the same weights after 3 iterations."""
    root, path = lane
    _seed_from_base(root, "launch")
    base = ["--config", path, "--step", "1", "--deterministic", "--max-iters", 3, "device", DEV,
            "load", os.path.join(root, "launch", "checkpoint", "step1", "best.pth")]
    runs = {"train": _train("train.py", *base, *_out(root, "l-train")),
            "dist": _train("train-dist.py", "--gpus", 1, *base, *_out(root, "l-dist")),
            "torchrun": _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                              "--master_port", str(_free_port()), os.path.join(ROOT, "train-dist.py"),
                              *map(str, base), *_out(root, "l-torchrun")])}
    for k, r in runs.items():
        assert r.returncode == 0, (k, r.stderr[-2000:])
    ref = load_checkpoint(os.path.join(root, "l-train", "checkpoint", "step1", "last.pth"))["model"]
    for k in ("dist", "torchrun"):
        got = load_checkpoint(os.path.join(root, f"l-{k}", "checkpoint", "step1", "last.pth"))["model"]
        assert all(torch.equal(ref[n], got[n]) for n in ref), k


def test_quantized_training_step_never_waits_for_the_gpu(lane):
    """torch.cuda.set_sync_debug_mode('error') around steps 2 and 3 (forward, loss, backward, clipping,
    SGD): no operation reads back from the GPU (the CPU side of this check is tests/dist/test_device.py)."""
    if DEV != "cuda":
        pytest.skip("sync debug mode exists on CUDA only")
    from gnetmdk.engine import runtime as R
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.models.gnetdet.model import GNetDet
    torch.manual_seed(0)
    for method in ("gti", "mse"):
        m = GNetDet(3, 224, 0.0625, use_bn=False, weight_scale=method, gain_aware=True).cuda()
        for i, r in enumerate(m.relus()):
            r.cap.fill_(2.0 + i % 3)
        x = torch.randint(0, 32, (2, 3, 224, 224), device="cuda").float()
        t = torch.zeros(2, 14, 14, 13, device="cuda")
        t[:, 3, 4, 4] = 1.0
        opt = torch.optim.SGD(m.parameters(), lr=1e-4)
        p = R.Precision(build_config(load_config_class(lane[1]), []), torch.device("cuda"))
        for stage in ("step2", "step3"):
            apply_stage(m, STAGES[stage])
            m.train()
            m(x)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                p.backward(m.loss(m(x), t)["total"])
                p.step(opt, list(m.parameters()), 10.0)
                opt.zero_grad(set_to_none=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------------------------------- helpers
def _out(root, name):
    return ["checkpoint_root", os.path.join(root, name, "checkpoint"), "log_root", os.path.join(root, name, "log")]


def _run(args, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([str(a) for a in args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _train(script, *args):
    return _run([sys.executable, os.path.join(ROOT, script), *args])


def _tool(script, *args):
    return _run([sys.executable, os.path.join(ROOT, "tools", script), *args])


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("channels_last", [False, True])
def test_index_free_max_pool_equals_torchs_on_the_gpu(channels_last):
    """gnetmdk.layers.pool.max_pool_2x2 assumes the device's max-pool kernel sends a tied window's
    gradient to its first position: on the GPU too, its gradients are torch's bit for bit."""
    import torch.nn.functional as F
    from gnetmdk.layers.pool import max_pool_2x2
    torch.manual_seed(0)
    x = torch.relu(torch.randint(-3, 4, (4, 8, 16, 16)).float()).to(DEV)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = max_pool_2x2(a), F.max_pool2d(b, 2, 2)
    g = torch.randn(ya.shape, device=DEV)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb) and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("channels_last", [False, True])
def test_recomputed_stem_equals_the_block_on_the_gpu(channels_last):
    """gnetmdk.layers.stem on the GPU (recomputed per chunk, one image per chunk, in the backward pass)
    and conv -> BatchNorm -> ReLU -> max pool with torch's kernels, each against the float64 reference
    of tests/layers/test_stem.py computed on the CPU: outputs, gradients and running statistics element by
    element within 2 n u of the magnitudes of their terms (u = 2^-53; n = 4 x 64 x 64, the longest sum,
    a bound on the rounding of a sum of n terms in any order: Higham, "Accuracy and Stability of
    Numerical Algorithms", 2nd ed., sec. 4.2; twice for the GPU's and the reference's own rounding).

    The GPU runs in float64: in float32 cuDNN may pick Winograd or FFT convolutions, whose error is not
    bounded by the magnitudes of the sum's terms, so no tolerance for them could be derived; the
    float32 arithmetic of the stem is bounded on the CPU (tests/layers/test_stem.py)."""
    import copy
    import gnetmdk.layers.stem as stem
    from test_stem import _block, _check, _data, _margins_ok, _ours, _plain, _reference
    conv, bn = _block(1, cin=3, cout=16)
    x = _data(2, shape=(4, 3, 64, 64), channels_last=channels_last)
    up = torch.randn(4, 16, 32, 32, generator=torch.Generator().manual_seed(3))
    ref = _reference(x, conv, bn, "relu", 0.0, True, up)
    n, u = 4 * 64 * 64, 2.0 ** -53
    assert _margins_ok(ref, True, k=2 * n, u=u)  # ReLU signs and pool positions cannot flip
    chunk = stem.CHUNK_ELEMENTS
    stem.CHUNK_ELEMENTS = 1
    try:
        for run in (_ours, _plain):
            c64, b64 = copy.deepcopy(conv).double().to(DEV), copy.deepcopy(bn).double().to(DEV)
            x64 = x.double().to(DEV)
            y, gx, c2, b2 = run(x64, c64, b64, "relu", 0.0, True, up.double().to(DEV))
            assert y.device.type == torch.device(DEV).type
            c2, b2 = c2.cpu(), b2.cpu()
            _check(y.cpu(), gx.cpu(), c2, b2, ref, k=2 * n, u=u)
            assert torch.allclose(b2.running_mean, 0.1 * ref["mean"], rtol=2 * n * u, atol=0)
            assert torch.allclose(b2.running_var, 0.9 + 0.1 * ref["var_unbiased"], rtol=2 * n * u, atol=0)
    finally:
        stem.CHUNK_ELEMENTS = chunk


@pytest.mark.parametrize("weight_scale", ["gti", "mse"])
def test_weights_quantized_in_one_pass_equal_each_conv_alone_on_the_gpu(weight_scale, monkeypatch):
    """The one-pass weight quantization (GNetDet.batch_weight_quant) on the GPU: outputs and gradients
    of step 2 and gain-aware step 3 (learned caps) equal each conv quantizing its own, bit for bit, in
    deterministic mode (the MSE sweep's float64 scatter-add is order-dependent otherwise)."""
    from gnetmdk.engine.stages import STAGES, apply_stage
    from gnetmdk.models.gnetdet.model import GNetDet
    from test_model import _step
    torch.manual_seed(0)
    m = GNetDet(3, 224, 0.25, use_bn=False, mask_bits=[8, 3, 3, 3, 1, 8], weight_scale=weight_scale,
                gain_aware=True).to(DEV)
    with torch.no_grad():
        for k, r in enumerate(m.relus()):
            r.cap.fill_(2.0 + 0.37 * k)
    x = torch.randint(0, 32, (2, 3, 224, 224), device=DEV).float()
    old = torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")      # the MSE sweep's prefix sums are products
    torch.use_deterministic_algorithms(True)
    try:
        for stage, learn in (("step2", False), ("step3", True)):
            for r in m.relus():
                r.cap.requires_grad_(learn)
            apply_stage(m, STAGES[stage])
            m.train()
            y0, g0, c0 = _step(m, x, False)
            y1, g1, c1 = _step(m, x, True)
            assert torch.equal(y0, y1), stage
            for a, b in zip(g0 + c0, g1 + c1):
                assert (a is None and b is None) or torch.equal(a, b), stage
    finally:
        torch.use_deterministic_algorithms(old)
