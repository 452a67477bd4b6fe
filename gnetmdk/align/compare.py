"""Weight comparison of two checkpoints (docs/alignment.md, "The tools").

Per tensor: max |a - b|, max relative difference |a - b| / max(|a|, |b|) (0 where both are 0) and the
sum of squared differences. A tensor passes when every element satisfies
``|a - b| <= atol + rtol * |b|`` (torch.testing.assert_close's rule); tensors present in only one
file, or with different shapes, fail. Bookkeeping buffers (``num_batches_tracked``) are skipped.

A BatchNorm ``running_mean`` is the one exception to "relative to |b|": it estimates the mean of
activations whose spread is sqrt(running_var), and float32 rounding of those activations errs in
proportion to that spread, not to the mean (a channel with mean 0.1 and std 7 carries errors of
1e-5 from summation order alone). Its relative term is ``rtol * max(|b|, sqrt(running_var_b))``.

The PP-YOLO alignment notes (docs/alignment.md) judge a tensor by its sum of squared differences
instead: aligned when ``sum((a - b)^2) <= d_value`` (their threshold: ``d_value = 5e-4``). With
``d_value`` given that rule is applied per tensor; with ``atol`` given too, a tensor must pass both.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

SKIP_SUFFIXES = ("num_batches_tracked",)


class CompareError(ValueError):
    """A file that cannot be compared (missing, unreadable, no tensors); the message names it."""


@dataclass
class TensorDiff:
    """One tensor's comparison: ``name``, ``shape``, max |a - b|, max relative difference, sum of squared
    differences, ``ok`` (within the tolerances of the report) and ``note`` (e.g. a shape mismatch)."""
    name: str
    shape: Tuple[int, ...]
    max_abs: float
    max_rel: float
    sum_sq: float
    ok: bool
    note: str = ""


@dataclass
class DiffReport:
    """The result of diff_state_dicts: one :class:`TensorDiff` per tensor in both (``rows``), the names
    found in only one of them (``only_a`` / ``only_b``), the skipped bookkeeping buffers, and the rules
    applied (``atol`` / ``rtol``, None: not applied; ``d_value``: the sum-of-squares threshold, None: not applied)."""
    rows: List[TensorDiff] = field(default_factory=list)
    only_a: List[str] = field(default_factory=list)
    only_b: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    atol: Optional[float] = 0.0
    rtol: float = 0.0
    d_value: Optional[float] = None

    @property
    def ok(self) -> bool:
        """Aligned: no tensor in only one file and every compared tensor within tolerance."""
        return not self.only_a and not self.only_b and all(r.ok for r in self.rows)

    @property
    def failed(self) -> List[TensorDiff]:
        """The rows outside tolerance."""
        return [r for r in self.rows if not r.ok]

    def format(self, show_all: bool = False, a_name: str = "A", b_name: str = "B") -> str:
        """The report as text: a table of the failing rows (all rows with ``show_all``), the names in only
        one file (``a_name`` / ``b_name`` label the two sides), a summary line with the rules and the largest
        differences, and a last line ``ALIGNED: ...`` or ``NOT ALIGNED``."""
        lines = [f"{'tensor':<40} {'shape':<18} {'max|a-b|':>11} {'max rel':>11} {'sum sq':>11}  verdict"]
        for r in self.rows:
            if show_all or not r.ok:
                lines.append(f"{r.name:<40} {str(list(r.shape)):<18} {r.max_abs:11.3e} {r.max_rel:11.3e} "
                             f"{r.sum_sq:11.3e}  {'ok' if r.ok else 'DIFFERS'}{(' ' + r.note) if r.note else ''}")
        for n in self.only_a:
            lines.append(f"{n:<40} only in {a_name}")
        for n in self.only_b:
            lines.append(f"{n:<40} only in {b_name}")
        worst = max(self.rows, key=lambda r: r.max_abs, default=None)
        worst_sq = max(self.rows, key=lambda r: r.sum_sq, default=None)
        rules = ([f"|a-b| <= {self.atol:g} + {self.rtol:g}*|b|"] if self.atol is not None else []) + \
            ([f"sum (a-b)^2 <= {self.d_value:g}"] if self.d_value is not None else [])
        lines.append(f"{len(self.rows)} tensors compared ({len(self.skipped)} bookkeeping skipped), "
                     f"{len(self.failed)} outside {' and '.join(rules)}, "
                     f"{len(self.only_a)} only in {a_name}, {len(self.only_b)} only in {b_name}; largest max|a-b| "
                     f"{worst.max_abs:.3e} ({worst.name}), largest sum sq {worst_sq.sum_sq:.3e} ({worst_sq.name})"
                     if worst else "no tensors in common")
        lines.append("ALIGNED: all within tolerance" if self.ok else "NOT ALIGNED")
        return "\n".join(lines)


def load_state(path: str, full: bool = False) -> Dict[str, torch.Tensor]:
    """The tensors of a .pth: a gnetmdk checkpoint's ``model``, a dict with ``state_dict`` / ``model``,
    or a plain state_dict (loaded with weights_only=True).

    ``full``: also a gnetmdk checkpoint's training state, named ``ema.<tensor>`` (the EMA of the weights),
    ``optimizer.<index>.<slot>`` (per parameter: Adam's moments and step, SGD's momentum buffer) and
    ``caps`` (the activation caps as saved), so that two runs can be proven equal in everything they
    carry on with.

    Raises:
        CompareError: missing or unreadable file, or no tensors in it.
    """
    if os.path.isdir(path):
        raise CompareError(f"'{path}' is a folder: pass a checkpoint file in it (e.g. {os.path.join(path, 'last.pth')})")
    if not os.path.isfile(path):
        raise CompareError(f"'{path}' does not exist")
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        from gnetmdk.checkpoint.io import _read_failure
        raise CompareError(f"'{path}' cannot be read as a weights file: {_read_failure(exc, path)}") from None
    obj = raw
    if isinstance(obj, dict):
        for key in ("model", "state_dict", "model_state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict):
        raise CompareError(f"'{path}' holds no state_dict")
    out = {k[len("module."):] if k.startswith("module.") else k: v
           for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not out:
        raise CompareError(f"'{path}' holds no tensors")
    if full and isinstance(raw, dict):
        ema = raw.get("ema")
        if isinstance(ema, dict) and isinstance(ema.get("model"), dict):
            out.update({f"ema.{k}": v for k, v in ema["model"].items() if isinstance(v, torch.Tensor)})
        opt = raw.get("optimizer")
        if isinstance(opt, dict) and isinstance(opt.get("state"), dict):
            for idx, slots in opt["state"].items():
                for slot, v in (slots.items() if isinstance(slots, dict) else ()):
                    t = v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64)
                    out[f"optimizer.{idx}.{slot}"] = t
        if isinstance(raw.get("caps"), list) and raw["caps"]:
            out["caps"] = torch.tensor(raw["caps"], dtype=torch.float64)
    return out


def diff_state_dicts(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], atol: Optional[float] = 1e-6,
                     rtol: float = 0.0, d_value: Optional[float] = None) -> DiffReport:
    """Compare two state dicts tensor by tensor (see the module docstring); b is the reference for rtol.

    Args:
        a, b: name -> tensor (any dtype, compared in float64).
        atol, rtol: the element rule ``|a - b| <= atol + rtol * |b|``; ``atol=None`` leaves it out
            (then ``d_value`` must be given).
        d_value: the notes' rule, ``sum((a - b)^2) <= d_value`` per tensor, or None.
    Returns:
        DiffReport (``ok`` when every tensor passes every rule given and no name is in one file only).
    Raises:
        ValueError: neither rule given, or a negative tolerance.
    """
    if atol is None and d_value is None:
        raise ValueError("give atol, d_value or both")
    if (atol is not None and atol < 0) or rtol < 0 or (d_value is not None and d_value < 0):
        raise ValueError("tolerances must be >= 0")
    rep = DiffReport(atol=atol, rtol=rtol, d_value=d_value)
    for name in sorted(set(a) | set(b)):
        if name.endswith(SKIP_SUFFIXES):
            rep.skipped.append(name)
            continue
        if name not in b:
            rep.only_a.append(name)
            continue
        if name not in a:
            rep.only_b.append(name)
            continue
        ta, tb = a[name], b[name]
        if ta.shape != tb.shape:
            rep.rows.append(TensorDiff(name, tuple(ta.shape), float("inf"), float("inf"), float("inf"), False,
                                       f"shape {list(ta.shape)} vs {list(tb.shape)}"))
            continue
        x, y = ta.double(), tb.double()
        d = (x - y).abs()
        if d.numel() == 0:
            rep.rows.append(TensorDiff(name, tuple(ta.shape), 0.0, 0.0, 0.0, True))
            continue
        finite = torch.isfinite(x) & torch.isfinite(y)
        same_nonfinite = (~finite) & ((x == y) | (torch.isnan(x) & torch.isnan(y)))
        d = torch.where(same_nonfinite, torch.zeros_like(d), d)
        denom = torch.maximum(x.abs(), y.abs())
        rel = torch.where(denom > 0, d / denom, torch.zeros_like(d))
        scale = y.abs()
        var_name = name[: -len("running_mean")] + "running_var" if name.endswith("running_mean") else None
        if var_name is not None and var_name in b and b[var_name].shape == tb.shape:
            scale = torch.maximum(scale, b[var_name].double().clamp(min=0).sqrt())
        sum_sq = float((d * d).sum())
        ok = atol is None or bool(torch.all(d <= atol + rtol * scale))
        ok = ok and (d_value is None or sum_sq <= d_value)
        rep.rows.append(TensorDiff(name, tuple(ta.shape), float(d.max()), float(rel.max()), sum_sq, ok))
    return rep


def diff_files(path_a: str, path_b: str, atol: Optional[float] = 1e-6, rtol: float = 0.0,
               d_value: Optional[float] = None, full: bool = False) -> DiffReport:
    """diff_state_dicts of two .pth files (see load_state for what they may hold; ``full``: the EMA,
    the optimizer's state and the caps as well)."""
    return diff_state_dicts(load_state(path_a, full), load_state(path_b, full), atol, rtol, d_value)
