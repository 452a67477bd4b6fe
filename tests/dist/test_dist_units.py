"""Units of the distributed toolkit: synchronised BatchNorm, exact distributed percentiles, samplers,
launcher helpers (docs/distributed.md)."""
from __future__ import annotations

import copy

import pytest
import torch

from gnetmdk.layers.observers import batch_percentile

from dist_helpers import ROOT, free_port, run
from gnetmdk.dist.comm import global_percentile, kth_smallest
from gnetmdk.dist.launch import (DistSpec, LaunchError, _classify, check_global_batch, explain_error,
                                 normalise_url)
from gnetmdk.dist.sampler import GlobalBatchSampler, ShardSampler
from gnetmdk.dist.syncbn import DistBatchNorm2d, _SyncBNFunction, convert_sync_batchnorm


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------ SyncBN
SYNCBN_SCRIPT = r'''
import sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from gnetmdk.dist.syncbn import convert_sync_batchnorm
from gnetmdk.dist.comm import global_percentile
from gnetmdk.layers.observers import batch_percentile

N, C = 8, 5

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, C, 6, 7, generator=g) * 3 + 20          # a large mean: the hard case for variance
    w = torch.randn(N, C, 6, 7, generator=g)
    return x, w

def model():
    torch.manual_seed(1)
    bn = torch.nn.BatchNorm2d(C)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5); bn.bias.uniform_(-1, 1)
    return torch.nn.Sequential(bn)

def work(rank, world, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x, w = data()
    b = N // world
    sl = slice(rank * b, (rank + 1) * b)
    xs = x[sl].clone().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    m = convert_sync_batchnorm(model())
    res = {}
    for it in range(2):                                        # two steps: running stats twice
        m.zero_grad()
        xs.grad = None
        y = m(xs)
        ((y * w[sl]).sum(dim=(1, 2, 3)).mean()).backward()     # per-image sum, local batch mean
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    for g_ in grads.values():                                  # what DDP does: average over ranks
        dist.all_reduce(g_); g_ /= world
    outs = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(outs, y.detach().contiguous())
    gx = [torch.empty_like(xs.grad) for _ in range(world)]
    dist.all_gather(gx, xs.grad.contiguous())
    # mixed precision: bfloat16 input, synchronised in float32, output handed back in bfloat16
    mb = convert_sync_batchnorm(model())
    xb = x[sl].to(torch.bfloat16).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    yb = mb(xb)
    ((yb.float() * w[sl]).sum(dim=(1, 2, 3)).mean()).backward()
    outs_b = [torch.empty_like(yb) for _ in range(world)]
    dist.all_gather(outs_b, yb.detach().contiguous())
    gxb = [torch.empty_like(xb.grad) for _ in range(world)]
    dist.all_gather(gxb, xb.grad.contiguous())
    scale = torch.tensor([0.5] * (N // 2) + [1.0] * (N // 2)).view(N, 1, 1, 1)
    v = ((x - 20.5) * scale)[sl]                               # calibration percentile of the global batch
    p_global = global_percentile(v, 99.0)
    p_local = batch_percentile(v, 99.0)
    dist.all_reduce(p_local, op=dist.ReduceOp.MAX)
    if rank == 0:
        torch.save({"y": torch.cat(outs), "gx": torch.cat(gx) / world, "grads": grads,
                    "state": {k: v.clone() for k, v in m.state_dict().items()},
                    "p_global": p_global, "p_local_max": p_local, "type": type(m[0]).__name__,
                    "y_bf16": torch.cat(outs_b), "gx_bf16": torch.cat(gxb) / world,
                    "bf16_running_mean": mb[0].running_mean.clone()}, out)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(work, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2)
'''


