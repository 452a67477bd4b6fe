"""Read PaddlePaddle weight files (``.pdparams``, ``.pdema``) without PaddlePaddle, as plain numpy arrays.

A Paddle weight file is a Python pickle. Which pickle depends on the API and version that wrote it
(PaddlePaddle ``python/paddle/framework/io.py`` and ``io_utils.py``); every layout below is read:

* **dygraph state dict** -- ``paddle.save(layer.state_dict(), path)`` (``io.py`` ``_legacy_save`` after
  ``_build_saved_state_dict``), also Paddle 1.x / 2.0 ``fluid.dygraph.save_dygraph``: a ``dict``
  ``{structured name: numpy array}`` plus the key ``"StructuredToParameterName@@"`` holding a
  ``{structured name: parameter name}`` table of strings. This is what PaddleDetection 2.x writes for
  ``model_final.pdparams`` and the ``.pdema`` beside it (``ppdet/utils/checkpoint.py`` ``save_model``).
  Protocol 2 (Paddle <= 2.1's default), 3 or 4.
* **static-graph state dict** -- ``paddle.static.save`` / ``fluid.save`` (``io_utils.py``
  ``_legacy_static_save``): ``{parameter name: numpy array}``, no name table (the fluid-era names such
  as ``res2a_branch2a_weights``), protocol 2; Python-2-era files (byte strings, decoded as latin-1
  exactly as ``paddle.load`` does) included.
* **sliced large arrays** -- with protocol 2 or 3 (no pickle object over 4 GiB), ``_unpack_saved_dict``
  replaces every array of more than ``(2**30 - 1) // itemsize`` elements by its flattened pieces
  ``"<key>@@.0"``, ``"<key>@@.1"``, ... of at most that many elements each, and adds the key
  ``"UnpackBigParamInfor@@"`` = ``{key: {"OriginShape": shape, "slices": [piece names]}}``. They are
  concatenated and reshaped back here (``_pack_loaded_dict``'s rule).
* **tensor tuples** -- Paddle >= 2.1 ``_pickle_save`` (used by ``paddle.save`` when the dict is not a
  pure state dict, e.g. one that also holds a number) reduces every Tensor to ``tuple((name, array))``;
  such ``(str, array)`` pairs are read as the array.

Values that are Python or numpy numbers are returned as 0-d arrays.

Not read: ``.pdopt`` optimizer states and other nested dicts, Paddle 1.x ``save_params`` /
``save_persistables`` *directories* of per-variable LoDTensor files (the ImageNet ``*_pretrained.tar``
archives of the fluid era), ``.pdiparams`` inference files, and the static-graph LoDTensor form of
``_pickle_save`` (``(eval, ('data', {'data': array}))``), which would need ``builtins.eval``.

Safety: the pickle is read by :class:`_RestrictedUnpickler`, whose ``find_class`` admits only what numpy
arrays and these dicts need (numpy's array / scalar reconstruction functions, ``numpy.ndarray``,
``numpy.dtype``, ``collections.OrderedDict``, ``_codecs.encode`` restricted to latin-1 text -> bytes,
which protocol 2 uses for every ``bytes`` object, and ``builtins.tuple`` restricted to one sequence
argument, for the tensor tuples). Any other global is refused with :class:`PaddleFormatError` before
it is imported or called, and persistent ids are refused, so nothing from the file is ever executed.
"""
from __future__ import annotations

import collections
import numbers
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np

try:  # numpy >= 2 keeps the implementation in numpy._core; numpy.core is a deprecated alias there
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
    from numpy._core.multiarray import scalar as _np_scalar
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct as _np_reconstruct
    from numpy.core.multiarray import scalar as _np_scalar

__all__ = ["PaddleFormatError", "PaddleState", "read_paddle_params", "read_paddle_state", "NAME_TABLE_KEY",
           "BIG_PARAM_KEY"]

#: key of the structured-name -> parameter-name table (PaddlePaddle ``io.py`` ``_build_saved_state_dict``)
NAME_TABLE_KEY = "StructuredToParameterName@@"
#: key of the sliced-array table (PaddlePaddle ``io_utils.py`` ``_unpack_saved_dict``)
BIG_PARAM_KEY = "UnpackBigParamInfor@@"

