"""The one cost model: what boxing, per-op choice, whole-step planning and
``auto_parallel``'s estimates price with.

Moves are priced alpha-beta, per backend: a placement's device chooses the backend that
carries its collectives (gloo for cpu; NCCL for cuda where every rank has a GPU of its
own, else gloo: ``comm.backend_of``), and the backend chooses the constants. Compute is
priced per device (multiply-adds of matrix products, elements any other op writes), so
that duplicated work (a weight gathered and the whole product computed on every rank)
is not free. The absolute numbers matter less than their ratios: they decide which
route wins, and what a move costs against compute.

>>> costs_for("cpu").backend
'gloo'
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

from . import comm
from .layout import Layout
from .sbp import Split, StridedSplit


@dataclass(frozen=True)
class Costs:
    """One backend's constants (seconds, and seconds per byte).

    ``alpha``: one message of a collective; ``launch``: starting one collective from
    Python (planning, packing, the call, the wait) on top of its messages; ``beta``: a
    byte through a collective; ``gamma``: a byte copied locally (cheap, but dearer than
    a view, so a route with fewer copies wins a tie); ``p2p_beta``: a byte sent
    point-to-point; ``native_reduce_scatter``: the backend reduces and scatters in one
    collective (else a partial -> split is an exchange of parts and a local sum);
    ``mac``: one multiply-add of a matrix product; ``element``: one element any other
    op writes.
    """
    backend: str
    alpha: float
    launch: float
    beta: float
    gamma: float
    p2p_beta: float
    native_reduce_scatter: bool
    mac: float = 1 / 40e9
    element: float = 1 / 1e9

    def describe(self) -> str:
        """One line for ``gt.debug.explain``: the backend and its constants."""
        return (f"priced for {self.backend}: launch {self.launch * 1e6:.0f} us, "
                f"alpha {self.alpha * 1e6:.0f} us, {1 / self.beta / 1e9:.1f} GB/s "
                f"collective, {1 / self.p2p_beta / 1e9:.1f} GB/s point-to-point, "
                f"{1 / self.gamma / 1e9:.0f} GB/s local copy")


# gloo on loopback TCP, measured here: a bare all-reduce of one element between two
# processes costs 0.22-0.28 ms with the machine loaded, so two collectives of half the
# bytes each (a reduce-scatter, then an all-gather) cost more than one all-reduce;
# point-to-point messages are slower per byte than its tuned collectives, which makes
# collectives win ties on one placement; its reduce_scatter is slower than an exchange
# of parts and a local sum (docs/DESIGN.md).
GLOO = Costs("gloo", alpha=30e-6, launch=250e-6, beta=1 / 1.5e9, gamma=1 / 30e9,
             p2p_beta=1 / 1.2e9, native_reduce_scatter=False)

# NCCL between the GPUs of one node (NVLink; bus bandwidth of an 8-GPU H100/H200 node
# about 150-400 GB/s): a launch is the host's cost of one call (tens of microseconds of
# Python and a kernel launch), a copy runs at device memory bandwidth (about 3 TB/s
# read plus write on an H200), and reduce_scatter is one kernel, cheaper than the
# exchange gloo needs.
NCCL = Costs("nccl", alpha=10e-6, launch=40e-6, beta=1 / 150e9, gamma=1 / 1500e9,
             p2p_beta=1 / 120e9, native_reduce_scatter=True, mac=1 / 300e12, element=1 / 200e9)

_BY_BACKEND = {"gloo": GLOO, "nccl": NCCL}

# Compute per device: one CPU core with MKL does 45-48 GMAC/s for 256 x 128 x 512 (measured
# here), writes 1.5 G elements/s in a softmax and 8 G/s in an add; an H200 does hundreds
# of TMAC/s in bf16 and writes elements at memory bandwidth (about 3 TB/s, read plus write).
_COMPUTE = {"cpu": (1 / 40e9, 1 / 1e9), "cuda": (1 / 300e12, 1 / 200e9)}

# Moving a parameter for an op costs more than its bytes once: its gradient comes back
# the same way in backward (outside dispatch, where no record shows it), so per-op choice
# and step planning weigh a parameter's boxing by this; moving the activation instead
# keeps the layer as annotated (a Megatron column-split weight stays split).
PARAMETER_WEIGHT = 2.0


@lru_cache(maxsize=None)
def _with_compute(base: Costs, device_type: str) -> Costs:
    """``base`` with ``device_type``'s compute rates (itself where they are its own)."""
    mac, element = _COMPUTE.get(device_type, _COMPUTE["cpu"])
    return base if (base.mac, base.element) == (mac, element) else \
        dataclasses.replace(base, mac=mac, element=element)


def costs_for(device_type: str) -> Costs:
    """The constants of the backend that carries ``device_type``'s collectives (gloo's
    for a backend without constants of its own), with ``device_type``'s compute rates.

    >>> costs_for("cpu") is GLOO
    True
    """
    return _with_compute(_BY_BACKEND.get(comm.backend_of(device_type), GLOO), device_type)


