"""Check mode: where a GlobalTensor came from, so that ranks at the same collective with
*different* tensors (a logging helper called with ``a`` on rank 0 and ``b`` on rank 1:
same op, same layouts, same line) are told apart before they communicate.

A tensor made while the check mode is on gets an origin: one integer, equal on every
rank for the same tensor of an SPMD program. A tensor the program makes (``gt.tensor``,
``from_local``, ``to_global``, ...) takes the digest of the program line that made it;
an op's output the digest of the op and its inputs' origins. The check mode's
fingerprints (boxing, reads) include the origins of the tensors involved. A tensor made
before the check mode was on has origin 0, the same everywhere: run the whole program
under ``GLOBALTENSOR_DEBUG=1`` to cover every tensor.

>>> with gt.debug.check_consistency():                       # doctest: +SKIP
...     a, b = gt.tensor(u, ...), gt.tensor(v, ...)           # two lines: two origins
...     log((a if rank == 0 else b).sum())                    # DivergenceError, not a mix
"""
from __future__ import annotations

import zlib

from torch.utils._pytree import tree_flatten

from . import env, modes
from .boxing.run import call_site

__all__ = ["of", "made_by_program", "made_by_op", "OpOnInputs", "Checking"]


class Checking(modes.Mode):
    """Check mode, on while entered (``gt.debug.check_consistency()``; for the whole
    program under GLOBALTENSOR_DEBUG=1): ``comm.check_mode()`` is true, each call's
    boxing is named (and fingerprinted) with its inputs' origins, and its outputs take
    the origin of the op on those inputs."""

    checks = True

    def run(self, func, decision, leaves: list, spec, why):
        if why is not None or modes.innermost(Checking) is not self:
            return self.below.run(func, decision, leaves, spec, why)
        why = OpOnInputs(func, leaves)
        out = self.below.run(func, decision, leaves, spec, why)
        made_by_op(why, tree_flatten(out)[0])
        return out


_DEBUG = Checking()   # on for the whole program under GLOBALTENSOR_DEBUG=1


def _debug_mode_from_start() -> None:
    if not env.debug_enabled():
        modes.leave(_DEBUG)
    elif not modes.is_on(_DEBUG):
        modes.enter(_DEBUG)


env.read_at_import(_debug_mode_from_start)
modes.on_reset(lambda: None, _debug_mode_from_start)


def of(x) -> int:
    """``x``'s origin (0: made outside the check mode, or not a GlobalTensor)."""
    return getattr(x, "_digest", 0)


def made_by_program(t) -> None:
    """Stamp a tensor the program made: the digest of the line that made it."""
    t._digest = zlib.crc32(call_site().encode())


def made_by_op(why: "OpOnInputs", outputs) -> None:
    """Stamp an op's output tensors with the digest of the op and its inputs."""
    for o in outputs:
        if hasattr(o, "_layout"):
            o._digest = why.digest


class OpOnInputs:
    """An op with its inputs' origins: what dispatch names its boxing by in check mode,
    so the fingerprint compared before communicating tells other inputs apart."""

    def __init__(self, func, leaves):
        self.func = func
        self.origins = tuple(of(x) for x in leaves if hasattr(x, "_layout"))
        self.digest = zlib.crc32(f"{func}{self.origins}".encode())

    def __str__(self) -> str:
        return f"{self.func} (inputs of origin {', '.join(f'{o:08x}' for o in self.origins)})"
