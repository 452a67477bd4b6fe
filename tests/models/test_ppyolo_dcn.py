"""PP-YOLO DCNv2 (gnetmdk.models.ppyolo.dcn) against a direct loop, gradcheck and F.conv2d; device cpu."""
import math

import pytest
import torch
import torch.nn.functional as F

from gnetmdk.models.ppyolo.dcn import DeformConv2d, deform_conv2d

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _bilinear(img, y, x):
    """Bilinear sample of a (H, W) float64 tensor at (y, x) input pixels, zero outside (DCN rule)."""
    h, w = img.shape
    if y <= -1 or y >= h or x <= -1 or x >= w:
        return 0.0
    y0, x0 = math.floor(y), math.floor(x)
    ly, lx = y - y0, x - x0
    total = 0.0
    for yy, wy in ((y0, 1 - ly), (y0 + 1, ly)):
        for xx, wx in ((x0, 1 - lx), (x0 + 1, lx)):
            if 0 <= yy < h and 0 <= xx < w:
                total += wy * wx * float(img[yy, xx])
    return total


def _reference(x, offset, mask, weight, bias, stride, pad, dil):
    """y[n,o,p] = b_o + sum_{c,k} w[o,c,k] * x_c(p0 + p_k + dp_k) * m_k, one scalar at a time."""
    n, c, h, w = x.shape
    o, _, kh, kw = weight.shape
    ho = (h + 2 * pad - dil * (kh - 1) - 1) // stride + 1
    wo = (w + 2 * pad - dil * (kw - 1) - 1) // stride + 1
    out = torch.zeros(n, o, ho, wo, dtype=torch.float64)
    for b in range(n):
        for oy in range(ho):
            for ox in range(wo):
                for i in range(kh):
                    for j in range(kw):
                        k = i * kw + j
                        py = oy * stride - pad + i * dil + float(offset[b, 2 * k, oy, ox])
                        px = ox * stride - pad + j * dil + float(offset[b, 2 * k + 1, oy, ox])
                        m = float(mask[b, k, oy, ox])
                        for ci in range(c):
                            v = _bilinear(x[b, ci], py, px) * m
                            for oc in range(o):
                                out[b, oc, oy, ox] += float(weight[oc, ci, i, j]) * v
                for oc in range(o):
                    out[b, oc, oy, ox] += float(bias[oc])
    return out