def costs_of(*layouts: Layout) -> Costs:
    """The constants for a move between ``layouts``: the slowest backend among their
    placements' (cpu <-> cuda goes at gloo's pace).

    >>> costs_of(src_layout, dst_layout).backend     # doctest: +SKIP
    'nccl'
    """
    kinds = {layout.placement.type for layout in layouts}
    if len(kinds) == 1:
        return costs_for(next(iter(kinds)))
    return max((costs_for(k) for k in kinds), key=lambda c: c.beta)


def max_local_bytes(layout: Layout, itemsize: int) -> int:
    """The largest local tensor of ``layout`` in bytes (the slowest rank sets the pace)."""
    return _max_local_numel(layout) * itemsize


@lru_cache(maxsize=16384)   # step planning on 2-D placements prices thousands of layouts
def _max_local_numel(layout: Layout) -> int:
    # Each placement axis splits at most one dim, so a dim's local length depends on the
    # coordinates of the axes splitting it alone: the largest part is the product of
    # each dim's longest, found over those axes' coordinates, not over every rank (a
    # million parts a step at 1024 ranks).
    pshape, axes_of = layout.placement.shape, {}
    for axis, s in enumerate(layout.sbp):
        if isinstance(s, (Split, StridedSplit)):
            axes_of.setdefault(s.dim, []).append(axis)
    numel = math.prod(n for d, n in enumerate(layout.shape) if d not in axes_of)
    for d, axes in axes_of.items():
        longest = 0
        for picked in itertools.product(*(range(pshape[a]) for a in axes)):
            coord = [0] * len(pshape)
            for a, c in zip(axes, picked):
                coord[a] = c
            longest = max(longest, layout.local_shape(layout.placement.rank_at(coord))[d])
        numel *= longest
    return numel


# --- the work of one op on one rank's parts (per-op pricing, the planner, simulate_step) --

_PRODUCTS = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1}   # op -> index of its first factor


def product_macs(func, targets: tuple, rank: int) -> "int | None":
    """Multiply-adds of a product (mm, bmm, addmm, baddbmm) or of a fused attention
    kernel on ``rank``'s parts of its input layouts ``targets``; None for any other op.
    Attention meets every key: with the sequence split (ring attention) a rank's
    queries still meet the whole key sequence.

    >>> product_macs(aten.mm.default, (a, b), 0)   # doctest: +SKIP
    32768
    """
    name = func.overloadpacket.__name__
    first = _PRODUCTS.get(name)
    if first is None:
        if "scaled_dot_product" not in name or len(targets) < 3:
            return None
        backward = name.endswith("_backward")   # (grad_out, query, key, ...)
        query, key = targets[1 if backward else 0], targets[2 if backward else 1]
        both = 2 * math.prod(query.local_shape(rank)) * key.shape[-2]   # q k^T, p v
        return both * 5 // 2 if backward else both
    if len(targets) < first + 2:
        return None
    a, b = targets[first], targets[first + 1]
    return math.prod(a.local_shape(rank)) * b.local_shape(rank)[-1]


def ring_seconds(func, targets: tuple, itemsize: int = 4) -> float:
    """The hops of ring attention (``rules/ring_attention.py``) when a fused attention
    kernel's keys are split on the sequence: forward, n - 1 hops of a key and a value
    block; backward, those and the blocks' gradients (fp32) travelling with them, one
    hop more to bring the gradients home. 0.0 for any other op or signature.

    >>> ring_seconds(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v))  # doctest: +SKIP
    0.00061
    """
    name = func.overloadpacket.__name__
    if "scaled_dot_product" not in name or len(targets) < 3:
        return 0.0
    backward = name.endswith("_backward")
    key, value = targets[2:4] if backward else targets[1:3]
    n = math.prod(key.placement.shape[a] for a, s in enumerate(key.sbp)
                  if getattr(s, "dim", None) == key.ndim - 2)
    if n <= 1:
        return 0.0
    rates = costs_of(key, value)
    blocks = max_local_bytes(key, itemsize) + max_local_bytes(value, itemsize)
    hop = rates.launch + 2 * rates.alpha + rates.p2p_beta * blocks
    if not backward:
        return (n - 1) * hop
    grads = (hop - rates.launch - 2 * rates.alpha) * 4 / itemsize + 2 * rates.alpha
    return (n - 1) * (hop + grads) + rates.launch + grads


@lru_cache(maxsize=None)
def returns_view(func) -> bool:
    """Whether ``func``'s schema says it returns a view of an input (or the input)."""
    return any(r.alias_info is not None for r in func._schema.returns)


@lru_cache(maxsize=None)
def writes_nothing(func) -> bool:
    """Whether ``func`` only makes a view: its schema says it returns an input it does
    not write, or it is ``_unsafe_view`` (a view its schema does not declare). An
    in-place op (``mul_``, an optimizer's ``addcdiv_``) returns its input too, and writes
    every element of it."""
    return func.overloadpacket.__name__ == "_unsafe_view" or any(
        r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
