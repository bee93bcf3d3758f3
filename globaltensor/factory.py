"""Making global tensors: factories, ``tensor``, ``from_local`` and ``to_global``.

Random factories are placement-invariant and local: each rank generates only its
part, from the counter-based generator (``globaltensor.random``), so the value depends
on the seed, the draw number and each element's global index, never on the placement,
sbp or world size.

>>> import globaltensor as gt
>>> p = gt.placement.all("cpu")
>>> gt.manual_seed(0)
>>> x = gt.randn(4, 5, placement=p, sbp=gt.sbp.split(0))
>>> gt.manual_seed(0)
>>> torch.equal(x.full(), gt.randn(4, 5, placement=p, sbp=gt.sbp.broadcast).full())
True
"""
from __future__ import annotations

import functools
import zlib
from typing import Sequence

import torch

from . import comm
from .layout import Layout
from .local_parts import device_of, empty_local
from .partials import keep_on_first
from .placement import Placement, check_placement
from .random import local_sample, next_draw
from .tensor import GlobalTensor, from_full, from_local_part


def _layout(shape, placement, sbp) -> Layout:
    check_placement(placement)
    if sbp is None:
        raise ValueError("sbp is required, e.g. sbp=gt.sbp.split(0) or gt.sbp.broadcast")
    comm.init()
    return Layout.make(shape, placement, sbp)


def made(layout: Layout, dtype: torch.dtype) -> None:
    """A tensor of ``layout`` was made from this rank's arguments: its members compare
    shape, sbp and dtype at their next boxing (``comm.settle``), so an argument that
    differs between ranks raises there instead of aborting a collective."""
    if layout.placement.size > 1 and comm.get_rank() in layout.placement and not comm.tracing():
        comm.claim(*_claim_of(layout, dtype))


@functools.lru_cache(maxsize=64)   # (bounded: shapes that change every step)
def _claim_of(layout: Layout, dtype: torch.dtype) -> tuple:
    """(sorted ranks, fingerprint, description); crc32, as string hashes differ
    between processes."""
    what = f"{tuple(layout.shape)} {layout.sbp} {dtype} on {layout.placement}"
    return tuple(sorted(layout.placement.flat_ranks)), zlib.crc32(what.encode()), what


