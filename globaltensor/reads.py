"""Reading a GlobalTensor's value into Python: ``x.item()``, ``float(x)``, ``int(x)``,
``bool(x)``, ``x.tolist()``, ``x.numpy()``, ``torch.equal``, ``torch.allclose``,
``f"{x:.4f}"``.

A read gives the whole value on every rank that calls it, as ``x.full()`` does. When
``x`` is broadcast on every rank of the world (a loss: dispatch makes the scalar result
of a reduction broadcast) each rank already holds it and reads its own copy, with no
communication: ``if rank == 0: log(loss.item())`` works. Otherwise the read is a
collective of the whole world, also of the ranks outside the placement, which run the
same program and need the value as much (torch's ``trunc_normal_`` tests values in a
loop; ``x.numpy()`` is ``x.full()`` as numpy). Its ranks first meet briefly
(``comm.meet``), so a read called on some ranks only fails within
GLOBALTENSOR_READ_TIMEOUT seconds, naming the call, instead of hanging in its
collective. On a rank of a broadcast tensor's placement, ``x.to_local()`` is its copy.

>>> loss = F.cross_entropy(logits, target)   # logits, target split(0)  # doctest: +SKIP
>>> if gt.get_rank() == 0:                                               # doctest: +SKIP
...     print(loss.item())                   # broadcast: this rank's copy
"""
from __future__ import annotations

import torch

from . import comm, origins
from .boxing.run import call_site
from .placement import Placement
from .sbp import Broadcast, broadcast
from .tensor import GlobalTensor, install_methods, to_layout


def whole_value(x: GlobalTensor, call: str) -> torch.Tensor:
    """``x``'s whole value on this rank as a plain tensor, for the read ``call`` (e.g.
    "x.item()"): the local copy when ``x`` is broadcast on every rank, else gathered
    from the ranks holding its parts by every rank of the world (who must all read it).

    >>> whole_value(loss, "x.item()").item()      # doctest: +SKIP
    """
    layout = x._layout
    placement = layout.placement
    world = comm.get_world_size()
    broadcast_here = all(s.__class__ is Broadcast for s in layout.sbp)
    if broadcast_here and placement.size == world:
        return x._local
    everyone = tuple(range(world))
    if not comm.tracing():  # a traced read runs on every rank by construction
        same = f"a {x.dtype} {tuple(x.shape)} tensor with sbp {layout.sbp} on {placement}"
        if comm.check_mode():  # also which tensor: made on which line, by which ops
            same += f" of origin {origins.of(x):08x}"
        read = f"{call} of {same}, called from {call_site()}"
        comm.meet(everyone, call, read, _advice(call, layout.placement, broadcast_here),
                  f"read {same}")
    return to_layout(x, sbp=(broadcast,), placement=Placement(placement.type, list(everyone)))._local


def _advice(call: str, placement: Placement, broadcast_here: bool) -> str:
    whole = placement.size == comm.get_world_size()
    move = "sbp=gt.sbp.broadcast" if whole else \
        f"placement=gt.placement.all(\"{placement.type}\"), sbp=gt.sbp.broadcast"
    text = (f"Reading a tensor that is not broadcast on every rank is a collective of the "
            f"whole world: call {call} on every rank, or make the tensor broadcast on every "
            f"rank first (y = x.to_global({move}), called on every rank); then reading y "
            f"needs no communication, on any one rank.")
    if broadcast_here:
        text += (" On a rank of its placement, which holds the whole value, x.to_local() "
                 "is that copy, without communication.")
    return text


def item(x: GlobalTensor, call: str = "x.item()"):
    """``x.item()``: a Python number."""
    return whole_value(x, call).item()


def tolist(x: GlobalTensor):
    """``x.tolist()``: nested lists of the whole value."""
    return whole_value(x, "x.tolist()").tolist()


def numpy(x: GlobalTensor, force: bool = False):
    """``x.numpy()``: a numpy array of the whole value (a copy when it was gathered)."""
    return whole_value(x, "x.numpy()").detach().cpu().numpy(force=force)


def equal(a: GlobalTensor, b: GlobalTensor) -> bool:
    """``torch.equal(a, b)``: same shape and elements."""
    if a.shape != b.shape:
        return False
    call = "torch.equal(a, b)"
    values = [whole_value(t, call) if isinstance(t, GlobalTensor) else t for t in (a, b)]
    return bool(values[0].equal(values[1].to(values[0].device)))


def allclose(a, b, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> bool:
    """``torch.allclose(a, b)``. Two GlobalTensors compare part by part and read one
    bool (their parts are not gathered); a plain operand (an expected value in a test)
    is compared with the other's whole value, as ``torch.equal`` does."""
    if isinstance(a, GlobalTensor) and isinstance(b, GlobalTensor):
        return bool(torch.isclose(a, b, rtol, atol, equal_nan).all())
    call = "torch.allclose(a, b)"
    a, b = (whole_value(t, call) if isinstance(t, GlobalTensor) else t for t in (a, b))
    return torch.allclose(a, b.to(a.device), rtol, atol, equal_nan)


def _format(x: GlobalTensor, format_spec: str) -> str:
    # As torch's for a 0-d tensor (f"{loss:.4f}"), which skips subclasses.
    if x.dim() == 0 and format_spec:
        return format(item(x, f"f\"{{x:{format_spec}}}\""), format_spec)
    return object.__format__(x, format_spec)


# A broadcast tensor's reads take this rank's copy, without communication.
install_methods(item=lambda self: item(self), tolist=tolist, __format__=_format,
                numpy=lambda self, *, force=False: numpy(self, force))
