"""Layouts written as text: ``gt.layout("S(0), B")`` for tests and static tools, and a
short notation of a tensor's layout, ``f32[8@0, 4]``.

A spec names one sbp per placement axis: ``S(0)`` / ``S0`` / ``split(0)``,
``S(0, blocks=2)`` (a strided split), ``B`` / ``broadcast``, ``P`` / ``P(sum)`` /
``partial_sum``, ``P(max)`` / ``partial_max``. It compares equal to a ``Layout``
(``x.global_layout``), a GlobalTensor's ``x.sbp`` tuple, or another spec with that
nd-sbp, whatever the shape and placement. (``x.layout`` stays torch's: the memory
layout, ``torch.strided``, which torch reads on every tensor.)

The notation writes the dtype, then each dim's size with ``@a`` for every placement
axis ``a`` that splits it (``/k`` after a strided split of ``k`` blocks), then the
partial axes: ``f32[8@0, 4@1]`` is (split(0), split(1)) on a 2-D placement,
``f32[8, 4]{sum@0}`` partial_sum on a 1-D one; broadcast axes are not written.

>>> import globaltensor as gt
>>> gt.layout("S(0), B") == (gt.sbp.split(0), gt.sbp.broadcast)
True
>>> gt.layout("S0, B")
layout("S(0), B")
"""
from __future__ import annotations

import re

from .layout import Layout
from .sbp import Broadcast, Partial, SbpParallel, Split, StridedSplit, broadcast, split

_SPLIT = re.compile(r"^(?:S|split)\s*\(?\s*(?:dim\s*=\s*)?(-?\d+)\s*(?:,\s*(?:blocks\s*=\s*)?(\d+)\s*)?\)?$")
_NAMES = {"b": broadcast, "broadcast": broadcast, "p": Partial("sum"), "p(sum)": Partial("sum"),
          "partial_sum": Partial("sum"), "p(max)": Partial("max"), "partial_max": Partial("max")}


def sbp_from_text(token: str) -> SbpParallel:
    """One sbp written as text (``sbp_text``'s, or any spelling ``gt.layout`` reads)."""
    token = token.strip()
    found = _NAMES.get(token.lower().replace(" ", ""))
    if found is not None:
        return found
    m = _SPLIT.match(token)
    if m is None:
        raise ValueError(f"gt.layout: cannot read {token!r} as an sbp; write S(d), S(d, blocks=k), "
                         f"B, P, P(sum) or P(max) (one per placement axis, comma-separated)")
    return split(int(m.group(1)), int(m.group(2) or 1))


def _split_axes(text: str) -> list:
    """The comma-separated entries of ``text``, commas inside parentheses kept."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return parts + [current]


def sbp_text(s: SbpParallel) -> str:
    """One sbp as ``gt.layout`` writes it: ``S(0)``, ``S(0, blocks=2)``, ``B``, ``P``,
    ``P(max)``."""
    if isinstance(s, StridedSplit):
        return f"S({s.dim}, blocks={s.blocks})"
    if isinstance(s, Split):
        return f"S({s.dim})"
    if isinstance(s, Broadcast):
        return "B"
    return "P" if s.reduce == "sum" else "P(max)"


class LayoutSpec:
    """An nd-sbp written as text (``gt.layout``); equal to a Layout, an sbp tuple or a
    spec with that nd-sbp."""

    __slots__ = ("sbp",)

    def __init__(self, sbp: tuple):
        self.sbp = tuple(sbp)

    def __eq__(self, other) -> bool:
        if isinstance(other, LayoutSpec):
            return self.sbp == other.sbp
        if isinstance(other, Layout):
            return self.sbp == other.sbp
        if isinstance(other, tuple):
            return self.sbp == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.sbp)

    def __repr__(self) -> str:
        return f'layout("{", ".join(sbp_text(s) for s in self.sbp)}")'


def layout(spec: str) -> LayoutSpec:
    """The nd-sbp written in ``spec`` (module docstring), to compare with a tensor's.

    >>> assert x.global_layout == gt.layout("S(0), B")      # doctest: +SKIP
    >>> assert x.sbp == gt.layout("S(0), B")                # doctest: +SKIP
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"gt.layout takes a text like \"S(0), B\", not {spec!r}")
    return LayoutSpec(tuple(sbp_from_text(t) for t in _split_axes(spec)))


_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
           "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "b1",
           "complex64": "c64", "complex128": "c128"}


def notation(layout_: Layout, dtype=None) -> str:
    """``layout_`` in the short notation (module docstring), with ``dtype`` if given.

    >>> notation(Layout.make((8, 4), gt.placement("cpu", [0, 1]), gt.sbp.split(0)))  # doctest: +SKIP
    '[8@0, 4]'
    """
    dims = [str(n) for n in layout_.shape]
    for axis, s in enumerate(layout_.sbp):
        if isinstance(s, (Split, StridedSplit)):
            dims[s.dim] += f"@{axis}" + (f"/{s.blocks}" if isinstance(s, StridedSplit) else "")
    partial = ", ".join(f"{s.reduce}@{a}" for a, s in enumerate(layout_.sbp) if isinstance(s, Partial))
    name = "" if dtype is None else _DTYPES.get(str(dtype).removeprefix("torch."), str(dtype))
    return f"{name}[{', '.join(dims)}]" + (f"{{{partial}}}" if partial else "")
