"""A counter-based generator: random values as a function of (seed, draw, global index).

Every random op on global tensors takes the next draw number (``next_draw``, on
every rank, inside the placement or not) and each rank evaluates a hash of each of its
elements' global (row-major) index, keyed by (seed, draw). So a rank generates only the
elements it holds, a broadcast tensor gets equal values everywhere, and the value of a
tensor is the same for every placement, sbp and world size. It is JAX's design
(``threefry``), with a cheaper hash: Wellons' ``lowbias32`` on 32-bit lanes, run on
cache-sized chunks with torch's vectorised integer ops (as fast as torch's own CPU
generator, see benchmarks/memory.py). Replaying a draw (activation checkpointing) only
needs the draw number back: ``torch.get_rng_state``/``set_rng_state`` carry it along.

>>> import torch
>>> from globaltensor.layout import Region
>>> u = sample("uniform", (4, 6), Region((0, 3), (4, 3)), (0, 1), torch.float32)
>>> u.shape
torch.Size([4, 3])
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from . import comm
from .layout import Layout, Region
from .local_parts import device_of, empty_local
from .partials import identity_fill, keep_on_first

_CHUNK = 1 << 16  # elements hashed at once: the temporaries stay in the L2 cache
_MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)  # lowbias32's multipliers, as int32


def _mix64(z: int) -> int:
    """splitmix64's finaliser on a Python int: seeds and draw numbers to lane keys."""
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _keys(draw: tuple[int, int], stream: int) -> tuple[int, int, int]:
    """(odd multiplier, offset, high-index multiplier) of one 32-bit stream of a draw."""
    seed, number = draw
    k = _mix64(_mix64(_mix64(seed) ^ number) ^ stream)
    k2 = _mix64(k)
    return (k & _MASK32) | 1, k >> 32, (k2 & _MASK32) | 1


def _int32(v: int) -> int:
    v &= _MASK32
    return v - (1 << 32) if v >= 1 << 31 else v


def _tail(shape, region: Region, dims: range, steps: list, device) -> torch.Tensor:
    """The keyed index contribution of the trailing ``dims`` (at most a chunk of
    elements), flat, int32: the same for every chunk, so it is computed once."""
    tail = torch.zeros((), dtype=torch.int32, device=device)
    for d in dims:
        off, size = region.offsets[d], region.sizes[d]
        v = torch.arange(off, off + size, dtype=torch.int64, device=device)
        v = ((v * steps[d]) & _MASK32).to(torch.int32)  # wraps mod 2**32 (two's complement)
        tail = tail.unsqueeze(-1) + v
    return tail.reshape(-1)


def _column(first: int, count: int, step: int, base: int, device) -> torch.Tensor:
    """``(first + i) * step + base`` mod 2**32 for i < count, int32."""
    if first + count < 1 << 31:   # int32 arithmetic wraps mod 2**32 by itself
        col = torch.arange(first, first + count, dtype=torch.int32, device=device)
        return col.mul_(_int32(step)).add_(_int32(base))
    col = torch.arange(first, first + count, dtype=torch.int64, device=device)
    return ((col * step + base) & _MASK32).to(torch.int32)


