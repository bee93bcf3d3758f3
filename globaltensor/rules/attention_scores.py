"""Attention written out (``q @ k.transpose(-2, -1)``, a scale, a mask, softmax, ``@ v``)
with the sequence split, run as ``F.scaled_dot_product_attention``: the ring (or the
form the cost model prices lower), never a rank's queries against every key.

A product of a tensor split on its rows by one split on its columns over the same
placement axes (``q`` and ``k.T`` both split on the sequence) would have to gather one
of them: its result, split on its rows only, holds a rank's queries against every key.
Instead it returns ``AttentionScores``: a GlobalTensor of that layout whose values are
not computed. The ops that attention applies to it next (a multiply or divide by a
number, adding a float mask, filling a boolean one's keys with ``-inf`` or
``torch.finfo(dtype).min`` by ``masked_fill`` or ``torch.where``, ``softmax`` on the
last dim, dropout that drops nothing, a cast back to the same dtype; in place too) are
noted, and ``@ v`` runs them all as one ``F.scaled_dot_product_attention(q,
k, v, attn_mask=..., scale=...)``, whose rule offers the ring for a split sequence
(``attention.py``), and whose backward gives q, k and v their gradients. Any other use computes the scores first (as
before: keys gathered), with autograd from q and k, so values and gradients are
always those of the program as written.

>>> att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))   # doctest: +SKIP
>>> att = att.masked_fill(causal == 0, float("-inf")).softmax(-1)
>>> y = att @ v        # ring attention: no (sequence x sequence) scores anywhere
"""
from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.nn.functional as F

from .. import comm, explicit_mode, modes
from ..layout import Layout
from ..sbp import Broadcast, Split
from ..tensor import GlobalTensor, _wrap
from .registry import register

aten = torch.ops.aten
# While scores are computed, products are not deferred. Per thread: the ranks of a
# simulated world are threads that take turns inside such a block.
_computing = threading.local()


@contextlib.contextmanager
def _computed():
    before = getattr(_computing, "on", False)
    _computing.on = True
    try:
        yield
    finally:
        _computing.on = before


def _rows_by_columns(a: GlobalTensor, b: GlobalTensor) -> bool:
    """``a`` [batch, m, k] split on its rows and ``b`` [batch, k, n] on its columns over
    the same placement axes (at least one), every other axis alike (batch split or
    broadcast), nothing partial, m == n."""
    seq = False
    for x, y in zip(a._layout.sbp, b._layout.sbp):
        if x.__class__ is Split and y.__class__ is Split and (x.dim, y.dim) == (1, 2):
            seq = True
        elif not (x == y and (x.__class__ is Broadcast or x.__class__ is Split and x.dim == 0)):
            return False
    return seq and a._layout.shape[1] == b._layout.shape[2]


@register(aten.bmm, decompose=True)
def deferred_scores(a, b):
    """The product of row-split ``a`` and column-split ``b`` (attention's scores of a
    split sequence), deferred: see the module's docstring. Otherwise the op's rule."""
    if type(a) is not GlobalTensor or type(b) is not GlobalTensor \
            or not _rows_by_columns(a, b) or getattr(_computing, "on", False) \
            or (modes.active is not None and modes.active.fakes) or comm.tracing() \
            or explicit_mode.active() or torch.is_inference_mode_enabled() \
            or (torch._C._current_graph_task_id() != -1 and not torch.is_grad_enabled()):
        # (cheapest first: every bmm asks. Not under inference_mode, where torch.matmul
        # arrives at dispatch whole and runs as its pieces there: computed, as before.
        # Not in backward's gradient formulas; but a forward recomputed in backward
        # (activation checkpointing, with grad enabled) defers as its forward did: it
        # must save the same tensors.)
        return NotImplemented
    return AttentionScores.of(a, b, tuple(a.shape[:2]) + (b.shape[2],))


