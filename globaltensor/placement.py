"""Placement: a device type and a hierarchy (mesh) of the ranks that hold a tensor.

>>> import globaltensor as gt
>>> p = gt.placement("cpu", ranks=[[0, 1], [2, 3]])   # doctest: +SKIP
>>> p.shape, p.ndim, p.group(2, axis=1)                 # doctest: +SKIP
((2, 2), 2, (2, 3))
"""
from __future__ import annotations

import itertools
import operator
from typing import Iterator, Sequence

from . import env

DEVICE_TYPES = ("cpu", "cuda")


def _flatten(ranks, depth: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return (flat ranks, shape) of a nested list; raise on ragged nesting."""
    if isinstance(ranks, (str, bytes)):
        raise ValueError(f"ranks must be a (nested) list of ints, got {ranks!r}")
    try:
        rank = operator.index(ranks)
    except TypeError:
        pass
    else:
        if isinstance(ranks, bool):
            raise ValueError(f"ranks must be ints, got {ranks!r}")
        return (rank,), ()
    try:
        items = list(ranks)
    except TypeError:
        raise ValueError(f"ranks must be a (nested) list of ints, got {ranks!r}") from None
    if not items:
        raise ValueError("placement ranks must not be empty")
    parts = [_flatten(item, depth + 1) for item in items]
    shapes = {shape for _, shape in parts}
    if len(shapes) != 1:
        raise ValueError(f"placement ranks are ragged (sub-lists of different shapes): {ranks!r}")
    flat = tuple(r for part, _ in parts for r in part)
    return flat, (len(items),) + shapes.pop()


def _check_world(flat: Sequence[int]) -> None:
    world = env.get_world_size()
    if max(flat) >= world:
        r = next(r for r in flat if r >= world)
        raise ValueError(f"rank {r} in placement ranks is outside the world "
                         f"of {world} process(es)")


def _nest(flat: Sequence[int], shape: Sequence[int]):
    if not shape:
        return flat[0]
    step = len(flat) // shape[0]
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


class Placement:
    """Which ranks hold a tensor, on which device type, arranged as a hierarchy.

    ``placement("cpu", ranks=[0, 1])`` is 1-D; ``ranks=[[0, 1], [2, 3]]`` is a 2x2 mesh
    whose axis 0 runs down the rows. Immutable, hashable, equal by (type, ranks).
    """

    __slots__ = ("_type", "_flat", "_shape", "_coords", "_hash", "_unchecked")

    def __init__(self, type: str = "cpu", ranks=None):
        if isinstance(type, Placement):  # placement(p) copies
            type, ranks = type.type, type.ranks
        if type not in DEVICE_TYPES:
            raise ValueError(f"unknown placement type {type!r}: use one of {DEVICE_TYPES}")
        if ranks is None:
            raise ValueError("placement needs ranks, e.g. placement('cpu', ranks=[0, 1])")
        if isinstance(ranks, range):
            ranks = list(ranks)
        flat, shape = _flatten(ranks)
        if not shape:  # a single int
            shape = (1,)
        for r in flat:
            if r < 0:
                raise ValueError(f"rank {r} in placement ranks is negative")
        # In a launched world a rank past it is a mistake, named at once; a process on
        # its own may name a bigger world (``gt.debug.simulate_step``): there, laying a
        # tensor out on it raises (``check_world``)
        launched = env.get_world_size() > 1
        if launched:
            _check_world(flat)
        if len(set(flat)) != len(flat):
            dup = sorted({r for r in flat if flat.count(r) > 1})
            raise ValueError(f"placement ranks contain duplicates: {dup}")
        self._type = type
        self._flat = flat
        self._shape = shape
        self._coords = {r: c for r, c in zip(flat, itertools.product(*map(range, shape)))}
        self._hash = hash((type, flat, shape))
        self._unchecked = not launched and max(flat) > 0   # (for ``check_world``)

    def check_world(self) -> None:
        """Raise unless every rank is one of this world's (when a layout on it is first
        made: a process on its own may make a placement of a bigger world)."""
        if self._unchecked:
            _check_world(self._flat)

    @classmethod
    def all(cls, type: str = "cpu") -> "Placement":
        """Every rank of the world, 1-D."""
        return cls(type, list(range(env.get_world_size())))

    # --- the public view -------------------------------------------------------
    @property
    def type(self) -> str:
        return self._type

    @property
    def ranks(self):
        """The ranks as the nested list they were given as (a fresh copy)."""
        return _nest(self._flat, self._shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return len(self._flat)

    @property
    def flat_ranks(self) -> tuple[int, ...]:
        """The ranks in row-major hierarchy order."""
        return self._flat

    def __contains__(self, rank: int) -> bool:
        return rank in self._coords

    def __iter__(self) -> Iterator[int]:
        return iter(self._flat)

    def __eq__(self, other) -> bool:
        return (isinstance(other, Placement) and self._type == other._type
                and self._flat == other._flat and self._shape == other._shape)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # Rebuilt, not copied: the cached hash is of this process (str hashes are salted
        # per process), and torch.compile's caches pickle placements across processes.
        return Placement, (self._type, self.ranks)

    def __repr__(self) -> str:
        return f'placement(type="{self._type}", ranks={self.ranks})'

    # --- hierarchy -------------------------------------------------------------
    def coord(self, rank: int) -> tuple[int, ...] | None:
        """The rank's index in the hierarchy, or None when it is not a member."""
        return self._coords.get(rank)

    def rank_at(self, coord: Sequence[int]) -> int:
        index = 0
        for c, n in zip(coord, self._shape):
            index = index * n + c
        return self._flat[index]

    def group(self, rank: int, axis: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``rank`` except along ``axis``,
        in axis order (the order in which a split hands out parts)."""
        coord = list(self._coords[rank])
        members = []
        for i in range(self._shape[axis]):
            coord[axis] = i
            members.append(self.rank_at(coord))
        return tuple(members)

    def groups(self, axis: int) -> list[tuple[int, ...]]:
        """Every sub-group along ``axis`` (they partition the placement)."""
        seen, out = set(), []
        for r in self._flat:
            g = self.group(r, axis)
            if g[0] not in seen:
                seen.add(g[0])
                out.append(g)
        return out


placement = Placement


def check_placement(placement, what: str = "placement") -> Placement:
    """``placement`` when it is a Placement, else a ValueError saying what ``what`` got.

    >>> check_placement([0, 1])
    Traceback (most recent call last):
    ValueError: placement must be a gt.placement, got [0, 1]
    """
    if not isinstance(placement, Placement):
        raise ValueError(f"{what} must be a gt.placement, got {placement!r}")
    return placement


def common_placement(placements, what: object) -> Placement:
    """The one placement of the operands of ``what`` (an op), else a ValueError naming
    theirs (an op's inputs must share a placement).

    >>> common_placement([p, q], "aten.add")   # doctest: +SKIP
    ValueError: aten.add: inputs are on different placements (...); move them onto one ...
    """
    distinct = list(dict.fromkeys(placements))
    if len(distinct) != 1:
        raise ValueError(f"{what}: inputs are on different placements "
                         f"({' and '.join(map(str, distinct))}); move them onto one with "
                         f"x.to_global(placement=...)")
    return distinct[0]