def _hash_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place on int32 lanes (``tmp``: scratch of the same size). torch's
    right shift of int32 is arithmetic, so the mask makes it the logical shift."""
    torch.bitwise_right_shift(x, 16, out=tmp)
    x.bitwise_xor_(tmp.bitwise_and_(0xFFFF))
    x.mul_(_M1)
    torch.bitwise_right_shift(x, 15, out=tmp)
    x.bitwise_xor_(tmp.bitwise_and_(0x1FFFF))
    x.mul_(_M2)
    torch.bitwise_right_shift(x, 16, out=tmp)
    return x.bitwise_xor_(tmp.bitwise_and_(0xFFFF))


def _bits(shape, region: Region, draw, streams: int, write: Callable, out: torch.Tensor):
    """Hash every element of ``region`` of a tensor of global ``shape`` with ``streams``
    independent keys of ``draw``, chunk by chunk: ``write(hashes, out_chunk)`` turns the
    int32 hashes (one tensor per stream) into values of the flat ``out_chunk``.

    An element's hash input is ``mult * flat_index + offset`` (mod 2**32), summed per
    dim as ``index_d * (mult * stride_d)``. Chunks run along the first dim ``k`` whose
    trailing dims fit in a chunk; the dims before ``k`` add a constant per chunk."""
    if region.numel == 0:
        return out
    device = out.device
    flat_out = out.view(-1)
    big = math.prod(shape) > _MASK32  # index bits above 32 enter through a second key
    ndim = len(shape)
    strides = [math.prod(shape[d + 1:]) for d in range(ndim)]
    k = next((d for d in range(ndim) if math.prod(region.sizes[d + 1:]) <= _CHUNK), 0)
    inner = math.prod(region.sizes[k + 1:]) if ndim else 1
    rows = max(1, _CHUNK // inner)
    keyed = []
    for s in range(streams):
        mult, offset, high = _keys(draw, s)
        steps = [(mult * st) & _MASK32 for st in strides]
        # Trailing dims add their offsets even when their part is one element wide.
        tail = _tail(shape, region, range(k + 1, ndim), steps, device) if k + 1 < ndim \
            else None
        keyed.append((steps, tail, offset, high))
    lead = region.sizes[:k]
    size_k = region.sizes[k] if ndim else 1
    for lead_linear in range(math.prod(lead)):
        coord, rest = [], lead_linear
        for size in reversed(lead):
            rest, c = divmod(rest, size)
            coord.append(c)
        coord.reverse()
        for start in range(0, size_k, rows):
            stop = min(start + rows, size_k)
            hashes = []
            for steps, tail, offset, high in keyed:
                base = offset + sum((region.offsets[d] + c) * steps[d] for d, c in enumerate(coord))
                if ndim:
                    x = _column(region.offsets[k] + start, stop - start, steps[k], base, device)
                else:
                    x = torch.full((1,), _int32(base), dtype=torch.int32, device=device)
                if tail is not None:
                    x = torch.add(x.view(-1, 1), tail.view(1, -1)).view(-1)
                tmp = torch.empty_like(x)
                _hash_(x, tmp)
                if big:  # rows of 2**32 elements get their own key (not shifted copies)
                    idx = _flat_index(shape, region, coord, k, start, stop, device)
                    x.add_(((idx >> 32) * high).to(torch.int32))
                    _hash_(x, tmp)
                hashes.append(x)
            first = (lead_linear * size_k + start) * inner
            write(hashes, flat_out[first:first + (stop - start) * inner])
    return out


def _flat_index(shape, region, coord, k, start, stop, device) -> torch.Tensor:
    """Global flat indices (int64) of one chunk: only for tensors above 2**32 elements."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    base = sum((region.offsets[d] + c) * strides[d] for d, c in enumerate(coord))
    idx = torch.zeros((), dtype=torch.int64, device=device) + base
    ks = torch.arange(region.offsets[k] + start, region.offsets[k] + stop, device=device)
    idx = idx + (ks * strides[k]).view([-1] + [1] * (len(shape) - k - 1))
    for d in range(k + 1, len(shape)):
        v = torch.arange(region.offsets[d], region.offsets[d] + region.sizes[d], device=device)
        idx = idx + (v * strides[d]).view([-1] + [1] * (len(shape) - d - 1))
    return idx.reshape(-1)


# --- from hashes to values -----------------------------------------------------------

_DIGITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def mantissa_bits(dtype: torch.dtype) -> int:
    """Significant bits of a floating dtype (numeric_limits<T>::digits)."""
    return _DIGITS.get(dtype, 24)