class AttentionScores(GlobalTensor):
    """``q @ kt`` (q [batch, m, d] split on rows, kt [batch, d, n] on columns), viewed as
    ``shape``, with attention's ``steps`` after it, not computed: ``@ v`` runs the whole
    as scaled dot-product attention, anything else computes it."""

    q: GlobalTensor
    kt: GlobalTensor
    # ("scale", s) | ("mask", added) | ("fill", where True, value) | ("softmax", None)
    steps: tuple

    @staticmethod
    def of(q, kt, shape: tuple, steps: tuple = (), dtype=None) -> "AttentionScores":
        rows = q._layout
        layout = Layout.make(shape, rows.placement, tuple(   # (rows: dim -2)
            Split(len(shape) - 2) if s == Split(1) else s for s in rows.sbp))
        # A wrapper with the scores' metadata and an empty part: its values are made
        # only where used (``computed``, ``attend``, ``realized``), never read from it.
        out = _wrap(AttentionScores, q._local.new_empty((0,), dtype=dtype or q.dtype),
                    layout)
        out.q, out.kt, out.steps = q, kt, steps
        return out

    def _then(self, step: tuple, dtype=None) -> "AttentionScores":
        return AttentionScores.of(self.q, self.kt, tuple(self.shape), self.steps + (step,),
                                  dtype or self.dtype)

    def computed(self) -> GlobalTensor:
        """The scores as the program wrote them (keys gathered), with autograd."""
        with _computed(), torch._C.DisableTorchFunctionSubclass():
            x = torch.bmm(self.q, self.kt).view(self.shape)
            for step in self.steps:
                if step[0] == "scale":
                    x = x * step[1]
                elif step[0] == "mask":
                    x = x + step[1]
                elif step[0] == "fill":
                    x = x.masked_fill(step[1], step[2])
                else:
                    x = torch.softmax(x, -1, dtype=step[1])
            return x if x.dtype == self.dtype else x.to(self.dtype)

    def attend(self, v: torch.Tensor) -> torch.Tensor:
        """``softmax(...) @ v`` as one scaled dot-product attention."""
        batch, (m, d), n = self.shape[:-2], self.q.shape[1:], self.kt.shape[2]
        lead = tuple(batch) if len(batch) == 2 else (1, math.prod(batch))
        with torch._C.DisableTorchFunctionSubclass():
            q = self.q.reshape(lead + (m, d))
            k = self.kt.transpose(1, 2).reshape(lead + (n, d))
            if tuple(v.shape[:-2]) != tuple(batch):   # (fewer heads, broadcast by matmul: multi-query)
                v = v.expand(tuple(batch) + tuple(v.shape[-2:]))
            values = v.reshape(lead + tuple(v.shape[-2:]))
            # torch's fused CPU kernel needs each row whole in memory (else its math form,
            # whose products would gather the keys): matmul copied broadcast keys into
            # kt's order (multi-query), and an expanded v repeats its rows
            q, k, values = (t if t.stride(-1) == 1 and 0 not in t.stride() else t.contiguous()
                            for t in (q, k, values))
            scale, mask = 1.0, None
            for step in self.steps[:-1]:
                if step[0] == "scale":
                    scale *= step[1]
                else:   # masks add; a filled one adds its value where it is True
                    extra = step[1] if step[0] == "mask" else torch.zeros_like(
                        step[1], dtype=q.dtype).masked_fill(step[1], step[2])
                    mask = extra if mask is None else mask + extra
            if mask is not None and len(batch) == 1 and mask.dim() == 3:
                mask = mask.unsqueeze(0)   # (the batch dims became (1, batch))
            out = F.scaled_dot_product_attention(q, k, values, attn_mask=mask, scale=scale)
            return out.reshape(tuple(batch) + tuple(out.shape[-2:]))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _IN_PLACE and args and type(args[0]) is AttentionScores:
            return _in_place(func, name, args, kwargs)
        found = _next_step(func, args, kwargs)
        if found is not None:
            return found
        if func in _METADATA or name == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if type(kwargs.get("out")) is AttentionScores or (
                name.endswith("_") and not name.endswith("__") and args
                and type(args[0]) is AttentionScores):
            raise RuntimeError(
                f"globaltensor: {name} writes into attention scores of a split sequence, "
                f"which are computed only when used (rules/attention_scores.py): write it "
                f"out of place (att = att.{name.rstrip('_')}(...))")
        args, kwargs = torch.utils._pytree.tree_map_only(
            AttentionScores, AttentionScores.computed, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def viewed(self, func, args: tuple):
        """``torch.matmul``'s last step on batched scores (back to the batch dims of q:
        attention's (batch, heads)), met below autograd: the view, still deferred; None
        for any other op."""
        if func is aten._unsafe_view.default and not self.steps and args[0] is self \
                and len(args[1]) <= 4 and list(args[1])[-2:] == list(self.shape[-2:]):
            return AttentionScores.of(self.q, self.kt, tuple(args[1]))
        return None

    def realized(self) -> GlobalTensor:
        """The product, computed below autograd: for an op that meets these scores
        inside another op's kernel (attention's math form), whose autograd node already
        holds their history (the product's)."""
        if self.steps:   # (noted above autograd: their ops always see them there)
            raise RuntimeError("globaltensor: internal error: attention's noted steps "
                               "reached an op below autograd")
        with _computed():
            out = aten.bmm.default(self.q, self.kt)
            return out if out.shape == self.shape else aten.view.default(out, list(self.shape))

    @property
    def _local(self):
        raise RuntimeError(
            "globaltensor: internal error: deferred attention scores reached an op below "
            "autograd; compute them first (AttentionScores.computed)")

    @_local.setter
    def _local(self, value) -> None:   # the wrapper's empty part: never read as a part
        self._empty = value

    def __tensor_flatten__(self):
        # what holds memory (torch's MemTracker asks, in gt.debug.simulate_step): nothing
        return ["_empty"], (self._layout, self.requires_grad, None)

    # GlobalTensor's own methods read the part: they see the computed scores
    def to_global(self, *args, **kwargs):
        return self.computed().to_global(*args, **kwargs)

    def to_local(self, *args, **kwargs):
        return self.computed().to_local(*args, **kwargs)

    def full(self):
        return self.computed().full()

    @property
    def local_part(self):
        return self.computed().local_part

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self.computed())


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
             torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__,
             torch.Tensor.device.__get__, torch.Tensor.requires_grad.__get__,
             torch.Tensor.ndim.__get__, torch.Tensor.is_cuda.__get__,
             torch.Tensor.grad_fn.__get__, torch.Tensor.is_leaf.__get__}
