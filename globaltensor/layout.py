"""Pure shape math: which region of a global tensor each rank holds.

The balanced split gives the first ``L % n`` parts one extra element. On an n-D
placement, axis 0 splits first and each later axis splits the part it is given again;
broadcast and partial axes leave the region whole (a partial rank holds a full-size
addend of its region).

>>> balanced_split(5, 2)
((0, 3), (3, 2))
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from .placement import Placement
from .sbp import Broadcast, Partial, SbpParallel, Split, StridedSplit, broadcast, normalize


@lru_cache(maxsize=4096)
def balanced_split(length: int, parts: int) -> tuple[tuple[int, int], ...]:
    """(offset, size) of each of ``parts`` parts of ``length`` elements."""
    base, extra = divmod(length, parts)
    out, offset = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((offset, size))
        offset += size
    return tuple(out)


@dataclass(frozen=True)
class Region:
    """A box of a global tensor: per dim, an offset and a size."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: "Region") -> "Region | None":
        offsets, sizes = [], []
        for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(o1, o2), min(o1 + s1, o2 + s2)
            if hi <= lo:
                return None
            offsets.append(lo)
            sizes.append(hi - lo)
        return Region(tuple(offsets), tuple(sizes))

    def slices(self, within: "Region | None" = None) -> tuple[slice, ...]:
        """Index of this region inside ``within`` (or inside the global tensor)."""
        base = within.offsets if within is not None else (0,) * len(self.offsets)
        return tuple(slice(o - b, o - b + s) for o, b, s in zip(self.offsets, base, self.sizes))


