"""Plain tensor operands of ops on GlobalTensors: taken as broadcast on the op's
placement inside ``implicit_broadcast()`` and in backward formulas, refused elsewhere
(``decide.py`` raises, naming ``gt.implicit_broadcast``).

>>> with gt.implicit_broadcast():         # doctest: +SKIP
...     h = emb(torch.arange(T))
"""
from __future__ import annotations

import contextlib
import weakref
import zlib
from typing import Iterator

import torch

from .. import comm, modes
from ..advice import dtensor_operand_error, is_dtensor
from ..layout import Layout
from ..local_parts import device_of, empty_local
from ..sbp import broadcast
from ..tensor import GlobalTensor, wrap_part


class ImplicitBroadcast(modes.Mode):
    """The mode of an open ``implicit_broadcast()``: plain tensor operands are taken
    as broadcast (the dispatcher reads ``modes.implicit``; the warm path stays open)."""

    takes_plain = True


@contextlib.contextmanager
def implicit_broadcast() -> Iterator[None]:
    """Inside, a plain tensor operand of an op on GlobalTensors is taken as broadcast
    on the op's placement (each rank must pass the same value, as DTensor's
    ``implicit_replication``); GLOBALTENSOR_DEBUG=1 or ``gt.debug.check_consistency()``
    verify that it is. Outside, such operands raise ValueError.

    >>> pos = torch.arange(T)                 # doctest: +SKIP
    >>> with gt.implicit_broadcast():         # doctest: +SKIP
    ...     h = emb(pos)                      # emb's weight is a GlobalTensor
    """
    with ImplicitBroadcast():
        yield


def as_broadcast(t: torch.Tensor, leaves, func) -> GlobalTensor:
    """A plain operand taken as broadcast on the op's placement: inside
    ``implicit_broadcast()``, or a tensor a backward formula built (zeros to scatter
    into, an index), which is the same on every rank; a DTensor is refused."""
    if is_dtensor(t):
        raise dtensor_operand_error(func)
    placement = next(x._layout.placement for x in leaves if type(x) is GlobalTensor)
    shape = t.shape
    if not all(d.__class__ is int for d in shape):
        # A symbolic dim: torch.compile made it dynamic (its automatic dynamic shapes,
        # after a recompile for another shape: one nn.Embedding's forward for tokens,
        # then for positions). A layout holds static shapes: the trace specializes the
        # dim (int() guards on its value), and another size compiles again.
        shape = torch.Size(int(d) for d in shape)
    layout = _layouts.get((shape, placement))
    if layout is None:   # (made per call it costs more than the op: positions, each step)
        if len(_layouts) >= 64:
            _layouts.clear()
        layout = _layouts[shape, placement] = Layout.make(
            shape, placement, (broadcast,) * placement.ndim)
    rank = comm.get_rank()
    if rank not in placement:
        return wrap_part(empty_local(layout, t.dtype), layout)
    if modes.implicit and comm.check_mode() and not comm.tracing():
        value = t.detach().cpu().contiguous().reshape(-1)
        comm.agree(zlib.crc32(value.view(torch.uint8).numpy().tobytes()), tuple(placement),
                   f"{func}: a plain operand of shape {tuple(t.shape)} taken as broadcast "
                   f"under gt.implicit_broadcast()",
                   "hold different values: a plain operand must be the same on every rank")
    return wrap_part(t.to(device_of(placement)), layout)


_layouts: dict = {}   # (shape, placement) -> the broadcast layout of a plain operand


# id(leaf) -> a weak reference to it, per plain leaf whose gradient is made plain again
_watched: dict = {}
_PLAIN_CLASSES = (torch.Tensor, torch.nn.Parameter)


def watch_gradient(t: torch.Tensor) -> None:
    """A plain tensor that requires grad (a parameter added to a global model after
    ``gt.nn.to_global``, a learnable scale, or a view or result of one), used with
    GlobalTensors: its gradient comes out of their backward as a GlobalTensor, which
    would reach the plain parameter's ``.grad``, where a plain optimizer cannot use it.
    A hook makes it the plain whole value as it arrives: the sum of every rank's part,
    as a broadcast operand's gradient is (``x.full()``), so the ranks' copies of the
    parameter stay equal, as DDP's are. (A leaf is hooked once; a view or result, made
    anew each step, each time it is used.)"""
    if t.__class__ not in _PLAIN_CLASSES or not t.requires_grad \
            or torch._C._current_graph_task_id() != -1 or comm.tracing():
        # (not requires_grad: the base of a view that does, ``x.to_local()``'s)
        return
    if t.is_leaf:
        ref = _watched.get(id(t))
        if ref is not None and ref() is t:
            return
        key = id(t)
        _watched[key] = weakref.ref(t, lambda r: _watched.get(key) is r and _watched.pop(key))
    t.register_hook(_whole)


def _whole(grad):
    return grad.full() if isinstance(grad, GlobalTensor) else None