def test_syncbn_two_processes_equal_batchnorm_on_the_global_batch(tmp_path):
    script = tmp_path / "syncbn_check.py"
    script.write_text(SYNCBN_SCRIPT)
    out = tmp_path / "out.pt"
    run([str(script), str(free_port()), str(out)], cwd=ROOT, timeout=120).check()
    r = torch.load(out, weights_only=True)
    assert r["type"] == "DistBatchNorm2d"
    # reference: torch's BatchNorm2d on all 8 images in one process, in float64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, 6, 7, generator=g) * 3 + 20
    w = torch.randn(8, 5, 6, 7, generator=g)
    torch.manual_seed(1)
    bn = torch.nn.BatchNorm2d(5)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    bn = bn.double()
    xr = x.double().requires_grad_(True)
    for _ in range(2):
        bn.zero_grad()
        xr.grad = None
        y = bn(xr)
        (y * w.double()).sum(dim=(1, 2, 3)).mean().backward()
    assert (r["y"].double() - y).abs().max() < 1e-5
    assert ((r["gx"].double() - xr.grad).abs().max() / xr.grad.abs().max()) < 1e-5
    for name, p in bn.named_parameters():
        assert ((r["grads"]["0." + name].double() - p.grad).abs().max() / p.grad.abs().max()) < 1e-5, name
    assert list(r["state"]) == ["0." + k for k in bn.state_dict()]   # the keys of BatchNorm2d, in order
    for k, v in bn.state_dict().items():
        got = r["state"]["0." + k].double()
        assert (got - v.double()).abs().max() <= 1e-5 * max(1.0, float(v.double().abs().max())), k
    # bfloat16 input: BatchNorm of the (rounded) global batch, to bfloat16 precision, not the shard's
    bn_b = torch.nn.BatchNorm2d(5).double()                   # fresh running statistics, bn's affine
    with torch.no_grad():
        bn_b.weight.copy_(bn.weight), bn_b.bias.copy_(bn.bias)
    xb = x.to(torch.bfloat16).double().requires_grad_(True)
    yb = bn_b(xb)
    (yb * w.double()).sum(dim=(1, 2, 3)).mean().backward()
    assert r["y_bf16"].dtype == torch.bfloat16 and r["gx_bf16"].dtype == torch.bfloat16
    assert (r["y_bf16"].double() - yb).abs().max() < 0.02 * float(yb.detach().abs().max())      # bfloat16: 8 bits
    assert (r["gx_bf16"].double() - xb.grad).abs().max() < 0.02 * float(xb.grad.abs().max())
    assert (r["bf16_running_mean"].double() - bn_b.running_mean).abs().max() < 1e-4 * 20
    scale = torch.tensor([0.5] * 4 + [1.0] * 4).view(8, 1, 1, 1)
    ref = batch_percentile((x - 20.5) * scale, 99.0)
    assert float(r["p_global"]) == float(ref)                  # exact, bit for bit
    assert float(r["p_local_max"]) != float(ref)               # why calibration needs the global percentile


def test_syncbn_gradcheck_and_single_process_precision():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 6, dtype=torch.double, requires_grad=True)
    w = (torch.rand(3, dtype=torch.double) + 0.5).requires_grad_(True)
    b = torch.randn(3, dtype=torch.double, requires_grad=True)
    head = (None, None, None, 1e-5, 0.1, False, True)
    assert torch.autograd.gradcheck(lambda x, w, b: _SyncBNFunction.apply(*head, x, w, b)[0], (x, w, b))
    # two ranks of one process (virtual ranks) in one node: the BatchNorm of the union of their batches
    assert torch.autograd.gradcheck(
        lambda x1, x2, w, b: torch.cat(_SyncBNFunction.apply(*head, x1, w, b, x2, w, b)),
        (x[:1].detach().clone().requires_grad_(True), x[1:].detach().clone().requires_grad_(True), w, b))
    # channels-last float32 input with a large mean: float64-exact statistics, unlike torch's CPU BatchNorm
    g = torch.Generator().manual_seed(0)
    xx = (torch.randn(8, 16, 28, 28, generator=g) * 0.5 + 20).contiguous(memory_format=torch.channels_last)
    x64 = xx.double()
    var = x64.var((0, 2, 3), unbiased=False, keepdim=True)
    ref = (x64 - x64.mean((0, 2, 3), keepdim=True)) / torch.sqrt(var + 1e-5)
    with torch.no_grad():
        err = float((DistBatchNorm2d(16)(xx).double() - ref).abs().max())
    assert err < 1e-5


def test_syncbn_bf16_input_in_one_process_is_torch_batchnorm():
    # amp: one process hands low-precision input to torch's kernel (float32 statistics): the output,
    # the gradients and the running statistics are exactly BatchNorm2d's, in the input's dtype
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 8, 10, 12, generator=g) * 2 + 5).to(torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 8, 10, 12, generator=g)
    torch.manual_seed(1)
    ref = torch.nn.BatchNorm2d(8)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5), ref.bias.uniform_(-1, 1)
    ours = convert_sync_batchnorm(copy.deepcopy(torch.nn.Sequential(ref)))[0]
    assert isinstance(ours, DistBatchNorm2d)
    outs = []
    for m in (ref, ours):
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        (y.float() * w).sum().backward()
        outs.append((y, xx.grad, m.weight.grad.clone(), m.running_mean.clone(), m.running_var.clone()))
    assert outs[1][0].dtype == torch.bfloat16
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    # and it normalises: per channel the output's mean is beta and its standard deviation gamma
    y = outs[1][0].double()
    assert (y.mean((0, 2, 3)) - ref.bias.double()).abs().max() < 0.02
    assert ((y.std((0, 2, 3), unbiased=False) / ref.weight.double()) - 1).abs().max() < 0.02