def _size(size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    try:
        shape = tuple(int(s) for s in size)
    except (TypeError, ValueError):
        raise ValueError(f"sizes must be ints, got {size!r}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"negative size in {shape}")
    return shape


def _from_local_fn(make):
    """A factory that builds only this rank's region (deterministic values)."""
    def factory(*size, placement: Placement = None, sbp=None, dtype: torch.dtype | None = None,
                requires_grad: bool = False, **fill) -> GlobalTensor:
        layout = _layout(_size(size), placement, sbp)
        rank = comm.get_rank()
        if rank not in layout.placement:
            local = empty_local(layout, dtype or torch.get_default_dtype())
        else:
            local = make(layout.local_shape(rank), dtype, device_of(placement), **fill)
            local = _zero_non_first(local, layout, rank, fill)
        made(layout, local.dtype)
        return GlobalTensor(local, layout, requires_grad=requires_grad)
    return factory


def _zero_non_first(local, layout: Layout, rank: int, fill) -> torch.Tensor:
    # A partial layout of a constant: the first member holds it, the others hold the
    # reduction's identity (zeros needs nothing, it is its own identity for sum).
    return keep_on_first(local, layout, rank)


zeros = _from_local_fn(lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
ones = _from_local_fn(lambda shape, dtype, device: torch.ones(shape, dtype=dtype, device=device))
empty = _from_local_fn(lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
zeros.__doc__ = "Zeros of a global shape: ``gt.zeros(4, 5, placement=p, sbp=gt.sbp.split(0))``."
ones.__doc__ = "Ones of a global shape: ``gt.ones(4, 5, placement=p, sbp=gt.sbp.broadcast)``."
empty.__doc__ = "Uninitialised in torch; zeros here, so partial layouts stay well defined."


def full(size: Sequence[int], fill_value, *, placement: Placement = None, sbp=None,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:
    """``fill_value`` everywhere: ``gt.full((2, 3), 7.0, placement=p, sbp=gt.sbp.broadcast)``."""
    make = _from_local_fn(lambda shape, dtype, device, value:
                          torch.full(shape, value, dtype=dtype, device=device))
    return make(*_size((size,)), placement=placement, sbp=sbp, dtype=dtype,
                requires_grad=requires_grad, value=fill_value)


def _random_fn(kind: str, doc: str):
    def factory(*size, placement: Placement = None, sbp=None, dtype: torch.dtype | None = None,
                requires_grad: bool = False) -> GlobalTensor:
        layout = _layout(_size(size), placement, sbp)
        dtype = dtype or torch.get_default_dtype()
        local = local_sample(kind, layout, next_draw(), dtype)  # every rank takes the draw
        made(layout, dtype)
        return GlobalTensor(local, layout, requires_grad=requires_grad)
    factory.__name__, factory.__doc__ = {"normal": "randn", "uniform": "rand"}[kind], doc
    return factory


randn = _random_fn("normal", """Standard normal values, generated locally and placement-invariant:
    ``gt.randn(4, 5, placement=p, sbp=gt.sbp.split(0))``.""")
rand = _random_fn("uniform", """Uniform values in [0, 1), generated locally and placement-invariant:
    ``gt.rand(4, 5, placement=p, sbp=gt.sbp.split(1))``.""")


def randint(low: int, high: int | None = None, size: Sequence[int] = None, *,
            placement: Placement = None, sbp=None, dtype: torch.dtype = torch.int64,
            requires_grad: bool = False) -> GlobalTensor:
    """Integers uniform in ``[low, high)`` (``randint(high, size)`` as in torch), generated
    locally and placement-invariant.

    >>> gt.randint(0, 10, (4, 5), placement=p, sbp=gt.sbp.split(0))   # doctest: +SKIP
    """
    if size is None:
        low, high, size = 0, low, high
    if size is None:
        raise ValueError("randint needs a size: gt.randint(low, high, (4, 5), ...)")
    if high <= low:
        raise ValueError(f"randint needs low < high, got low={low}, high={high}")
    layout = _layout(_size((size,)), placement, sbp)
    local = local_sample("integers", layout, next_draw(), dtype, low=low, high=high)
    made(layout, dtype)
    return GlobalTensor(local, layout, requires_grad=requires_grad)


def normal(mean: float, std: float, size: Sequence[int], *, placement: Placement = None,
           sbp=None, dtype: torch.dtype | None = None,
           requires_grad: bool = False) -> GlobalTensor:
    """Normal values of a given mean and std (floats), generated locally.

    >>> gt.normal(0.0, 0.02, (4, 5), placement=p, sbp=gt.sbp.split(0))   # doctest: +SKIP
    """
    layout = _layout(_size((size,)), placement, sbp)
    local = local_sample("normal", layout, next_draw(), dtype or torch.get_default_dtype(),
                         mean=mean, std=std)
    made(layout, local.dtype)
    return GlobalTensor(local, layout, requires_grad=requires_grad)


def arange(start, end=None, step=1, *, placement: Placement = None, sbp=None,
           dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:
    """``gt.arange(10, placement=p, sbp=gt.sbp.split(0))``, values as torch.arange."""
    value = torch.arange(start, end, step, dtype=dtype) if end is not None else \
        torch.arange(start, step=step, dtype=dtype) if step != 1 else torch.arange(start, dtype=dtype)
    layout = _layout(value.shape, placement, sbp)
    made(layout, value.dtype)
    return from_full(value, layout, requires_grad=requires_grad)


def tensor(data, *, placement: Placement = None, sbp=None, dtype: torch.dtype | None = None,
           requires_grad: bool = False) -> GlobalTensor:
    """A GlobalTensor of the whole value ``data`` (equal on every rank); each rank
    keeps its part.

    >>> gt.tensor([[1., 2.], [3., 4.]], placement=p, sbp=gt.sbp.split(0))   # doctest: +SKIP
    """
    value = torch.as_tensor(data, dtype=dtype).detach()
    layout = _layout(value.shape, placement, sbp)
    made(layout, value.dtype)
    return from_full(value, layout, requires_grad=requires_grad)


def from_local(t: torch.Tensor, placement: Placement = None, sbp=None, shape=None) -> GlobalTensor:
    """A GlobalTensor whose part on this rank is ``t`` (for a partial sbp: this rank's
    full-shape addend). Differentiable in ``t``. ``shape=None`` derives the global
    shape from every rank's local shape (a collective); parts that do not fit the sbp
    raise ``ValueError`` on every rank. With a given shape the placement's ranks compare
    it, the sbp and dtype (one small all-gather; ``DivergenceError`` when they differ).
    On a rank outside the placement ``t`` is a placeholder: with ``shape=None`` the
    tensor takes the members' dtype there; with a given shape that rank exchanges
    nothing, so the placeholder must have the members' dtype (``torch.empty(0, dtype=...)``).

    >>> x = gt.from_local(torch.ones(2, 3), placement=p, sbp=gt.sbp.split(0))  # doctest: +SKIP
    >>> x.shape   # with 2 ranks                                                # doctest: +SKIP
    torch.Size([4, 3])
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"from_local needs a torch.Tensor, got {type(t).__name__}")
    if isinstance(t, GlobalTensor):
        raise ValueError("from_local needs a plain (local) tensor; use x.to_global(...) "
                         "to redistribute a GlobalTensor")
    check_placement(placement)
    comm.init()
    rank = comm.get_rank()
    inside, given = rank in placement, shape is not None
    if not given:
        shape, dtype = _derive_shape(t if inside else None, placement, sbp)
        if not inside:
            # A rank outside holds nothing: its argument is a placeholder, and the
            # tensor takes the members' dtype (learnt from the exchange) on every rank.
            t = t.flatten()[:0].to(dtype)   # (cut from t: a part that requires grad still does)
    layout = _layout(_size((shape,)), placement, sbp)
    if inside:
        if given:
            _agree_on_given_shape(t, layout)
        want = layout.local_shape(rank)
        if tuple(t.shape) != want:
            raise ValueError(f"rank {rank}: local tensor of shape {tuple(t.shape)} does not fit "
                             f"{layout.sbp} of global shape {layout.shape} on {placement}: "
                             f"expected {want}")
        if t.device != device_of(placement):
            t = t.to(device_of(placement))
    return from_local_part(t, layout)


def _agree_on_given_shape(t: torch.Tensor, layout: Layout) -> None:
    """``from_local`` with a given shape: the placement's ranks compare it (with the sbp
    and dtype) and whether each part fits, in one small all-gather of integers, so a
    part that does not fit or a shape that differs raises on every rank of the placement.
    Raised on one rank only, the others would go on to collectives of other sizes
    (gloo aborts the process, or values mix)."""
    ranks = layout.placement.flat_ranks
    if len(ranks) == 1:
        return
    rank = comm.get_rank()
    fits = tuple(t.shape) == layout.local_shape(rank)
    claim = f"global shape {layout.shape}, {layout.sbp}, {t.dtype}"
    everyone = comm.all_gather_ints([int(fits), zlib.crc32(claim.encode())], ranks, same_length=True)
    misfit = [r for r, (ok, _) in zip(ranks, everyone) if not ok]
    if misfit:
        mine = "" if fits else (f" (rank {rank}: local tensor of shape {tuple(t.shape)}, "
                                f"expected {layout.local_shape(rank)})")
        raise ValueError(f"from_local: the local tensors of ranks {misfit} do not fit "
                         f"{layout.sbp} of global shape {layout.shape} on {layout.placement}"
                         f"{mine}; each rank's part must be its part of that shape")
    groups: dict = {}
    for r, (_, digest) in zip(ranks, everyone):
        groups.setdefault(digest, []).append(r)
    if len(groups) > 1:
        raise comm.DivergenceError(
            f"globaltensor: from_local on rank {rank} ({claim}) met other shapes, sbp or dtypes: "
            f"ranks {' / '.join(str(g) for g in groups.values())} passed different ones; every "
            f"rank of the placement must pass the same shape, sbp and dtype")


# Every dtype, in one order on every rank: a dtype travels as its index.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def members_metadata(tensors: Sequence[torch.Tensor] | None, placement: Placement) -> dict:
    """rank -> [(shape, dtype) of each of its ``tensors``] for every member of
    ``placement``, known on every rank of the world afterwards: one small all-gather of
    integers over the world (a collective: every rank calls it; ranks outside the
    placement pass None). For what ranks outside cannot know by themselves.

    >>> members_metadata([out], p)[p.ranks[0]]   # [((3, 2), torch.int64)]  # doctest: +SKIP
    """
    mine = [] if tensors is None else \
        [v for t in tensors for v in (_DTYPES.index(t.dtype), t.dim(), *t.shape)]
    everyone = comm.all_gather_ints(mine)
    out = {}
    for r in placement:
        ints, found = everyone[r], []
        while ints:
            dtype, ndim = _DTYPES[ints[0]], ints[1]
            found.append((tuple(ints[2:2 + ndim]), dtype))
            ints = ints[2 + ndim:]
        out[r] = found
    return out


def _derive_shape(t, placement: Placement, sbp) -> tuple[tuple[int, ...], torch.dtype]:
    """The global shape (and the members' dtype) from every rank's local tensor; all
    ranks check all parts so they raise together instead of some waiting in a later
    collective."""
    parts = {r: found[0] for r, found in
             members_metadata(None if t is None else [t], placement).items()}
    ndims = {len(s) for s, _ in parts.values()}
    if len(ndims) != 1:
        raise ValueError(f"from_local: local tensors have different numbers of dims: "
                         f"{ {r: s for r, (s, _) in parts.items()} }")
    dtypes = {d for _, d in parts.values()}
    if len(dtypes) != 1:
        raise ValueError(f"from_local: local tensors have different dtypes: {sorted(map(str, dtypes))}")
    ndim = ndims.pop()
    nd_sbp = Layout.make((1,) * ndim, placement, sbp).sbp
    shape = []
    for d in range(ndim):
        split_axes = [a for a, s in enumerate(nd_sbp) if getattr(s, "dim", None) == d]
        # Walk the ranks whose coordinate is 0 on every axis that does not split d.
        total = 0
        for r, (s, _) in parts.items():
            coord = placement.coord(r)
            if all(c == 0 for a, c in enumerate(coord) if a not in split_axes):
                total += s[d]
        shape.append(total)
    shape = tuple(shape)
    layout = Layout(shape, placement, nd_sbp)
    bad = {r: s for r, (s, _) in parts.items() if s != layout.local_shape(r)}
    if bad:
        raise ValueError(f"from_local: local shapes do not fit {nd_sbp} on {placement} "
                         f"(derived global shape {shape}); mismatched ranks: "
                         + ", ".join(f"rank {r} has {s}, expected {layout.local_shape(r)}"
                                     for r, s in sorted(bad.items())))
    return shape, dtypes.pop()


def to_global(t: torch.Tensor, placement: Placement = None, sbp=None) -> GlobalTensor:
    """``from_local`` for a plain tensor, ``t.to_global(...)`` for a GlobalTensor."""
    if isinstance(t, GlobalTensor):
        return t.to_global(placement, sbp)
    return from_local(t, placement, sbp)