_SCALE = {torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.mul, torch.mul}
_DIVIDE = {torch.Tensor.__truediv__, torch.Tensor.div, torch.div}
_SCALES = _SCALE | _DIVIDE
_ADD = {torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.add, torch.add}
_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
_MATMUL = {torch.Tensor.__matmul__, torch.matmul, torch.Tensor.matmul, torch.bmm, torch.Tensor.bmm}


def _next_step(func, args: tuple, kwargs: dict):
    """The scores with one more of attention's steps noted, or attention's output for
    ``@ v``; None where ``func`` is no such step."""
    if not args or kwargs.get("out") is not None:
        return None
    x, rest = args[0], args[1:]
    if type(x) is not AttentionScores:   # (mask + scores), where(keep, scores, -inf)
        if func in _ADD and len(args) == 2 and type(args[1]) is AttentionScores:
            x, rest = args[1], (args[0],)
        elif func is torch.where and len(args) == 3 and type(args[1]) is AttentionScores \
                and not kwargs and isinstance(x, torch.Tensor) and x.dtype == torch.bool:
            keep, x = x, args[1]
            if not x.steps or x.steps[-1][0] != "softmax":
                fill = _excludes(args[2])
                if fill is not None and _masks(keep, x):
                    return x._then(("fill", keep.logical_not(), fill))
            return None
        else:
            return None
    softmaxed = bool(x.steps) and x.steps[-1][0] == "softmax"
    if softmaxed:
        if func in _MATMUL and len(rest) == 1 and isinstance(rest[0], GlobalTensor) \
                and type(rest[0]) is not AttentionScores and rest[0].dim() == x.dim() \
                and rest[0].shape[-2] == x.shape[-1] and rest[0].dtype == x.dtype \
                and all(a in (1, b) for a, b in zip(rest[0].shape[:-2], x.shape[:-2])):
            return x.attend(rest[0])
        if func is F.dropout and not kwargs.get("inplace", False) and (
                not _arg(rest, kwargs, 1, "training", True) or _arg(rest, kwargs, 0, "p", 0.5) == 0):
            return x
        if func is torch.Tensor.to and len(rest) == 1 and rest[0] == x.dtype and not kwargs:
            return x
        return None
    masked = any(s[0] != "scale" for s in x.steps)
    if func in _SCALES and len(rest) == 1 and not kwargs and not masked \
            and isinstance(rest[0], (int, float)) and not isinstance(rest[0], bool) and rest[0]:
        return x._then(("scale", float(rest[0]) if func in _SCALE else 1.0 / rest[0]))
    if func in _ADD and len(rest) == 1 and not kwargs and isinstance(rest[0], torch.Tensor) \
            and rest[0].dtype == x.dtype and _masks(rest[0], x):
        return x._then(("mask", rest[0]))
    if func in (torch.Tensor.masked_fill, torch.masked_fill) and len(rest) == 2 \
            and not kwargs and isinstance(rest[0], torch.Tensor) \
            and rest[0].dtype == torch.bool and _masks(rest[0], x) \
            and _excludes(rest[1]) is not None:
        return x._then(("fill", rest[0], _excludes(rest[1])))
    if func in _SOFTMAX:
        dim = _arg(rest, kwargs, 0, "dim", None)
        dtype = _arg(rest, kwargs, 2 if func is F.softmax else 1, "dtype", None)
        if dim in (-1, x.dim() - 1) and dtype in (None, x.dtype):
            return x._then(("softmax", None))
    return None