def test_converted_model_keeps_keys_folds_and_evaluates_like_batchnorm():
    from gnetmdk.gti.transforms import fold_bn
    from gnetmdk.models.gnetdet.model import GNetDet
    torch.manual_seed(0)
    plain = GNetDet(3, 224, 0.0625)
    conv = convert_sync_batchnorm(copy.deepcopy(plain))
    assert list(conv.state_dict()) == list(plain.state_dict())
    assert sum(isinstance(m, DistBatchNorm2d) for m in conv.modules()) == 15
    x = torch.randint(0, 32, (4, 3, 224, 224)).float()
    with torch.no_grad():
        conv.train()(x)                                        # update running statistics
    state = conv.state_dict()
    plain.load_state_dict(state)                               # interchangeable checkpoints
    conv.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(conv(x), plain(x))                  # eval: running statistics, same as BatchNorm2d
        before = conv(x)
        assert fold_bn(conv) == 15
        after = conv(x)
    assert (after - before).abs().max() <= 1e-4 * max(1.0, float(before.abs().max()))


# ------------------------------------------------------------------------------------ percentiles
@pytest.mark.parametrize("seed", range(5))
def test_distributed_kth_value_is_exact(seed):
    ident = lambda t: t  # noqa: E731
    g = torch.Generator().manual_seed(seed)
    for trial in range(40):
        n = int(torch.randint(1, 400, (1,), generator=g))
        x = torch.randn(n, generator=g) * float(torch.rand(1, generator=g)) * 100
        if trial % 3 == 0:
            x = torch.round(x)                                 # ties
        if trial % 5 == 0:
            x[: n // 2] = -0.0
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        assert float(kth_smallest(x, k, ident, ident, ident)) == float(x.kthvalue(k).values)
        p = min(100.0, float(torch.rand(1, generator=g)) * 100 + 1e-3)
        assert float(global_percentile(x, p)) == float(batch_percentile(x, p))
    neg = -torch.rand(50, generator=g)                          # no positive value: the largest is used
    assert float(global_percentile(neg, 99.0)) == float(neg.max())


# ------------------------------------------------------------------------------------ samplers
@pytest.mark.parametrize("world", [2, 4])
def test_global_batches_are_the_same_for_any_process_count(world):
    one = GlobalBatchSampler(37, 8, 0, 1, shuffle=True, seed=3)
    parts = [GlobalBatchSampler(37, 8, r, world, shuffle=True, seed=3) for r in range(world)]
    for epoch in (0, 1):
        one.set_epoch(epoch)
        for s in parts:
            s.set_epoch(epoch)
        batches = list(one)
        assert len(batches) == 4 and all(len(b) == 8 for b in batches)
        shards = [list(s) for s in parts]
        for i, batch in enumerate(batches):
            assert sum((sh[i] for sh in shards), []) == batch   # contiguous slices, in rank order
        flat = [i for s in shards for b in s for i in b]
        assert len(flat) == len(set(flat))                      # disjoint
    one.set_epoch(0)
    first = list(one)
    one.set_epoch(1)
    assert list(one) != first                                   # one seeded shuffle per epoch
    with pytest.raises(ValueError, match="does not split .*3 process"):
        GlobalBatchSampler(37, 8, 0, 3)


def test_evaluation_shards_cover_every_image_once():
    for world in (1, 2, 3):
        idx = [i for r in range(world) for i in ShardSampler(10, r, world)]
        assert sorted(idx) == list(range(10))


# ------------------------------------------------------------------------------------ launcher helpers
def test_urls_batch_split_and_messages():
    assert normalise_url("10.0.0.1:8888") == "tcp://10.0.0.1:8888"
    assert normalise_url("tcp://host:29500") == "tcp://host:29500"
    for bad in ("host", "host:port", ":80", "host:70000"):
        with pytest.raises(LaunchError, match="host:port"):
            normalise_url(bad)
    check_global_batch(16, DistSpec(gpus=2, num_machines=2))
    with pytest.raises(LaunchError, match=r"batch_size 6 does not split evenly over 4 processes "
                                          r"\(2 machine\(s\) x 2 per machine\).*multiple of 4 \(e.g. 4 or 8\)"):
        check_global_batch(6, DistSpec(gpus=2, num_machines=2))
    assert DistSpec(gpus=2, num_machines=3, machine_rank=2).global_rank(1) == 5
    assert DistSpec(gpus=2, num_machines=3).total == 6


def test_shared_memory_errors_point_to_num_workers():
    for text in ("unable to open shared memory object </torch_5962_408180057> in read-write mode",
                 "DataLoader worker (pid 123) is killed by signal: Bus error. It is possible that dataloader's "
                 "workers are out of shared memory.",
                 "[Errno 24] Too many open files"):
        hint = explain_error(RuntimeError(text))
        assert hint and "num_workers" in hint and "ulimit -n" in hint
        assert _classify(RuntimeError(text), ())[0] == 2
    assert explain_error(RuntimeError("CUDA out of memory")) is None
    code, msg, tb = _classify(RuntimeError("boom"), ())
    assert (code, tb) == (1, True) and msg == "RuntimeError: boom"
    code, msg, tb = _classify(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                                           "Connection closed by peer [127.0.0.1]:1234"), ())
    assert code == 1 and not tb and "another machine" in msg