@pytest.mark.parametrize("stride,pad,dil", [(1, 1, 1), (2, 1, 1), (1, 2, 2)])
def test_dcn_matches_direct_loop_device_cpu(stride, pad, dil):
    """float64 on cpu; offsets up to +-2.5 px so some taps fall partly or wholly outside the image."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(3, 2, 3, 3, generator=g, dtype=torch.float64)
    bias = torch.randn(3, generator=g, dtype=torch.float64)
    ho = (5 + 2 * pad - dil * 2 - 1) // stride + 1
    wo = (4 + 2 * pad - dil * 2 - 1) // stride + 1
    offset = (torch.rand(2, 18, ho, wo, generator=g, dtype=torch.float64) - 0.5) * 5.0
    mask = torch.rand(2, 9, ho, wo, generator=g, dtype=torch.float64)
    got = deform_conv2d(x, offset, mask, weight, bias, stride, pad, dil)
    want = _reference(x, offset, mask, weight, bias, stride, pad, dil)
    assert got.shape == want.shape == (2, 3, ho, wo)
    # float64: both sides sum 2*9 products of O(1) numbers; 1e-12 is ~4500 ulps of 2^-52 headroom
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_dcn_gradcheck_float64_device_cpu():
    """Gradients w.r.t. input, offsets, mask, weight and bias against finite differences (cpu)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    # generic fractional offsets: no sampling point within 1e-3 of a pixel grid line, so the
    # finite-difference step (1e-6) never crosses a kink of the bilinear interpolation
    offset = (0.1 + 0.8 * torch.rand(1, 18, 4, 4, generator=g, dtype=torch.float64)) * \
        torch.where(torch.rand(1, 18, 4, 4, generator=g) < 0.5, -1.0, 1.0).double()
    offset.requires_grad_(True)
    mask = torch.rand(1, 9, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 2, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: deform_conv2d(*a, stride=1, padding=1, dilation=1),
                                    (x, offset, mask, weight, bias), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("stride,pad,dil", [(1, 1, 1), (2, 1, 1), (1, 2, 2)])
def test_zero_offset_unit_mask_is_conv2d_device_cpu(stride, pad, dil):
    g = torch.Generator().manual_seed(2)
    c, h, w = 8, 13, 11
    x = torch.randn(2, c, h, w, generator=g)
    weight = torch.randn(5, c, 3, 3, generator=g)
    ref = F.conv2d(x, weight, None, stride, pad, dil)
    ho, wo = ref.shape[2:]
    got = deform_conv2d(x, torch.zeros(2, 18, ho, wo), torch.ones(2, 9, ho, wo), weight, None, stride, pad, dil)
    # float32 bound: each output is a sum of n = c*9 products, rounding <= n * 2^-24 * sum|w x|; the
    # pixel -> grid -> pixel round trip moves an integer sampling point by a few ulps of max(h, w),
    # leaking at most ~4 * max(h, w) * 2^-24 of each sampled value. Together:
    tol = (c * 9 + 4 * max(h, w)) * 2.0 ** -24 * F.conv2d(x.abs(), weight.abs(), None, stride, pad, dil)
    assert ((got - ref).abs() <= tol).all()
    # float64: the same identity at double precision
    x64, w64 = x.double(), weight.double()
    got64 = deform_conv2d(x64, torch.zeros(2, 18, ho, wo, dtype=torch.float64),
                          torch.ones(2, 9, ho, wo, dtype=torch.float64), w64, None, stride, pad, dil)
    torch.testing.assert_close(got64, F.conv2d(x64, w64, None, stride, pad, dil), rtol=0, atol=1e-12)


def test_offset_channel_order_is_dy_then_dx_device_cpu():
    """dx = +1 on every tap shifts the sampling one column right: output column x equals the
    ordinary conv's column x + 1 (zero padding on both sides); dy = +1 shifts rows."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 6, 7, generator=g, dtype=torch.float64)
    weight = torch.randn(2, 3, 3, 3, generator=g, dtype=torch.float64)
    conv = F.conv2d(x, weight, padding=1)
    ones = torch.ones(1, 9, 6, 7, dtype=torch.float64)
    dx = torch.zeros(1, 18, 6, 7, dtype=torch.float64)
    dx[:, 1::2] = 1.0
    out = deform_conv2d(x, dx, ones, weight, None, 1, 1, 1)
    torch.testing.assert_close(out[..., :-1], conv[..., 1:], rtol=0, atol=1e-12)
    dy = torch.zeros(1, 18, 6, 7, dtype=torch.float64)
    dy[:, 0::2] = 1.0
    out = deform_conv2d(x, dy, ones, weight, None, 1, 1, 1)
    torch.testing.assert_close(out[:, :, :-1], conv[:, :, 1:], rtol=0, atol=1e-12)


def test_module_starts_at_half_the_plain_conv_device_cpu():
    """Offset/mask conv initialised to zero (PaddleDetection): offsets 0, mask sigmoid(0) = 0.5."""
    torch.manual_seed(4)
    m = DeformConv2d(4, 6, 3, stride=2, padding=1, bias=False).double()
    assert m.offset_conv.out_channels == 27
    assert torch.count_nonzero(m.offset_conv.weight) == 0 and torch.count_nonzero(m.offset_conv.bias) == 0
    x = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    torch.testing.assert_close(m(x), 0.5 * F.conv2d(x, m.weight, None, 2, 1), rtol=0, atol=1e-12)
    # the mask is the last 9 channels through a sigmoid: a mask bias of +40 makes it 1 - 4e-18
    with torch.no_grad():
        m.offset_conv.bias[18:] = 40.0
    torch.testing.assert_close(m(x), F.conv2d(x, m.weight, None, 2, 1), rtol=0, atol=1e-12)


def test_bad_offset_shape_raises_device_cpu():
    x = torch.zeros(1, 2, 5, 5)
    with pytest.raises(ValueError, match="offset must have shape"):
        deform_conv2d(x, torch.zeros(1, 9, 5, 5), None, torch.zeros(3, 2, 3, 3), None, 1, 1, 1)
