"""Paddle weight files without Paddle: the restricted reader (gnetmdk.checkpoint.paddle) and the PaddleDetection
PP-YOLO name mapping / class surgery (gnetmdk.models.ppyolo.convert); device cpu.

No Paddle file can be downloaded here, so the files are written by this module the way PaddlePaddle writes
them (``python/paddle/framework/io.py`` ``_legacy_save`` / ``_build_saved_state_dict`` / ``_pickle_save``,
``io_utils.py`` ``_unpack_saved_dict`` / ``_legacy_static_save``), with the parameter names and shapes that
PaddleDetection's layers would have: ``pd_*`` below re-state PaddleDetection's constructors
(``ppdet/modeling/backbones/resnet.py``, ``necks/yolo_fpn.py``, ``heads/yolo_head.py``, static-era
``resnet.py`` / ``name_adapter.py`` for the fluid names), independently of the mapping code; ``expected_key``
translates a Paddle name to our key with string rules, again independently of convert.py's structure walk.
"""
import os
import pickle
import re
import struct
import subprocess
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from gnetmdk.checkpoint.paddle import (BIG_PARAM_KEY, NAME_TABLE_KEY, PaddleFormatError, read_paddle_params,
                                       read_paddle_state)
from gnetmdk.models.ppyolo import PPYOLO, PPYOLO_R50VD, ppyolo_r18vd, ppyolo_r50vd
from gnetmdk.models.ppyolo.convert import convert_paddle_state, paddle_names, rebuild_class_rows

torch.set_num_threads(1)
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- Paddle-side emulation
def pd_conv_norm(out, name, cin, cout, k, dcn=False):
    """resnet.py ConvNormLayer: [conv_offset (DCNv2)], conv, norm (BatchNorm2D)."""
    if dcn:
        out[f"{name}.conv_offset.weight"] = (3 * k * k, cin, k, k)
        out[f"{name}.conv_offset.bias"] = (3 * k * k,)
    out[f"{name}.conv.weight"] = (cout, cin, k, k)
    for p in ("weight", "bias", "_mean", "_variance"):
        out[f"{name}.norm.{p}"] = (cout,)


def pd_resnet(depth, num_stages=4, dcn_v2_stages=()):
    """resnet.py ResNet(variant='d'), names relative to the backbone: {name: shape}."""
    out = OrderedDict()
    for j, (ci, co) in enumerate([(3, 32), (32, 32), (32, 64)]):
        pd_conv_norm(out, f"conv1.conv1_{j + 1}", ci, co, 3)
    counts = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 6, 3]}[depth]
    bottleneck = depth >= 50
    exp = 4 if bottleneck else 1
    ch_in = 64
    for i in range(num_stages):
        n, ch_out, dcn = i + 2, [64, 128, 256, 512][i], i in dcn_v2_stages
        for b in range(counts[i]):
            blk = f"res{n}.res{n}{chr(ord('a') + b)}"
            stride = 2 if b == 0 and n != 2 else 1
            if b == 0:   # shortcut=False: 'd' variant and stride 2 -> Sequential(pool, conv)
                pd_conv_norm(out, blk + (".short.conv" if stride == 2 else ".short"), ch_in, ch_out * exp, 1)
            if bottleneck:
                pd_conv_norm(out, blk + ".branch2a", ch_in, ch_out, 1)
                pd_conv_norm(out, blk + ".branch2b", ch_out, ch_out, 3, dcn)
                pd_conv_norm(out, blk + ".branch2c", ch_out, ch_out * 4, 1)
            else:
                pd_conv_norm(out, blk + ".branch2a", ch_in, ch_out, 3)
                pd_conv_norm(out, blk + ".branch2b", ch_out, ch_out, 3, dcn)
            if b == 0:
                ch_in = ch_out * exp
    return out


def pd_resnet_fluid(depth, num_stages=4):
    """Static-graph (fluid-era) parameter names of ppdet 0.x resnet.py + NameAdapter, with the ImageNet
    classifier fc_0 of the pretrained files: {name: shape}."""
    out = OrderedDict()

    def conv_norm(name, cin, cout, k):
        out[f"{name}_weights"] = (cout, cin, k, k)
        bn = "bn_" + name if name == "conv1" else "bn" + name[3:]
        for p in ("scale", "offset", "mean", "variance"):
            out[f"{bn}_{p}"] = (cout,)

    for j, (ci, co) in enumerate([(3, 32), (32, 32), (32, 64)]):
        conv_norm(f"conv1_{j + 1}", ci, co, 3)
    counts = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 6, 3]}[depth]
    bottleneck = depth >= 50
    exp = 4 if bottleneck else 1
    ch_in = 64
    for i in range(num_stages):
        n, ch_out = i + 2, [64, 128, 256, 512][i]
        for b in range(counts[i]):
            name = f"res{n}{chr(ord('a') + b)}"
            if bottleneck:
                conv_norm(name + "_branch2a", ch_in, ch_out, 1)
                conv_norm(name + "_branch2b", ch_out, ch_out, 3)
                conv_norm(name + "_branch2c", ch_out, ch_out * 4, 1)
            else:
                conv_norm(name + "_branch2a", ch_in, ch_out, 3)
                conv_norm(name + "_branch2b", ch_out, ch_out, 3)
            if b == 0:   # ch_in != ch_out or stride != 1 or (depth < 50 and is_first)
                conv_norm(name + "_branch1", ch_in, ch_out * exp, 1)
                ch_in = ch_out * exp
    out["fc_0.w_0"] = (ch_in, 1000)        # Linear stored (in, out)
    out["fc_0.b_0"] = (1000,)
    return out


