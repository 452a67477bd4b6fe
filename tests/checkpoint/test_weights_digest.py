"""weights_sha256 (device cpu): the digest that tells two runs' weights equal bit for bit."""
from __future__ import annotations

import pytest
import torch

from gnetmdk.checkpoint import weights_sha256


def _state():
    g = torch.Generator().manual_seed(0)
    return {"conv.weight": torch.randn(4, 3, 3, 3, generator=g), "bn.num_batches_tracked": torch.tensor(7),
            "head.bias": torch.randn(5, generator=g).to(torch.bfloat16), "empty": torch.zeros(0, 2)}


def test_digest_ignores_entry_order_and_layout_device_cpu():
    a = _state()
    b = dict(reversed(list(a.items())))
    b["conv.weight"] = a["conv.weight"].permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)   # same values, other strides
    assert not b["conv.weight"].is_contiguous()
    assert weights_sha256(a) == weights_sha256(b)
    assert len(weights_sha256(a)) == 64


@pytest.mark.parametrize("edit", ["one_ulp", "dtype", "shape", "name"])
def test_digest_changes_with_any_bit_dtype_shape_or_name_device_cpu(edit):
    a, b = _state(), _state()
    w = a["conv.weight"]
    if edit == "one_ulp":               # the smallest change a float32 can take, in one element
        flat = w.clone().reshape(-1)
        flat[5] = torch.nextafter(flat[5], torch.tensor(float("inf")))
        b["conv.weight"] = flat.reshape(w.shape)
    elif edit == "dtype":
        b["conv.weight"] = w.to(torch.float64)
    elif edit == "shape":
        b["conv.weight"] = w.reshape(12, 9)
    else:
        b["conv2.weight"] = b.pop("conv.weight")
    assert weights_sha256(a) != weights_sha256(b)


def test_digest_refuses_an_entry_that_is_not_a_tensor_device_cpu():
    with pytest.raises(TypeError, match="'step'"):
        weights_sha256({"w": torch.zeros(2), "step": 3})