def _unit(hashes, out, dtype, centred: bool):
    """Uniform values on ``out`` (float): [0, 1) on a grid of 2**-b, or with ``centred``
    the odd multiples of 2**-b in (-1, 1) (never 0 or +-1: fit for erfinv and log).
    float64 takes 53 bits from two streams, the other types one stream."""
    if dtype == torch.float64:
        hi = (hashes[0].to(torch.int64) & _MASK32) >> 5   # 27 bits
        lo = (hashes[1].to(torch.int64) & _MASK32) >> 6   # 26 bits
        k = hi.mul_(1 << 26).add_(lo)
        b = 53
    else:
        b = 24 if centred else min(24, mantissa_bits(dtype))  # transforms get every bit there is
        k = torch.bitwise_right_shift(hashes[0], 32 - b)  # signed: [-2**(b-1), 2**(b-1))
        k = k.add_(1 << (b - 1))
    if centred:
        out.copy_(k.mul_(2).sub_((1 << b) - 1)).mul_(2.0 ** -b)
    else:
        out.copy_(k).mul_(2.0 ** -b)
    return out


def _streams(dtype) -> int:
    return 2 if dtype == torch.float64 else 1


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # Transforms (log, erfinv) run in float32 at least; the result is cast when written.
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _float_writer(dtype, transform, centred=False):
    work = _work_dtype(dtype)

    def write(hashes, chunk):
        if work == chunk.dtype:
            transform(_unit(hashes, chunk, dtype, centred))
        else:
            chunk.copy_(transform(_unit(hashes, torch.empty(chunk.shape, dtype=work,
                                                            device=chunk.device), dtype, centred)))
    return write


def _uniform(low=0.0, high=1.0):
    return lambda u: u.mul_(high - low).add_(low) if (low, high) != (0.0, 1.0) else u


def _normal(mean=0.0, std=1.0):
    return lambda v: v.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean)


def _log_normal(mean=1.0, std=2.0):
    return lambda v: v.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).exp_()


def _exponential(lambd=1.0):
    # centred v in (-1, 1) -> 1 - u in (0, 1]: -log of it is finite
    return lambda v: v.mul_(-0.5).add_(0.5).log_().mul_(-1.0 / lambd)


def _cauchy(median=0.0, sigma=1.0):
    return lambda v: v.mul_(math.pi / 2).tan_().mul_(sigma).add_(median)


def _geometric(p):
    return lambda v: v.mul_(-0.5).add_(0.5).log_().div_(math.log1p(-p)).ceil_()


_FLOAT = {"uniform": (_uniform, False), "normal": (_normal, True),
          "log_normal": (_log_normal, True), "exponential": (_exponential, True),
          "cauchy": (_cauchy, True), "geometric": (_geometric, True)}


def _bernoulli_writer(p: float):
    # An integer compare on the top 24 bits: P(hash < t) = p on a 2**-24 grid.
    threshold = round(p * (1 << 24)) - (1 << 23)

    def write(hashes, chunk):
        k = torch.bitwise_right_shift(hashes[0], 8)
        if chunk.dtype == torch.bool:
            torch.lt(k, threshold, out=chunk)
        else:
            chunk.copy_(k < threshold)
    return write


def _integer_writer(low: int, high: int):
    # floor(u * span) with a 53-bit u: unbiased to 2**-53 per value (spans up to 2**53).
    span = high - low

    def write(hashes, chunk):
        u = _unit(hashes, torch.empty(chunk.shape, dtype=torch.float64, device=chunk.device),
                  torch.float64, False)
        chunk.copy_(u.mul_(span).floor_().clamp_(max=span - 1).add_(low))
    return write