@dataclass(frozen=True, eq=False)
class Layout:
    """How one global tensor lies on its placement: global shape, placement, nd-sbp."""

    shape: tuple[int, ...]
    placement: Placement
    sbp: tuple[SbpParallel, ...]
    # set once in __post_init__: strides (row-major, of the global shape), partial_axes
    # (the placement axes whose sbp is partial), asked on every op

    # Layouts key every dispatch and plan cache: hash once, compare cheaply.
    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.shape, self.placement, self.sbp)))
        strides, acc = [], 1
        for s in reversed(self.shape):
            strides.append(acc)
            acc *= max(s, 1)
        object.__setattr__(self, "strides", tuple(reversed(strides)))
        object.__setattr__(self, "_local_shapes", {})  # rank -> local shape
        object.__setattr__(self, "partial_axes",
                           tuple(a for a, s in enumerate(self.sbp) if isinstance(s, Partial)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, Layout):
            return NotImplemented   # a gt.layout("S(0), B") spec compares itself
        return (self._hash == other._hash and self.shape == other.shape
                and self.sbp == other.sbp and self.placement == other.placement)

    def __reduce__(self):
        # Rebuilt through make (see Placement.__reduce__): interned, hashed here.
        return Layout.make, (self.shape, self.placement, self.sbp)

    @staticmethod
    def make(shape: Sequence[int], placement: Placement, sbp) -> "Layout":
        """The layout, checked and normalised; equal layouts come back as one object,
        so the hot paths can compare them with ``is``."""
        try:   # one made before: found as given (an sbp tuple already normalised)
            found = _interned.get((tuple(shape), placement,
                                   (sbp,) if isinstance(sbp, SbpParallel) else sbp))
        except TypeError:   # (a symbolic dim, a list of sbps: the checks below)
            found = None
        if found is not None:
            return found
        shape = tuple(int(s) for s in shape)
        nd_sbp = normalize(sbp, placement.ndim, len(shape))
        for s in nd_sbp:
            if isinstance(s, StridedSplit) and shape[s.dim] % s.blocks:
                raise ValueError(f"{s}: dim {s.dim} of shape {shape} does not hold "
                                 f"{s.blocks} equal blocks")
        return Layout.interned(shape, placement, nd_sbp)

    @staticmethod
    def interned(shape: tuple[int, ...], placement: Placement, nd_sbp: tuple) -> "Layout":
        """``make`` for a shape tuple and an nd-sbp that are already normalised (the
        planners' search states): no checks, the one object per layout."""
        key = (shape, placement, nd_sbp)  # not the layout: a weak dict holds keys strongly
        found = _interned.get(key)
        if found is None:
            placement.check_world()
            _interned[key] = found = Layout(shape, placement, nd_sbp)
        return found

    def with_sbp(self, sbp) -> "Layout":
        return Layout.make(self.shape, self.placement, sbp)

    def same_parts(self, other: "Layout") -> bool:
        """Whether every rank's part of this layout is its part of ``other`` as it is:
        one shape and placement, and the sbps differ only on axes of one rank, where a
        split, a partial addend and a broadcast copy all hold the whole region (every
        axis of a world of one). Boxing between them moves nothing.

        >>> Layout.make((4,), placement("cpu", [0]), split(0)).same_parts(
        ...     Layout.make((4,), placement("cpu", [0]), broadcast))  # doctest: +SKIP
        True
        """
        return self is other or (self.shape == other.shape and self.placement == other.placement
                                 and all(a == b or n == 1 for a, b, n in
                                         zip(self.sbp, other.sbp, self.placement.shape)))

    def summed_axes_to(self, other: "Layout") -> "tuple[int, ...] | None":
        """The axes where this layout is partial_sum and ``other`` broadcast, if that is
        all that differs (an all-reduce over them gives ``other``: a gradient to its
        parameter's layout); else None.

        >>> Layout.make((4,), p, (split(0), partial_sum)).summed_axes_to(
        ...     Layout.make((4,), p, (split(0), broadcast)))  # doctest: +SKIP
        (1,)
        """
        if self.placement != other.placement or self.shape != other.shape:
            return None
        axes = []
        for a, (g, l) in enumerate(zip(self.sbp, other.sbp)):
            if g == l:
                continue
            if not (isinstance(g, Partial) and g.reduce == "sum" and isinstance(l, Broadcast)):
                return None
            axes.append(a)
        return tuple(axes)

    def without_partials(self) -> "Layout":
        """This layout with every partial axis made broadcast: where the reduced value
        lives (a gradient, a saved value, a read), each rank holding its region whole.

        >>> Layout.make((4,), p, (split(0), partial_sum)).without_partials().sbp  # doctest: +SKIP
        (split(dim=0), broadcast)
        """
        if not any(isinstance(s, Partial) for s in self.sbp):
            return self
        return self.with_sbp(tuple(broadcast if isinstance(s, Partial) else s
                                   for s in self.sbp))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def strided(self) -> bool:
        """Whether an axis holds a strided split (no rank's part is one box)."""
        return any(isinstance(s, StridedSplit) for s in self.sbp)

    def region_at(self, coord: Sequence[int], axes: int | None = None) -> Region:
        """Region at a hierarchy coordinate, applying placement axes ``[0, axes)``."""
        return _region(self.shape, self.placement.shape, self.sbp, tuple(coord),
                       self.placement.ndim if axes is None else axes)

    def region(self, rank: int) -> Region | None:
        """Region that ``rank`` holds, or None when it is outside the placement. A
        strided split's part is no box: see ``refined``."""
        coord = self.placement.coord(rank)
        return None if coord is None else self.region_at(coord)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor (all zeros-size outside the placement)."""
        shape = self._local_shapes.get(rank)
        if shape is None:
            coord = self.placement.coord(rank)
            if coord is None:
                shape = (0,) * self.ndim
            elif self.strided:
                shape = _strided_local_shape(self, coord)
            else:
                shape = self.region_at(coord).sizes
            self._local_shapes[rank] = shape
        return shape

    def refined(self, blocks: dict) -> "Layout | None":
        """This layout on the shape with each dim ``d`` of ``blocks`` ({d: k}) viewed as
        ``(k, shape[d] // k)``, where every split is plain: a strided split of ``d``
        into ``k`` blocks becomes a split of the block's inner dim; a plain split of
        ``d`` whose parts are whole blocks (the only axis splitting ``d``) becomes a
        split of the block dim. None when a split of ``d`` fits neither. A rank's part here is its part of this layout,
        reshaped: boxing strided layouts runs on refined ones.

        >>> Layout.make((8, 3), p, split(0, blocks=2)).refined({0: 2}).sbp  # doctest: +SKIP
        (split(dim=1),)
        """
        shape, where = [], {}
        for d, length in enumerate(self.shape):
            where[d] = len(shape)
            k = blocks.get(d)
            shape += [length] if k is None else [k, length // k]
        sbp = []
        for axis, s in enumerate(self.sbp):
            if isinstance(s, StridedSplit):
                if blocks.get(s.dim) != s.blocks:
                    return None
                sbp.append(Split(where[s.dim] + 1))
            elif isinstance(s, Split) and s.dim in blocks:
                # nested splits of one dim cut parts, not the length: not checked here
                nested = sum(isinstance(t, Split) and t.dim == s.dim for t in self.sbp) > 1
                if nested or not _whole_blocks(self.shape[s.dim], blocks[s.dim],
                                               self.placement.shape[axis]):
                    return None
                sbp.append(Split(where[s.dim]))
            elif isinstance(s, Split):
                sbp.append(Split(where[s.dim]))
            else:
                sbp.append(s)
        try:
            return Layout.make(shape, self.placement, tuple(sbp))
        except ValueError:
            return None


def _strided_local_shape(layout: Layout, coord) -> tuple[int, ...]:
    plain = tuple(broadcast if isinstance(s, StridedSplit) else s for s in layout.sbp)
    sizes = list(_region(layout.shape, layout.placement.shape, plain, tuple(coord),
                         layout.placement.ndim).sizes)
    for axis, s in enumerate(layout.sbp):
        if isinstance(s, StridedSplit):
            inner = balanced_split(layout.shape[s.dim] // s.blocks,
                                   layout.placement.shape[axis])[coord[axis]][1]
            sizes[s.dim] = s.blocks * inner
    return tuple(sizes)


def _whole_blocks(length: int, blocks: int, parts: int) -> bool:
    """Whether a balanced split of ``length`` into ``parts`` cuts only between blocks."""
    size = length // blocks
    return all(o % size == 0 and n % size == 0 for o, n in balanced_split(length, parts))


# Equal layouts as one object while any is alive (weak: shapes seen once, e.g. every
# sequence length of a run, do not accumulate).
_interned = weakref.WeakValueDictionary()


@lru_cache(maxsize=16384)
def _region(shape, pshape, sbp, coord, axes) -> Region:
    offsets, sizes = [0] * len(shape), list(shape)
    for axis in range(axes):
        s = sbp[axis]
        if isinstance(s, Split):
            offset, size = balanced_split(sizes[s.dim], pshape[axis])[coord[axis]]
            offsets[s.dim] += offset
            sizes[s.dim] = size
        elif isinstance(s, StridedSplit):
            raise TypeError(f"{s}: a strided split's part is no box (use Layout.refined)")
        elif not isinstance(s, (Broadcast, Partial)):
            raise TypeError(f"not an sbp: {s!r}")
    return Region(tuple(offsets), tuple(sizes))