def pd_darknet(out, name, cin, cout, k):
    """darknet.py ConvBNLayer: conv, batch_norm."""
    out[f"{name}.conv.weight"] = (cout, cin, k, k)
    for p in ("weight", "bias", "_mean", "_variance"):
        out[f"{name}.batch_norm.{p}"] = (cout,)


def pd_ppyolofpn(in_channels, coord_conv, conv_block_num, drop_block, spp, channels=None, route_channels=None):
    """yolo_fpn.py PPYOLOFPN (widths overridable for narrow test models): {name: shape}."""
    out = OrderedDict()
    nb = len(in_channels)
    channels = channels or [64 * (2 ** nb) // (2 ** i) for i in range(nb)]
    route_channels = route_channels or [256 // (2 ** i) for i in range(nb - 1)]
    for i, ch_in in enumerate(in_channels[::-1]):
        if i > 0:
            ch_in += route_channels[i - 1]
        channel = channels[i]
        base = []
        c_in, c_out = ch_in, channel
        for j in range(conv_block_num):
            base += [(f"conv{2 * j}", "coord" if coord_conv else "conv", c_in, c_out, 1),
                     (f"conv{2 * j + 1}", "conv", c_out, c_out * 2, 3)]
            c_in, c_out = c_out * 2, c_out
        base += [("route", "coord" if coord_conv else "conv", c_in, c_out, 1),
                 ("tip", "coord" if coord_conv else "conv", c_out, c_out * 2, 3)]
        drop = [("dropblock", "drop", 0, 0, 0)] if drop_block else []
        if conv_block_num == 2:
            spp_cfg = [("spp", "spp", channel * 4, channel, 1)] if (spp and i == 0) else []
            cfg = (base[0:3] + spp_cfg + base[3:4] + drop + base[4:6]) if i == 0 else (base[0:2] + drop + base[2:6])
        else:
            spp_cfg = [("spp", "spp", c_in * 4, c_in, 1)] if (spp and i == 0) else []
            cfg = spp_cfg + drop + base
        for name, kind, ci, co, k in cfg:
            full = f"yolo_block.{i}.tip" if name == "tip" else f"yolo_block.{i}.conv_module.{name}"
            if kind == "coord":
                pd_darknet(out, full + ".conv", ci + 2, co, k)
            elif kind == "spp":
                pd_darknet(out, full + ".conv", ci, co, k)
            elif kind == "conv":
                pd_darknet(out, full, ci, co, k)
        if i < nb - 1:
            pd_darknet(out, f"yolo_transition.{i}", channel, route_channels[i], 1)
    return out, [2 * c for c in channels]


def pd_ppyolo(depth, return_idx, dcn_v2_stages, coord_conv, conv_block_num, drop_block, spp, anchor_masks,
              num_classes, iou_aware, channels=None, route_channels=None):
    """architectures/yolo.py YOLOv3(backbone=ResNet, neck=PPYOLOFPN, yolo_head=YOLOv3Head): {name: shape}."""
    exp = 4 if depth >= 50 else 1
    out = OrderedDict(("backbone." + k, v) for k, v in
                      pd_resnet(depth, max(return_idx) + 1, dcn_v2_stages).items())
    neck, head_in = pd_ppyolofpn([[64, 128, 256, 512][i] * exp for i in return_idx], coord_conv, conv_block_num,
                                 drop_block, spp, channels, route_channels)
    out.update(("neck." + k, v) for k, v in neck.items())
    for i, mask in enumerate(anchor_masks):      # yolo_head.py YOLOv3Head
        nf = len(mask) * (num_classes + (6 if iou_aware else 5))
        out[f"yolo_head.yolo_output.{i}.weight"] = (nf, head_in[i], 1, 1)
        out[f"yolo_head.yolo_output.{i}.bias"] = (nf,)
    return out


def fill(shapes, seed=0):
    """Distinct random float32 arrays (variances positive, so an eval forward stays finite)."""
    rng = np.random.default_rng(seed)
    arrays = OrderedDict()
    for k, shp in shapes.items():
        a = rng.standard_normal(shp, dtype=np.float32)
        arrays[k] = np.abs(a) + 0.5 if k.endswith(("_variance", "variance")) else a
    return arrays


def paddle_unpack_saved_dict(obj, max_elements=None):
    """io_utils.py _unpack_saved_dict (protocol 2/3), with an optional smaller element limit for tests."""
    info, out = {}, OrderedDict()
    for key, value in obj.items():
        limit = max_elements or int((2 ** 30 - 1) / value.dtype.itemsize) if isinstance(value, np.ndarray) else None
        if isinstance(value, np.ndarray) and value.size > limit:
            info[key] = {"OriginShape": value.shape, "slices": []}
            flat = value.flatten()
            for i in range(int(np.ceil(value.size / limit))):
                part = key + "@@." + str(i)
                info[key]["slices"].append(part)
                out[part] = flat[i * limit: (i + 1) * limit]
        else:
            out[key] = value
    if info:
        out[BIG_PARAM_KEY] = info
    return out


def paddle_save_state_dict(path, arrays, protocol=2, max_elements=None):
    """io.py _legacy_save of a dygraph state dict: arrays + name table, sliced for protocol 2/3."""
    saved = {k: v for k, v in arrays.items()}
    saved[NAME_TABLE_KEY] = {k: f"param_{i}.w_0" for i, k in enumerate(arrays)}
    if 1 < protocol < 4:
        saved = paddle_unpack_saved_dict(saved, max_elements)
    with open(path, "wb") as f:
        pickle.dump(saved, f, protocol=protocol)
    return path


class PdTensor:
    """Pickles as Paddle >= 2.1 _pickle_save's reduce_varbase: (tuple, ((name, data),))."""

    def __init__(self, name, data):
        self.name, self.data = name, data

    def __reduce__(self):
        return (tuple, ((self.name, self.data),))


_BN = {"weight": "weight", "bias": "bias", "_mean": "running_mean", "_variance": "running_var"}
_FLUID_BN = {"scale": "weight", "offset": "bias", "mean": "running_mean", "variance": "running_var"}


def expected_key(pd):
    """Our state-dict key for a Paddle name, by string rules (independent of convert.py)."""
    m = re.fullmatch(r"(?:backbone\.)?conv1\.conv1_(\d)\.(conv|norm)\.(\w+)", pd)
    if m:
        return f"backbone.stem.{int(m[1]) - 1}." + ("conv.weight" if m[2] == "conv" else "bn." + _BN[m[3]])
    m = re.fullmatch(r"(?:backbone\.)?res(\d)\.res\d([a-z])\.(branch2[abc]|short\.conv|short)\."
                     r"(conv_offset|conv\.conv_offset|conv\.conv_dcn|conv|norm)\.(\w+)", pd)
    if m:
        part = "short.1" if m[3] == "short.conv" else m[3]
        tail = {"conv_offset": f"conv.offset_conv.{m[5]}", "conv.conv_offset": f"conv.offset_conv.{m[5]}",
                "conv.conv_dcn": "conv.weight", "conv": "conv.weight"}.get(m[4]) or "bn." + _BN[m[5]]
        return f"backbone.stages.{int(m[1]) - 2}.{ord(m[2]) - ord('a')}.{part}.{tail}"
    m = re.fullmatch(r"conv1_(\d)_weights", pd)
    if m:
        return f"backbone.stem.{int(m[1]) - 1}.conv.weight"
    m = re.fullmatch(r"bnv1_(\d)_(scale|offset|mean|variance)", pd)
    if m:
        return f"backbone.stem.{int(m[1]) - 1}.bn.{_FLUID_BN[m[2]]}"
    m = re.fullmatch(r"(?:res|bn)(\d)([a-z])_(branch2[abc]|branch1)_(weights|scale|offset|mean|variance)", pd)
    if m:
        part = m[3] if m[3] != "branch1" else ("short" if m[1] == "2" else "short.1")
        tail = "conv.weight" if m[4] == "weights" else "bn." + _FLUID_BN[m[4]]
        return f"backbone.stages.{int(m[1]) - 2}.{ord(m[2]) - ord('a')}.{part}.{tail}"
    if pd.startswith("neck."):
        k = pd.replace("neck.yolo_block.", "neck.blocks.").replace(".conv_module.", ".body.")
        k = k.replace("neck.yolo_transition.", "neck.transitions.").replace(".batch_norm.", ".bn.")
        return k.replace("._mean", ".running_mean").replace("._variance", ".running_var")
    if pd.startswith("yolo_head.yolo_output."):
        return pd.replace("yolo_head.yolo_output.", "head.outputs.")
    raise AssertionError(f"no rule for {pd}")


def _tiny_kw(**kw):
    """A width-reduced 3-level PP-YOLO with every r50vd trick (DCN in the last stage, CoordConv, SPP,
    IoU-aware, conv_block_num 2) on a ResNet18-vd backbone."""
    args = dict(PPYOLO_R50VD, depth=18, num_classes=3, neck_channels=[16, 8, 4], route_channels=[8, 4])
    args.update(kw)
    return args


def _pd_for(kw):
    """The Paddle names/shapes PaddleDetection would save for PPYOLO(**kw)."""
    return pd_ppyolo(kw["depth"], kw["return_idx"], kw["dcn_v2_stages"], kw["coord_conv"], kw["conv_block_num"],
                     kw["drop_block"], kw["spp"], kw["anchor_masks"], kw["num_classes"], kw["iou_aware"],
                     kw.get("neck_channels"), kw.get("route_channels"))


def _assert_loaded(model, arrays, report, key_of=expected_key):
    """Strict load, then every Paddle array equals the model tensor the string rules name."""
    sd_model = model.state_dict()
    assert set(report.matched) == {(n, key_of(n)) for n in arrays}
    for name, arr in arrays.items():
        assert torch.equal(sd_model[key_of(name)], torch.from_numpy(arr)), name


# ----------------------------------------------------------------------------- reader
def test_reader_state_dict_layouts_device_cpu(tmp_path):
    """protocol 2 and 4, name table taken out, OrderedDict container, float32 BN statistics, numbers."""
    rng = np.random.default_rng(1)
    arrays = OrderedDict([("a.weight", rng.standard_normal((4, 3, 3, 3), dtype=np.float32)),
                          ("a.norm._mean", rng.standard_normal(4, dtype=np.float32)),
                          ("a.norm._variance", rng.random(4, dtype=np.float32))])
    for protocol in (2, 3, 4):
        p = paddle_save_state_dict(str(tmp_path / f"m{protocol}.pdparams"), arrays, protocol)
        st = read_paddle_state(p)
        assert list(st.params) == list(arrays) and st.protocol == protocol
        assert st.name_table == {k: f"param_{i}.w_0" for i, k in enumerate(arrays)}
        for k, v in arrays.items():
            assert st.params[k].dtype == np.float32 and np.array_equal(st.params[k], v)
    od = OrderedDict(arrays, step=7, decay=np.float32(0.9998))
    with open(tmp_path / "od.pdema", "wb") as f:
        pickle.dump(od, f, protocol=2)
    st = read_paddle_state(str(tmp_path / "od.pdema"))
    assert "ordered_dict" in st.layouts and st.params["step"].shape == () and int(st.params["step"]) == 7
    assert float(st.params["decay"]) == pytest.approx(0.9998)


def test_reader_joins_sliced_large_arrays_device_cpu(tmp_path):
    """_unpack_saved_dict's '<key>@@.i' slices + 'UnpackBigParamInfor@@' are joined back (limit 1000 here)."""
    rng = np.random.default_rng(2)
    arrays = OrderedDict([("big.weight", rng.standard_normal((7, 5, 3, 3, 3), dtype=np.float32)),  # 945 -> 1 piece
                          ("bigger.weight", rng.standard_normal((64, 9, 3, 3), dtype=np.float32)),  # 5184 -> 6
                          ("small", rng.standard_normal(3, dtype=np.float32))])
    p = paddle_save_state_dict(str(tmp_path / "s.pdparams"), arrays, 2, max_elements=1000)
    with open(p, "rb") as f:
        raw = pickle.load(f)
    assert len(raw[BIG_PARAM_KEY]["bigger.weight"]["slices"]) == 6 and "bigger.weight@@.5" in raw
    st = read_paddle_state(p)
    assert "sliced" in st.layouts and set(st.params) == set(arrays)
    for k, v in arrays.items():
        assert st.params[k].shape == v.shape and np.array_equal(st.params[k], v)
    raw.pop("bigger.weight@@.3")                              # a lost slice is an error, not a short array
    with open(tmp_path / "bad.pdparams", "wb") as f:
        pickle.dump(raw, f, protocol=2)
    with pytest.raises(PaddleFormatError, match=r"bad\.pdparams.*slice"):
        read_paddle_params(str(tmp_path / "bad.pdparams"))


def test_reader_tensor_tuple_and_static_layouts_device_cpu(tmp_path):
    """Paddle >= 2.1 _pickle_save (tuple(name, array)) and static-graph {param name: array} files."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 4, 1, 1), dtype=np.float32)
    with open(tmp_path / "t.pdparams", "wb") as f:
        pickle.dump({"yolo_head.yolo_output.0.weight": PdTensor("conv2d_5.w_0", w), "epoch": 3}, f, protocol=4)
    st = read_paddle_state(str(tmp_path / "t.pdparams"))
    assert "tensor_tuples" in st.layouts and np.array_equal(st.params["yolo_head.yolo_output.0.weight"], w)
    static = {"conv1_1_weights": w, "bnv1_1_scale": w[:, 0, 0, 0].copy()}
    with open(tmp_path / "static.pdparams", "wb") as f:
        pickle.dump(static, f, protocol=2)
    st = read_paddle_state(str(tmp_path / "static.pdparams"))
    assert st.name_table == {} and np.array_equal(st.params["bnv1_1_scale"], static["bnv1_1_scale"])


def _py2_pickle(arrays):
    """Bytes a Python-2 fluid.save (pickle protocol 2) would write: byte strings, numpy.core names."""
    def s(b):
        return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<i", len(b)) + b
    out = b"\x80\x02}q\x00("
    for key, a in arrays.items():
        out += (s(key.encode()) + b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + s(b"b")
                + b"\x87R(K\x01" + b"".join(b"J" + struct.pack("<i", d) for d in a.shape)
                + (b"\x85" if a.ndim == 1 else b"\x86" if a.ndim == 2 else b"")
                + b"cnumpy\ndtype\n" + s(b"f4") + b"K\x00K\x01\x87R(K\x03" + s(b"<")
                + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tbI00\n" + s(a.astype("<f4").tobytes()) + b"tb")
    return out + b"u."


def test_reader_python2_era_pickle_device_cpu(tmp_path):
    """A py2 protocol-2 pickle (byte strings read as latin-1, as paddle.load does) gives the same arrays."""
    rng = np.random.default_rng(4)
    arrays = {"res2a_branch2a_weights": rng.standard_normal((6, 5), dtype=np.float32),
              "bn2a_branch2a_mean": rng.standard_normal(70, dtype=np.float32)}   # 280 bytes: BINSTRING
    (tmp_path / "py2.pdparams").write_bytes(_py2_pickle(arrays))
    got = read_paddle_params(str(tmp_path / "py2.pdparams"))
    assert set(got) == set(arrays)
    for k, v in arrays.items():
        assert got[k].dtype == np.float32 and np.array_equal(got[k], v)


class _Evil:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.parametrize("which", ["os.system", "builtins.eval", "subprocess.Popen", "torch.load"])
@pytest.mark.parametrize("protocol", [2, 4])
def test_reader_refuses_code_in_pickles_device_cpu(tmp_path, which, protocol):
    """Each asks to run code that would create the marker file; refused by name, the marker never appears."""
    marker = tmp_path / "pwned"
    victim = tmp_path / "victim.pt"
    torch.save({"x": 1}, victim)
    payload = {"os.system": (os.system, (f"touch {marker}",)),
               "builtins.eval": (eval, (f"open({str(marker)!r}, 'w').close()",)),
               "subprocess.Popen": (subprocess.Popen, (["touch", str(marker)],)),
               "torch.load": (torch.load, (str(victim),))}[which]
    p = tmp_path / "evil.pdparams"
    with open(p, "wb") as f:
        pickle.dump({"w": np.zeros(3, np.float32), "x": _Evil(*payload)}, f, protocol=protocol)
    with pytest.raises(PaddleFormatError) as ei:
        read_paddle_params(str(p))
    msg = str(ei.value)
    fn_name = which.split(".")[1]
    assert "evil.pdparams" in msg and "not executed" in msg and "refused" in msg
    assert re.search(rf"global \S*\.{fn_name}\b", msg), msg
    assert not marker.exists()


def test_reader_errors_name_file_and_fix_device_cpu(tmp_path):
    """Truncated, not a pickle, zip, not a dict, a non-numeric entry, an object array, missing / folder."""
    arrays = {"a.weight": np.arange(4000, dtype=np.float32)}
    good = paddle_save_state_dict(str(tmp_path / "good.pdparams"), arrays, 2)
    data = open(good, "rb").read()
    for cut in (len(data) // 2, len(data) - 1, 3):
        (tmp_path / "cut.pdparams").write_bytes(data[:cut])
        with pytest.raises(PaddleFormatError, match=r"cut\.pdparams: ends before the pickle is complete.*again"):
            read_paddle_params(str(tmp_path / "cut.pdparams"))
    (tmp_path / "text.pdparams").write_bytes(b"<html>404 Not Found</html>\n")
    with pytest.raises(PaddleFormatError, match=r"text\.pdparams: not a Paddle weight file.*download"):
        read_paddle_params(str(tmp_path / "text.pdparams"))
    (tmp_path / "z.pdparams").write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(PaddleFormatError, match="zip archive"):
        read_paddle_params(str(tmp_path / "z.pdparams"))
    cases = {"list": [np.zeros(2, np.float32)], "str": {"a": "hello"},
             "obj": {"a": np.array([1, "x"], dtype=object)}, "nested": {"model": {"w": np.zeros(2)}}}
    for name, obj in cases.items():
        with open(tmp_path / f"{name}.pdparams", "wb") as f:
            pickle.dump(obj, f, protocol=2)
        with pytest.raises(PaddleFormatError, match=rf"{name}\.pdparams: .*(not a dict|neither an array nor a "
                                                    rf"number|not of numbers)"):
            read_paddle_params(str(tmp_path / f"{name}.pdparams"))
    with pytest.raises(PaddleFormatError, match="does not exist"):
        read_paddle_params(str(tmp_path / "absent.pdparams"))
    with pytest.raises(PaddleFormatError, match="is a folder"):
        read_paddle_params(str(tmp_path))


# ----------------------------------------------------------------------------- mapping
def test_convert_r18vd_preset_from_file_device_cpu(tmp_path):
    """ppyolo_r18vd_coco layout (2 levels, light neck), protocol-2 file with sliced arrays: every tensor lands
    where the string rules say, strict load, num_batches_tracked untouched, forward shapes right."""
    torch.manual_seed(0)
    model = ppyolo_r18vd().to(CPU)
    shapes = pd_ppyolo(18, [2, 3], [], False, 0, True, False, [[3, 4, 5], [0, 1, 2]], 80, False)
    arrays = fill(shapes, seed=5)
    p = paddle_save_state_dict(str(tmp_path / "ppyolo_r18vd_coco.pdparams"), arrays, 2, max_elements=2 ** 20)
    st = read_paddle_state(p)
    assert "sliced" in st.layouts
    nbt_before = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("num_batches_tracked")}
    sd, report = convert_paddle_state(st.params, model)
    assert report.ok and report.naming == ["dygraph"], report.format()
    n_model = len([k for k in model.state_dict() if not k.endswith("num_batches_tracked")])
    assert len(report.matched) == len(arrays) == n_model
    assert not (report.unmatched or report.missing or report.mismatched or report.ignored or report.kept_init)
    model.load_state_dict(sd, strict=True)
    _assert_loaded(model, arrays, report)
    for k, v in nbt_before.items():
        assert torch.equal(model.state_dict()[k], v)
    model.eval()
    with torch.no_grad():
        outs = model(torch.rand(1, 3, 64, 64, device=CPU) * 255)
    assert [tuple(o.shape) for o in outs] == [(1, 255, 2, 2), (1, 255, 4, 4)]
    assert all(torch.isfinite(o).all() for o in outs)
    assert f"{len(arrays)} tensors mapped (naming: dygraph)" in report.format()
    assert report.format().endswith("OK.")


@pytest.mark.parametrize("old_dcn_names", [False, True])
def test_convert_tiny_r50vd_tricks_device_cpu(tmp_path, old_dcn_names):
    """3 levels, BasicBlock DCNv2 (current and early-2021 DCN names), CoordConv, SPP, IoU-aware, 2 conv pairs."""
    kw = _tiny_kw()
    torch.manual_seed(1)
    model = PPYOLO(**kw).to(CPU)
    arrays = fill(_pd_for(kw), seed=6)
    if old_dcn_names:       # layers.py DeformableConvV2 inside ConvNormLayer: conv.conv_offset / conv.conv_dcn
        renamed = OrderedDict()
        for k, v in arrays.items():
            if k.startswith("backbone.res5") and ".branch2b.conv_offset." in k:
                k = k.replace(".branch2b.conv_offset.", ".branch2b.conv.conv_offset.")
            elif k.startswith("backbone.res5") and k.endswith(".branch2b.conv.weight"):
                k = k.replace(".branch2b.conv.weight", ".branch2b.conv.conv_dcn.weight")
            renamed[k] = v
        arrays = renamed
    p = paddle_save_state_dict(str(tmp_path / "tiny.pdparams"), arrays, 4)
    sd, report = convert_paddle_state(read_paddle_params(p), model)
    assert report.ok, report.format()
    assert report.naming == (["dygraph", "dygraph-dcn-2021q1"] if old_dcn_names else ["dygraph"])
    model.load_state_dict(sd, strict=True)
    _assert_loaded(model, arrays, report)
    assert any("conv_offset" in n for n, _ in report.matched)
    model.eval()
    with torch.no_grad():
        outs = model(torch.rand(1, 3, 64, 64, device=CPU) * 255)
    assert [o.shape[1] for o in outs] == [3 * (6 + 3)] * 3


def test_convert_bottleneck_depth50_device_cpu(tmp_path):
    """ResNet50-vd naming: branch2c, unpooled res2a shortcut, pooled res3a 'short.conv', DCN in a bottleneck."""
    kw = _tiny_kw(depth=50, return_idx=[0, 1], dcn_v2_stages=[1], anchor_masks=[[3, 4, 5], [0, 1, 2]],
                  neck_channels=[8, 4], route_channels=[4])
    torch.manual_seed(2)
    model = PPYOLO(**kw).to(CPU)
    arrays = fill(_pd_for(kw), seed=7)
    assert "backbone.res2.res2a.short.conv.weight" in arrays and "backbone.res3.res3a.short.conv.conv.weight" in arrays
    sd, report = convert_paddle_state(arrays, model)
    assert report.ok, report.format()
    model.load_state_dict(sd, strict=True)
    _assert_loaded(model, arrays, report)


def test_r50vd_preset_names_and_shapes_device_cpu():
    """The full paper model: every one of PaddleDetection's ppyolo_r50vd_dcn tensors has a place of its shape."""
    model = ppyolo_r50vd().to(CPU)
    shapes = pd_ppyolo(50, [1, 2, 3], [3], True, 2, True, True, [[6, 7, 8], [3, 4, 5], [0, 1, 2]], 80, True)
    params = {k: np.zeros(v, np.float32) for k, v in shapes.items()}
    names = paddle_names(model)
    assert {v[0] for v in names.values()} == set(shapes)
    assert {k: expected_key(v[0]) for k, v in names.items()} == {k: k for k in names}
    sd, report = convert_paddle_state(params, model)
    assert report.ok and len(report.matched) == len(shapes) == 392, report.format()
    assert sd["head.outputs.0.weight"].shape == (3 * 86, 1024, 1, 1)
    assert float(sd["head.outputs.0.bias"].abs().sum()) == 0          # the file's zeros replaced the obj prior


def _ix(t, rows):
    """Rows ``rows`` (a list) of ``t``'s first dimension."""
    return t[torch.as_tensor(rows, dtype=torch.long)]


def _rows(na, c, iou):
    """(iou rows, per-anchor box+obj rows, per-anchor class rows) of a YOLOv3Head level."""
    off = na if iou else 0
    return (list(range(off)), [[off + a * (5 + c) + j for j in range(5)] for a in range(na)],
            [[off + a * (5 + c) + 5 + j for j in range(c)] for a in range(na)])


@pytest.mark.parametrize("n_new,class_rows", [(3, "keep"), (7, "keep"), (7, "init")])
def test_num_classes_surgery_device_cpu(n_new, class_rows):
    """-nc: IoU / box / objectness rows copied; the first min(C, N) class rows kept ('keep') or none
    ('init'), the other class rows equal the model head's own initialisation; output channels na*(6+N)."""
    c_pd = 5
    kw_pd = _tiny_kw(num_classes=c_pd)
    arrays = fill(_pd_for(kw_pd), seed=8)
    torch.manual_seed(3)
    model = PPYOLO(**_tiny_kw(num_classes=n_new)).to(CPU)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    sd, report = convert_paddle_state(arrays, model, num_classes=n_new, class_rows=class_rows)
    assert report.ok, report.format()
    k = min(c_pd, n_new) if class_rows == "keep" else 0
    assert report.class_surgery == {"paddle_classes": c_pd, "num_classes": n_new, "class_rows": class_rows,
                                    "copied_class_rows": k}
    model.load_state_dict(sd, strict=True)
    for lvl in range(3):
        for p in ("weight", "bias"):
            src = torch.from_numpy(arrays[f"yolo_head.yolo_output.{lvl}.{p}"])
            got, ini = model.state_dict()[f"head.outputs.{lvl}.{p}"], init[f"head.outputs.{lvl}.{p}"]
            assert got.shape[0] == 3 * (6 + n_new)
            iou_s, box_s, cls_s = _rows(3, c_pd, True)
            iou_d, box_d, cls_d = _rows(3, n_new, True)
            assert torch.equal(_ix(got, iou_d), _ix(src, iou_s))
            for a in range(3):
                assert torch.equal(_ix(got, box_d[a]), _ix(src, box_s[a]))
                assert torch.equal(_ix(got, cls_d[a][:k]), _ix(src, cls_s[a][:k]))
                assert torch.equal(_ix(got, cls_d[a][k:]), _ix(ini, cls_d[a][k:]))
                assert len(cls_d[a][k:]) == n_new - k
    model.eval()
    with torch.no_grad():
        outs = model(torch.rand(1, 3, 64, 64, device=CPU) * 255)
    assert [tuple(o.shape) for o in outs] == [(1, 3 * (6 + n_new), s, s) for s in (2, 4, 8)]
    assert f"head rebuilt from 5 to {n_new} classes" in report.format()


def test_num_classes_mismatch_needs_nc_device_cpu():
    """Without num_classes a different class count is a shape mismatch (report.ok False, hint to pass -nc);
    num_classes that disagrees with the model is a ValueError; rebuild_class_rows refuses bad row counts."""
    arrays = fill(_pd_for(_tiny_kw(num_classes=5)), seed=9)
    model = PPYOLO(**_tiny_kw(num_classes=3)).to(CPU)
    sd, report = convert_paddle_state(arrays, model)
    assert not report.ok and len(report.mismatched) == 6
    assert {k for _, k, _, _ in report.mismatched} == {f"head.outputs.{i}.{p}" for i in range(3)
                                                       for p in ("weight", "bias")}
    assert "pass num_classes (-nc)" in report.format() and "NOT OK" in report.format()
    assert torch.equal(sd["head.outputs.0.weight"], model.state_dict()["head.outputs.0.weight"])
    with pytest.raises(ValueError, match="num_classes=4 but the model has 3"):
        convert_paddle_state(arrays, model, num_classes=4)
    with pytest.raises(ValueError, match="cannot be 3 anchors"):
        rebuild_class_rows(np.zeros((3 * 6 - 1, 8, 1, 1), np.float32), torch.zeros(3 * 9, 8, 1, 1), 3, True)


def test_only_backbone_dygraph_imagenet_file_device_cpu(tmp_path):
    """ResNet18_vd_pretrained.pdparams-style file (backbone names without prefix, a 2-D classifier fc):
    backbone copied, fc ignored, neck / head / DCN offset convs keep the model's initialisation."""
    kw = _tiny_kw()
    torch.manual_seed(4)
    model = PPYOLO(**kw).to(CPU)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    arrays = fill(pd_resnet(18, 4, dcn_v2_stages=()), seed=10)
    arrays["fc.weight"] = np.ones((512, 1000), np.float32)
    arrays["fc.bias"] = np.ones(1000, np.float32)
    p = paddle_save_state_dict(str(tmp_path / "ResNet18_vd_pretrained.pdparams"), arrays, 2)
    sd, report = convert_paddle_state(read_paddle_params(p), model, only_backbone=True)
    assert report.ok and report.naming == ["dygraph-backbone"], report.format()
    assert report.ignored == ["fc.weight", "fc.bias"]
    offsets = {k for k in init if "offset_conv" in k}
    assert len(offsets) == 4 and offsets <= set(report.kept_init)
    assert {k for k in report.kept_init if not k.startswith("backbone.")} == \
        {k for k in init if k.startswith(("neck.", "head.")) and not k.endswith("num_batches_tracked")}
    model.load_state_dict(sd, strict=True)
    _assert_loaded(model, {k: v for k, v in arrays.items() if not k.startswith("fc.")},
                   type(report)(matched=report.matched))
    for k in report.kept_init:
        assert torch.equal(model.state_dict()[k], init[k]), k


@pytest.mark.parametrize("depth", [18, 50])
def test_only_backbone_fluid_era_names_device_cpu(depth):
    """Static-graph names (conv1_1_weights, bnv1_1_scale, res2a_branch2a_weights, bn3a_branch1_mean, fc_0.w_0)."""
    kw = _tiny_kw(depth=depth, dcn_v2_stages=[]) if depth == 18 else \
        _tiny_kw(depth=50, return_idx=[0, 1], dcn_v2_stages=[], anchor_masks=[[3, 4, 5], [0, 1, 2]],
                 neck_channels=[8, 4], route_channels=[4])
    model = PPYOLO(**kw).to(CPU)
    arrays = fill(pd_resnet_fluid(depth, 4), seed=11)
    sd, report = convert_paddle_state(arrays, model, only_backbone=True)
    assert report.ok and report.naming == ["fluid"], report.format()
    unbuilt = "".join(str(n) for n in range(len(model.backbone.stages) + 2, 6))     # stage numbers, res2..res5
    leftover = {k for k in arrays if k.startswith("fc_0") or (unbuilt and re.match(rf"(res|bn)[{unbuilt}][a-z]", k))}
    # depth 50 builds res2, res3 only: res4 (6 blocks) and res5 (3) are 6*3+1 + 3*3+1 convs of 5 tensors each
    assert len(leftover) == (2 if depth == 18 else 2 + 5 * (19 + 10))
    assert set(report.ignored) == leftover and ("fc_0.w_0" in leftover)
    model.load_state_dict(sd, strict=True)
    taken = {k: v for k, v in arrays.items() if k not in leftover}
    assert len(report.matched) == len(taken) == len([k for k in model.state_dict() if k.startswith("backbone.")
                                                     and not k.endswith("num_batches_tracked")])
    _assert_loaded(model, taken, type(report)(matched=report.matched))


def test_backbone_file_without_only_backbone_is_not_ok_device_cpu():
    """An ImageNet backbone file converted as a whole detector: neck / head reported unset, with the hint."""
    model = PPYOLO(**_tiny_kw(dcn_v2_stages=[])).to(CPU)
    sd, report = convert_paddle_state(fill(pd_resnet(18), seed=14), model)
    assert not report.ok and not report.unmatched and not report.mismatched
    assert set(report.missing) == {k for k in model.state_dict() if k.startswith(("neck.", "head."))
                                   and not k.endswith("num_batches_tracked")}
    assert "--only-backbone" in report.format()


def test_only_backbone_from_detector_file_device_cpu():
    """A whole detector file with only_backbone: neck and head tensors ignored, backbone (DCN included) taken."""
    kw = _tiny_kw()
    arrays = fill(_pd_for(kw), seed=12)
    model = PPYOLO(**kw).to(CPU)
    sd, report = convert_paddle_state(arrays, model, only_backbone=True)
    assert report.ok, report.format()
    assert set(report.ignored) == {k for k in arrays if not k.startswith("backbone.")}
    assert {n for n, _ in report.matched} == {k for k in arrays if k.startswith("backbone.")}
    assert not any(k.startswith("backbone.") for k in report.kept_init)


def test_unmatched_missing_and_misshaped_are_reported_device_cpu():
    """An extra key, a wrong shape and a missing key: each listed, report.ok False, the paragraph says so."""
    kw = _tiny_kw()
    arrays = fill(_pd_for(kw), seed=13)
    arrays["backbone.res9.res9a.branch2a.conv.weight"] = np.zeros((4, 4, 1, 1), np.float32)
    arrays["neck.yolo_transition.0.batch_norm._variance"] = np.ones(9, np.float32)        # model has 8
    del arrays["backbone.res3.res3b.branch2a.norm._mean"]
    arrays["backbone.res2.res2a.branch2a.norm.weight"] = np.arange(64, dtype=np.int64)    # integer array
    model = PPYOLO(**kw).to(CPU)
    sd, report = convert_paddle_state(arrays, model)
    assert not report.ok
    assert report.unmatched == ["backbone.res9.res9a.branch2a.conv.weight"]
    assert report.missing == ["backbone.stages.1.1.branch2a.bn.running_mean"]
    assert ("neck.yolo_transition.0.batch_norm._variance", "neck.transitions.0.bn.running_var", (9,), (8,)) \
        in report.mismatched
    assert ("backbone.res2.res2a.branch2a.norm.weight", "backbone.stages.0.0.branch2a.bn.weight", (64,), (64,)) \
        in report.mismatched and len(report.mismatched) == 2
    text = report.format()
    assert "1 Paddle keys unmatched" in text and "1 model keys left unset" in text
    assert "2 shape/dtype mismatches" in text and "(not a float array)" in text and "NOT OK" in text
    model.load_state_dict(sd, strict=True)        # what did match still loads


def test_refuses_models_it_cannot_map_device_cpu():
    """A Linear layer (Paddle stores it transposed) and a neck whose layout differs from PPYOLOFPN's."""
    model = PPYOLO(**_tiny_kw()).to(CPU)
    model.extra = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="transposed"):
        paddle_names(model)
    model = PPYOLO(**_tiny_kw()).to(CPU)
    model._meta = dict(model._meta, spp=False)   # the neck has SPP, PaddleDetection's cfg would not
    with pytest.raises(ValueError, match="differ from PaddleDetection PPYOLOFPN"):
        convert_paddle_state({}, model)
    with pytest.raises(TypeError, match="expected a gnetmdk PPYOLO"):
        convert_paddle_state({}, nn.Conv2d(3, 3, 1))
