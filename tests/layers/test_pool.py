"""gnetmdk.layers.pool.max_pool_2x2 against F.max_pool2d (device cpu): values and gradients bit for bit,
ties included, and no int64 tensor kept for the backward pass."""
import pytest
import torch
import torch.nn.functional as F

from gnetmdk.layers.pool import max_pool_2x2


def _pair(x):
    a = x.detach().clone().requires_grad_(True)
    b = x.detach().clone().requires_grad_(True)
    return a, b


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_equal_torch_device_cpu(channels_last, dtype):
    """ReLU outputs of coarsely rounded values: most windows hold ties (zeros, equal levels), where the
    first position in row-major order must take the gradient, as in torch."""
    torch.manual_seed(0)
    x = torch.relu(torch.randint(-3, 4, (3, 5, 8, 12)).to(dtype))
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    a, b = _pair(x)
    ya, yb = max_pool_2x2(a), F.max_pool2d(b, 2, 2)
    assert torch.equal(ya, yb)
    g = torch.randn(ya.shape).to(dtype)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(a.grad, b.grad)
    ties = ((x[..., 0::2, 0::2] == x[..., 0::2, 1::2]) & (x[..., 0::2, 0::2] == yb)).sum()
    assert ties > 20                      # the tie rule is exercised, not only distinct maxima
    assert (a.grad != 0).sum() == ya.numel()         # one position per window gets the gradient
    # windows holding NaN route their gradient where torch routes it too
    xn = x.detach().clone()
    xn[0, 0, 0, 1] = xn[0, 1, 2, 2] = xn[0, 1, 3, 3] = float("nan")
    a, b = _pair(xn)
    ya, yb = max_pool_2x2(a), F.max_pool2d(b, 2, 2)
    assert torch.equal(ya.isnan(), yb.isnan()) and torch.equal(ya.nan_to_num(), yb.nan_to_num())
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(a.grad, b.grad)


def test_no_index_tensor_is_kept_device_cpu():
    kept = []

    def pack(t):
        kept.append(t.dtype)
        return t
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        max_pool_2x2(x).sum()
    assert kept and torch.int64 not in kept
    kept.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.max_pool2d(x, 2, 2).sum()
    assert torch.int64 in kept               # what torch keeps, and this function does not


def test_falls_back_to_torch_without_gradient_or_with_odd_sizes_device_cpu():
    x = torch.randn(1, 2, 7, 8, requires_grad=True)
    y = max_pool_2x2(x)
    assert y.grad_fn is not None and "MaxPool2x2" not in type(y.grad_fn).__name__
    with torch.no_grad():
        z = torch.randn(1, 2, 8, 8)
        assert torch.equal(max_pool_2x2(z), F.max_pool2d(z, 2, 2))


def test_gnetdet_gradients_equal_those_with_torchs_pool_device_cpu(monkeypatch):
    """A step-1 GNetDet (BatchNorm, ReLU, four pools) on chip-code-like input: every parameter's
    gradient is the one torch's max pool gives, bit for bit."""
    import gnetmdk.models.gnetdet.model as M
    torch.manual_seed(0)
    model = M.GNetDet(3, image_size=224, width_mult=0.0625)
    x = torch.randint(0, 32, (2, 3, 224, 224)).float()
    grads = {}
    for name, pool in (("ours", max_pool_2x2), ("torch", lambda t: F.max_pool2d(t, 2, 2))):
        monkeypatch.setattr(M, "max_pool_2x2", pool)
        model.zero_grad()
        model(x).square().sum().backward()
        grads[name] = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    assert grads["ours"].keys() == grads["torch"].keys() and len(grads["ours"]) > 10
    for k, g in grads["ours"].items():
        assert torch.equal(g, grads["torch"][k]), k