_NUMERIC_KINDS = "biuf"   # bool, signed, unsigned, float


class PaddleFormatError(ValueError):
    """A file that is not a readable Paddle weight file; the message names the file and the fix."""


def _latin1_bytes(text, encoding="latin1"):
    """``_codecs.encode`` as protocol-2 pickles use it (``bytes`` -> ``_codecs.encode(str, 'latin1')``);
    anything else is refused."""
    if not isinstance(text, str) or str(encoding).lower().replace("_", "-") not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode is admitted only as (str, 'latin1'), got "
                                     f"({type(text).__name__}, {encoding!r})")
    return text.encode("latin1")


def _plain_tuple(seq=()):
    """``builtins.tuple`` as Paddle >= 2.1 ``_pickle_save`` uses it (``(tuple, ((name, data),))``)."""
    if not isinstance(seq, (tuple, list)):
        raise pickle.UnpicklingError(f"builtins.tuple is admitted only on a tuple or list, got {type(seq).__name__}")
    return tuple(seq)


# (module, name) as written in the pickle -> the object handed to the unpickler. Both numpy module
# spellings appear in real files (numpy 1.x writes numpy.core, numpy 2.x numpy._core); Python 2 and
# protocol-2 pickles name builtins "__builtin__".
_ALLOWED: Dict[tuple, Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _np_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _np_reconstruct,
    ("numpy.core.multiarray", "scalar"): _np_scalar,
    ("numpy._core.multiarray", "scalar"): _np_scalar,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_codecs", "encode"): _latin1_bytes,
    ("builtins", "tuple"): _plain_tuple,
    ("__builtin__", "tuple"): _plain_tuple,
}


class _RefusedGlobal(Exception):
    def __init__(self, module: str, name: str, reason: str = "global"):
        super().__init__(f"{module}.{name}")
        self.module, self.name, self.reason = module, name, reason