def test_failure_line_prefers_a_root_cause_and_reads_signals_device_cpu(tmp_path):
    """The launcher's one line after the elastic agent reports failed workers: the earliest record that
    is not a lost connection wins (a user error as 'rank R: ...', exit 2); without records, the exit the
    agent saw (a signal by name, SIGKILL with the out-of-memory hint)."""
    import json
    from gnetmdk.dist.launch import _failure
    spec = DistSpec(gpus=2)
    rec = lambda rank, code, msg, t: json.dump({"rank": rank, "pid": 100 + rank, "code": code, "message": msg,
                                                "time": t, "printed": code == 1},
                                               open(tmp_path / f"rank{rank}.json", "w"))
    rec(0, 1, "lost the connection to another process (x)", 1.0)
    rec(1, 1, "RuntimeError: boom", 2.0)
    f = _failure([(0, 100, 1)], str(tmp_path), spec)
    assert (f.rank, f.exit_code) == (1, 1)
    assert str(f) == ("rank 1 (pid 101) failed: RuntimeError: boom (traceback above); stopped the other 1 "
                      "worker(s) on this machine")
    rec(1, 2, "config field 'x' is bad", 0.5)
    f = _failure([], str(tmp_path), spec)
    assert (f.exit_code, str(f)) == (2, "rank 1: config field 'x' is bad; stopped the other 1 worker(s) on this machine")
    killed = tmp_path / "killed"
    killed.mkdir()
    json.dump({"rank": 0, "pid": 100, "code": 1, "message": "lost the connection to another process (x)", "time": 1.0},
              open(killed / "rank0.json", "w"))
    f = _failure([(1, 101, -9)], str(killed), spec)                # rank 1 killed; rank 0 lost it
    assert (f.rank, str(f)) == (1, "rank 1 (pid 101) was killed by SIGKILL (out of memory? check dmesg); stopped "
                                   "the other 1 worker(s) on this machine")
    empty = tmp_path / "none"
    empty.mkdir()
    f = _failure([(3, 7, -9)], str(empty), DistSpec(gpus=1))
    assert (f.rank, f.exit_code, str(f)) == (3, 1, "rank 3 (pid 7) was killed by SIGKILL (out of memory? check dmesg)")
    f = _failure([(2, 8, 3)], str(empty), spec)
    assert (f.exit_code, str(f)) == (3, "rank 2 (pid 8) exited with code 3; stopped the other 1 worker(s) on this machine")


def test_elastic_config_is_a_static_rendezvous_without_restarts_device_cpu(tmp_path):
    """Machines, processes per machine, machine rank and the wait go to the agent's LaunchConfig as a
    static rendezvous at machine 0's address, with no restarts and spawned workers."""
    from gnetmdk.dist.launch import _elastic_config
    c = _elastic_config(DistSpec(gpus=3, num_machines=2, machine_rank=1, timeout=2.5), "tcp://10.0.0.1:8888",
                        str(tmp_path))
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node) == (2, 2, 3)
    assert (c.rdzv_backend, c.rdzv_endpoint, c.rdzv_configs) == ("static", "10.0.0.1:8888", {"rank": 1, "timeout": 3})
    assert (c.max_restarts, c.start_method) == (0, "spawn")