# in-place forms of the steps: noted on the scores themselves, which they return
_IN_PLACE = {"__imul__": torch.Tensor.__mul__, "mul_": torch.Tensor.__mul__,
             "__itruediv__": torch.Tensor.__truediv__, "div_": torch.Tensor.__truediv__,
             "__iadd__": torch.Tensor.__add__, "add_": torch.Tensor.__add__,
             "masked_fill_": torch.Tensor.masked_fill}


def _in_place(func, name: str, args: tuple, kwargs: dict):
    x = args[0]
    found = _next_step(_IN_PLACE[name], args, kwargs)
    if type(found) is not AttentionScores:
        raise RuntimeError(
            f"globaltensor: {name} with these arguments on attention scores of a split "
            f"sequence, which are computed only when used (rules/attention_scores.py): "
            f"write it out of place (att = att * s, att = att + mask, ...)")
    x.steps = found.steps
    return x


def _excludes(value):
    """``value`` as a float where filling a score with it excludes that key: -inf, or a
    number so negative (torch.finfo(dtype).min, as Hugging Face masks) that softmax
    gives it exactly zero and adding it to a score gives itself; else None."""
    if isinstance(value, torch.Tensor):
        if value.dim() or type(value) not in (torch.Tensor, GlobalTensor) \
                or value.device.type != "cpu":   # (a read on a GPU would wait for it)
            return None
        value = value.item()   # (a 0-d tensor: a constant every rank holds)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= -1e30:
        return float(value)
    return None


def _arg(rest: tuple, kwargs: dict, i: int, name: str, default):
    return rest[i] if len(rest) > i else kwargs.get(name, default)


def _masks(mask: torch.Tensor, scores: AttentionScores) -> bool:
    """A mask broadcastable to the scores with its keys whole (its queries whole too, or
    one row for all: a padding mask), on their placement; or plain where plain operands are taken as broadcast
    (a converted module's forward, ``gt.implicit_broadcast()``: Hugging Face builds its
    masks so), which the ops that use it then take so."""
    if type(mask) is AttentionScores or not (
            mask.placement == scores.placement if isinstance(mask, GlobalTensor)
            else type(mask) is torch.Tensor and modes.implicit):
        return False
    return (mask.dim() >= 2 and mask.dim() <= scores.dim()
            and mask.shape[-1] == scores.shape[-1] and mask.shape[-2] in (1, scores.shape[-2])
            and all(a in (1, b) for a, b in zip(mask.shape[:-2][::-1], scores.shape[:-2][::-1])))