class _RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals of :data:`_ALLOWED` (module docstring)."""

    def find_class(self, module, name):
        obj = _ALLOWED.get((str(module), str(name)))
        if obj is None:
            raise _RefusedGlobal(str(module), str(name))
        return obj

    def persistent_load(self, pid):
        raise _RefusedGlobal("<persistent id>", repr(pid)[:60], reason="persistent id")


@dataclass
class PaddleState:
    """What :func:`read_paddle_state` found in a file.

    Attributes:
        params: ``{name: numpy array}`` (numeric dtypes only; numbers as 0-d arrays), file order.
        name_table: the ``"StructuredToParameterName@@"`` table ``{structured name: parameter name}``
            (empty for static-graph files).
        layouts: which layouts were met, a subset of ``{"state_dict", "name_table", "sliced",
            "tensor_tuples", "ordered_dict"}``.
        protocol: the pickle protocol of the file (0 for protocol 0/1 text pickles).
    """
    params: Dict[str, np.ndarray]
    name_table: Dict[str, str] = field(default_factory=dict)
    layouts: set = field(default_factory=set)
    protocol: int = 0


def _fail(path: str, what: str, fix: str) -> PaddleFormatError:
    return PaddleFormatError(f"{path}: {what}. {fix}")


_FIX_GET_FILE = ("Pass the .pdparams / .pdema file that paddle.save wrote (PaddleDetection: "
                 "output/<config>/model_final.pdparams or the model-zoo download); if it was downloaded, "
                 "download it again and compare its size")


def _sniff(path: str, head: bytes) -> Optional[str]:
    """A hint for files that are clearly something else than a pickle."""
    if head.startswith(b"PK\x03\x04"):
        return "it is a zip archive (a PyTorch checkpoint or a zipped folder), not a Paddle pickle"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return ("it is a tar archive (the fluid-era *_pretrained.tar of per-variable LoDTensor files, which "
                "is not read here; use PaddleDetection's *_pretrained.pdparams instead)")
    if head.startswith(b"\x1f\x8b"):
        return "it is gzip-compressed; decompress it first"
    return None


def _as_array(path: str, key: str, value) -> np.ndarray:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) \
            and isinstance(value[1], np.ndarray):
        value = value[1]                      # Paddle >= 2.1 _pickle_save: (tensor name, data)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _NUMERIC_KINDS or value.dtype.fields is not None:
            raise _fail(path, f"entry {key!r} is an array of dtype {value.dtype}, not of numbers",
                        "A Paddle weight file holds numeric arrays only; " + _FIX_GET_FILE)
        return value
    if isinstance(value, (numbers.Real, np.bool_)):
        arr = np.asarray(value)
        if arr.dtype.kind in _NUMERIC_KINDS:
            return arr
    raise _fail(path, f"entry {key!r} is a {type(value).__name__}, neither an array nor a number",
                "This is not a state dict of a model (an optimizer .pdopt or a nested checkpoint?); "
                + _FIX_GET_FILE)


def _join_slices(path: str, raw: dict, info) -> Dict[str, np.ndarray]:
    """Rebuild the arrays that ``_unpack_saved_dict`` cut into pieces (PaddlePaddle ``io_utils.py``)."""
    if not isinstance(info, dict):
        raise _fail(path, f"{BIG_PARAM_KEY!r} is a {type(info).__name__}, not a dict",
                    "The file is damaged; " + _FIX_GET_FILE)
    joined: Dict[str, np.ndarray] = {}
    for key, desc in info.items():
        try:
            shape = tuple(int(d) for d in desc["OriginShape"])
            parts = [str(p) for p in desc["slices"]]
        except (TypeError, KeyError, ValueError):
            raise _fail(path, f"the slice description of {key!r} in {BIG_PARAM_KEY!r} is malformed ({desc!r:.80})",
                        "The file is damaged; " + _FIX_GET_FILE) from None
        missing = [p for p in parts if p not in raw]
        if missing or not parts:
            raise _fail(path, f"array {key!r} was saved in {len(parts)} slices but slice(s) {missing[:3]} are "
                              f"missing", "The file is damaged or truncated; " + _FIX_GET_FILE)
        pieces = [_as_array(path, p, raw[p]).reshape(-1) for p in parts]
        flat = np.concatenate(pieces)
        if flat.size != int(np.prod(shape, dtype=np.int64)):
            raise _fail(path, f"array {key!r}: its slices hold {flat.size} values but its shape {shape} needs "
                              f"{int(np.prod(shape, dtype=np.int64))}", "The file is damaged; " + _FIX_GET_FILE)
        joined[str(key)] = flat.reshape(shape)
    return joined


def read_paddle_state(path: str) -> PaddleState:
    """Read a Paddle weight file (every layout of the module docstring) without PaddlePaddle.

    Args:
        path: a ``.pdparams`` / ``.pdema`` (or static-graph ``.pdparams``) file.

    Returns:
        :class:`PaddleState`: ``params`` ``{name: numpy array}`` with the sliced arrays joined back,
        tensor tuples unwrapped and the name table taken out into ``name_table``. Arrays keep their
        dtype (float32 for PaddleDetection weights, BN statistics included) and shape (conv weights
        ``(out, in, kh, kw)`` as in torch; Linear weights ``(in, out)``, the transpose of torch's).

    Raises:
        PaddleFormatError: the path is missing or a folder; not a pickle / truncated; a global other
            than those listed in the module docstring (refused, never imported or called); not a dict;
            an entry that is neither a numeric array nor a number; a damaged slice table. The message
            names the file and the fix.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise _fail(path, "is a folder (a Paddle 1.x save_params / save_persistables folder of per-variable "
                          "LoDTensor files, which is not read here)",
                    "Use the single-file .pdparams of the same weights (PaddleDetection publishes "
                    "*_pretrained.pdparams and <model>.pdparams files)")
    if not os.path.isfile(path):
        raise _fail(path, "does not exist", "Check the path; " + _FIX_GET_FILE)
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(512)
        hint = _sniff(path, head)
        if hint is not None:
            raise _fail(path, f"not a Paddle weight file: {hint}", _FIX_GET_FILE)
        protocol = head[1] if len(head) >= 2 and head[0] == 0x80 else 0
        fh.seek(0)
        try:
            obj = _RestrictedUnpickler(fh, encoding="latin1").load()
        except _RefusedGlobal as e:
            what = ("asks for a persistent id" if e.reason == "persistent id"
                    else f"asks for the global {e.module}.{e.name}")
            raise _fail(path, f"{what}, which was refused and not executed (a Paddle weight file needs "
                              f"only numpy arrays, dtypes and dicts)",
                        "The file is not a plain paddle.save weight file or has been tampered with; do not "
                        "open it with pickle, torch.load or paddle.load either. " + _FIX_GET_FILE) from None
        except EOFError:
            raise _fail(path, f"ends before the pickle is complete (truncated at {size} bytes)",
                        "Download or copy the file again") from None
        except MemoryError:
            raise _fail(path, "asks for more memory than this machine has while unpickling",
                        "The file is damaged or not a weight file; " + _FIX_GET_FILE) from None
        except Exception as e:  # UnpicklingError, ValueError, struct.error, RecursionError, ...: a bad file
            msg = str(e)
            if "truncated" in msg or "ran out of input" in msg.lower():
                raise _fail(path, f"ends before the pickle is complete (truncated at {size} bytes)",
                            "Download or copy the file again") from None
            raise _fail(path, f"not a Paddle weight file (not a readable Python pickle: {type(e).__name__}: "
                              f"{msg[:160]})", _FIX_GET_FILE) from None

    if not isinstance(obj, dict):
        raise _fail(path, f"holds a {type(obj).__name__}, not a dict of parameter name -> array",
                    "Pass a model's state dict file (.pdparams / .pdema), not a single tensor, program or "
                    "list; " + _FIX_GET_FILE)
    layouts = set()
    if isinstance(obj, collections.OrderedDict):
        layouts.add("ordered_dict")
    bad_keys = [k for k in obj if not isinstance(k, str)]
    if bad_keys:
        raise _fail(path, f"has non-string keys such as {bad_keys[0]!r}",
                    "A Paddle state dict is keyed by parameter names; " + _FIX_GET_FILE)
    raw = dict(obj)
    name_table: Dict[str, str] = {}
    if NAME_TABLE_KEY in raw:
        table = raw.pop(NAME_TABLE_KEY)
        if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in table.items()):
            raise _fail(path, f"its {NAME_TABLE_KEY!r} entry is not a dict of names",
                        "The file is damaged; " + _FIX_GET_FILE)
        name_table = dict(table)
        layouts.add("name_table")
    joined: Dict[str, np.ndarray] = {}
    sliced_parts = set()
    if BIG_PARAM_KEY in raw:
        info = raw.pop(BIG_PARAM_KEY)
        joined = _join_slices(path, raw, info)
        for desc in info.values():
            sliced_parts.update(str(p) for p in desc["slices"])
        layouts.add("sliced")
    params: Dict[str, np.ndarray] = {}
    for key, value in raw.items():
        if key in sliced_parts:
            continue
        if isinstance(value, tuple):
            layouts.add("tensor_tuples")
        params[key] = _as_array(path, key, value)
    params.update(joined)
    if not params:
        raise _fail(path, "holds no arrays", _FIX_GET_FILE)
    layouts.add("state_dict")
    return PaddleState(params=params, name_table=name_table, layouts=layouts, protocol=int(protocol))


def read_paddle_params(path: str) -> Dict[str, np.ndarray]:
    """``{parameter name: numpy array}`` of a Paddle ``.pdparams`` / ``.pdema`` file, read without Paddle.

    Same as ``read_paddle_state(path).params`` (:func:`read_paddle_state`: layouts, dtypes, errors).
    In PaddleDetection runs with ``use_ema: true`` the ``.pdparams`` holds the EMA weights (the ones
    evaluated and published) and the ``.pdema`` the raw training weights (``ppdet/utils/checkpoint.py``
    ``save_model`` saves them exchanged); both read the same way.

    Raises:
        PaddleFormatError: see :func:`read_paddle_state`.
    """
    return read_paddle_state(path).params