def sample(kind: str, shape, region: Region, draw: tuple[int, int], dtype: torch.dtype,
           device="cpu", out: torch.Tensor | None = None, **params) -> torch.Tensor:
    """The elements of ``region`` (of a tensor of global ``shape``) of one draw.

    ``kind``: ``uniform`` (low, high), ``normal`` (mean, std), ``log_normal``,
    ``exponential`` (lambd), ``cauchy``, ``geometric`` (p), ``bernoulli`` (p: a float),
    ``integers`` (low, high). ``out``, when given, receives them (the region's shape).

    >>> sample("normal", (2, 2), Region((0, 0), (2, 2)), (0, 7), torch.float32).shape
    torch.Size([2, 2])
    """
    if out is None:
        out = torch.empty(region.sizes, dtype=dtype, device=device)
    if kind == "bernoulli":
        return _bits(shape, region, draw, 1, _bernoulli_writer(float(params["p"])), out)
    if kind == "integers":
        low, high = int(params["low"]), int(params["high"])
        if high <= low:
            raise ValueError(f"random integers need low < high, got [{low}, {high})")
        return _bits(shape, region, draw, 2, _integer_writer(low, high), out)
    if kind not in _FLOAT:
        raise ValueError(f"unknown distribution {kind!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"{kind} values need a floating dtype, got {dtype}")
    make, centred = _FLOAT[kind]
    write = _float_writer(dtype, make(**params), centred)
    return _bits(shape, region, draw, _streams(dtype), write, out)


def local_sample(kind: str, layout: Layout, draw: tuple[int, int], dtype: torch.dtype,
                 out: torch.Tensor | None = None, **params) -> torch.Tensor:
    """This rank's local tensor of a random tensor of ``layout``: its region's values; on
    a partial axis the first member holds them and the others the reduction's identity
    (nothing is drawn there); an empty tensor outside the placement.

    >>> from globaltensor.random import local_sample, next_draw   # doctest: +SKIP
    >>> part = local_sample("normal", layout, next_draw(), torch.float32)   # doctest: +SKIP
    """
    rank = comm.get_rank()
    region = layout.region(rank)
    if region is None:
        return empty_local(layout, dtype)
    if out is None:
        out = torch.empty(region.sizes, dtype=dtype, device=device_of(layout.placement))
    if identity_fill(layout, rank) is not None:
        return keep_on_first(out, layout, rank)
    return sample(kind, layout.shape, region, draw, dtype, out=out, **params)


# --- the generator's state: a seed and the number of draws taken since ----------------

# The seed before any gt.manual_seed (torch's default CPU seed, for want of another).
_DEFAULT_SEED = 67280421310721
_seed, _draw = _DEFAULT_SEED, 0


def manual_seed(seed: int) -> None:
    """Seed the placement-invariant generator (and torch's own), the same on every rank:
    random values on global tensors are then a function of ``seed``, the draw's number
    (counted from here) and each element's global index.

    >>> import globaltensor as gt
    >>> gt.manual_seed(0)
    """
    global _seed, _draw
    _seed, _draw = int(seed), 0
    torch.manual_seed(int(seed))


def next_draw() -> tuple[int, int]:
    """(seed, draw number) for the next random op; every rank calls it once per random
    op on a global tensor, also ranks outside the op's placement, so counters agree."""
    global _draw
    _draw += 1
    return _seed, _draw


def get_draw() -> tuple[int, int]:
    """The generator's state: (seed, number of draws so far)."""
    return _seed, _draw


def set_draw(state: tuple[int, int]) -> None:
    """Restore a state from ``get_draw`` (activation checkpointing replays draws)."""
    global _seed, _draw
    _seed, _draw = int(state[0]), int(state[1])


def carrying_draws(get_state, set_state) -> tuple:
    """``torch.get_rng_state`` and ``torch.set_rng_state`` (``get_state``, ``set_state``)
    made to carry the draw number on the state tensor and restore it: activation
    checkpointing (both of torch's implementations) and ``torch.random.fork_rng`` save
    and restore the CPU state around a replay this way, so a recomputed dropout draws
    the mask it drew in forward. Installed by ``interop/torch_patches.py``."""
    def get_rng_state() -> torch.Tensor:
        state = get_state()
        state._globaltensor_draw = get_draw()
        return state

    def set_rng_state(new_state: torch.Tensor) -> None:
        set_state(new_state)
        draw = getattr(new_state, "_globaltensor_draw", None)
        if draw is not None:
            set_draw(draw)

    get_rng_state.__doc__, set_rng_state.__doc__ = get_state.__doc__, set_state.__doc__
    return get_rng_state, set_rng_state
