"""The op battery's shared part: build GlobalTensors from full values, run an op on
them and on plain tensors, compare values, gradients and metadata; and the shared
worlds the family files (tests/ops/test_*.py) run their checks in.

A family file defines ``check_*`` functions (run inside spawned processes) and gets its
tests from ``battery_tests``. Every family runs in three worlds:

- a world of 2, placements of all ranks ([0, 1], [1, 0]);
- a world of 4: all ranks, reversed, and the 2x2 mesh (fewer combinations per case:
  four processes share two cores);
- a world of 3 whose placements leave a rank out ([0, 1], and [2, 1] without rank 0):
  the bystander run. A rank outside the placement runs the same program and holds
  nothing; there its outputs and gradients must still be GlobalTensors with the
  members' metadata, and ``.full()`` (a collective of the whole world) the right value.

The checks of every collected family file share one spawned world per size, and one
world runs at a time (a test that starts a world first lets the other finish: its
duration includes that).

Inside a check, a value, gradient or metadata mismatch is recorded and the check goes on
with its other cases, then fails listing every mismatch (all ranks take the same path,
so recording is safe); an exception ends the check at once, with the case (op, sbps,
placement, world size) in its message. A failing check ends its world; the checks after
it run in a new one, so every check reports on its own.

Set GT_OPS_KEEP_GOING=1 to also record exceptions and go on (diagnosis only: an error
on some ranks but not others can then leave the rest waiting for the collective timeout).
"""
from __future__ import annotations

import functools
import itertools
import os
import random
import zlib

import torch
import torch.distributed as dist
from mp import world_test

import globaltensor as gt

B, P = gt.sbp.broadcast, gt.sbp.partial_sum
S = gt.sbp.split
F64 = torch.float64
RTOL = ATOL = 1e-9          # float64 inputs throughout, except the float32 casts/modules
KEEP_GOING = os.environ.get("GT_OPS_KEEP_GOING") == "1"
BYSTANDER_WORLD = 3         # the world whose placements leave a rank out
_FAILURES: list = []


# --------------------------------------------------------------------------------------
# helpers (run inside the spawned processes)
# --------------------------------------------------------------------------------------

def seed_of(text: str) -> int:
    return zlib.crc32(text.encode())       # the same in every process (unlike hash())


def randn(shape, seed, dtype=F64, lo=None):
    """A fixed full value: randn, or uniform in [lo, lo + 1) when lo is given."""
    gen = torch.Generator().manual_seed(seed_of(str(seed)) if isinstance(seed, str) else seed)
    if lo is not None:
        return torch.rand(shape, generator=gen, dtype=dtype) + lo
    return torch.randn(shape, generator=gen, dtype=dtype)


def randint(high, shape, seed):
    gen = torch.Generator().manual_seed(seed_of(seed))
    return torch.randint(0, high, shape, generator=gen)


def line(reverse=False):
    """The battery's 1-D placement: every rank of the world (reverse: in reverse order);
    in the bystander world, [0, 1] (reverse: [2, 1], which leaves out rank 0)."""
    if gt.get_world_size() == BYSTANDER_WORLD:
        return gt.placement("cpu", [2, 1] if reverse else [0, 1])
    ranks = list(range(gt.get_world_size()))
    return gt.placement("cpu", ranks[::-1] if reverse else ranks)


def has_bystanders(placement) -> bool:
    """Whether some rank of the world is outside ``placement``."""
    return any(r not in placement for r in range(gt.get_world_size()))


def mesh():
    return gt.placement("cpu", [[0, 1], [2, 3]])


def nd(s, placement):
    """One sbp on every axis of the placement (a tuple)."""
    return (s,) * placement.ndim


def _coord(placement, rank):
    """The rank's index in the placement's hierarchy (from the public ``ranks``); None
    outside the placement."""
    ranks = placement.ranks
    if placement.ndim == 1:
        return (ranks.index(rank),) if rank in ranks else None
    for i, row in enumerate(ranks):
        if rank in row:
            return (i, row.index(rank))
    return None


def make_global(value, placement, sbp, requires_grad=False):
    """``gt.tensor(value, placement, sbp)``; when sbp has partial axes, the addends are
    then made non-trivial (gt.tensor may hold the value on one rank and zeros on the
    others, under which a non-linear op applied to each addend would still look right):
    add ``eps_r * R`` where R is a fixed tensor and eps_r sums to zero over every
    partial group (the sum is exact up to rounding). Returns a leaf."""
    x = gt.tensor(value, placement=placement, sbp=sbp)
    axes = as_tuple(sbp)
    if P in axes and value.is_floating_point():
        rank = gt.get_rank()
        local = x.to_local()
        coord = _coord(placement, rank)
        eps = 1.0
        for axis, s in enumerate(axes if coord is not None else ()):   # else: no part
            if s == P:
                eps *= coord[axis] - (placement.shape[axis] - 1) / 2
        # dyadic noise: integer-valued data keeps exact sums (for ==)
        gen = torch.Generator().manual_seed(seed_of(f"noise{tuple(local.shape)}"))
        noise = torch.randint(-4, 5, tuple(local.shape), generator=gen).to(value.dtype) / 2
        x = gt.from_local(local + eps * noise, placement=placement, sbp=sbp,
                          shape=tuple(value.shape))
    if requires_grad:
        x.requires_grad_(True)
    return x


def as_tuple(s):
    return s if isinstance(s, tuple) else (s,)


def placements(limit1=8, limit_rev=2, limit2=4):
    """(placement, how many sbp combinations to run on it): ``line()`` and
    ``line(reverse=True)``, and the 2x2 mesh in the world of 4. Four processes share the
    cores: the world of 4 runs an eighth of the line's combinations and no reversed line
    (each collective there waits for four processes on two cores), and the bystander
    world (whose point is that every op and its backward run on a rank outside the
    placement; the world of 2 runs the combinations) one on [0, 1] and one on [2, 1]."""
    rev = [(line(reverse=True), limit_rev)] if limit_rev else []
    if gt.get_world_size() == BYSTANDER_WORLD:
        return [(line(), min(1, limit1))] + [(p, min(1, n)) for p, n in rev]
    if gt.get_world_size() != 4:
        return [(line(), limit1)] + rev
    out = [(line(), -(-limit1 // 8))]
    if limit2:
        out.append((mesh(), -(-limit2 // 8)))
    return out


def _choices(t):
    """1-D sbps for a value ``t``: broadcast, a split per dim, and partial_sum for
    floating values (None for a non-tensor argument)."""
    if not isinstance(t, torch.Tensor):
        return [None]
    out = [B] + [S(d) for d in range(t.dim())]
    if t.is_floating_point():
        out.append(P)
    return out


def combos(placement, inputs, limit, label, choices=None, must=()):
    """sbp per input (a tuple of two on the mesh): every combination when there are at
    most ``limit``, else a fixed sample of ``limit`` plus, in the world of 2 (which runs
    the combinations; the others sample), the ``must`` ones."""
    per_input = choices or [_choices(t) for t in inputs]
    if placement.ndim == 2:
        per_input = [[None] if c == [None] else list(itertools.product(c, c))
                     for c in per_input]
    everything = list(itertools.product(*per_input))
    if len(everything) > limit:
        rng = random.Random(seed_of(f"{label}{placement}"))
        everything = rng.sample(everything, limit)
    for m in must if gt.get_world_size() == 2 else ():
        if placement.ndim == 1 and m not in everything:
            everything.append(m)
    return everything


def _fmt(sbps):
    return "(" + ", ".join("-" if s is None else str(s) for s in sbps) + ")"


def describe(label, sbps, placement):
    return (f"[world {gt.get_world_size()}] {label} sbp={_fmt(sbps)} on "
            f"ranks={placement.ranks}")


def fail(msg: str):
    _FAILURES.append(msg)


def expect(cond, msg):
    if not cond:
        fail(msg)
    return bool(cond)


def close(got, want, what, rtol=RTOL, atol=ATOL):
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    except AssertionError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        fail(f"{what}: " + " | ".join(lines[:4]))
        return False
    return True


def _leaves(out):
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


class CaseError(RuntimeError):
    pass


def checked(fn):
    """Run a check; fail at the end listing every recorded mismatch."""
    @functools.wraps(fn)
    def run():
        _FAILURES.clear()
        fn()
        if _FAILURES:
            shown = "\n".join(_FAILURES[:25])
            more = f"\n... and {len(_FAILURES) - 25} more" if len(_FAILURES) > 25 else ""
            raise AssertionError(f"{len(_FAILURES)} mismatch(es):\n{shown}{more}")
    return run


def guard(where, body):
    """Run ``body``; an exception gets the case in its message (or, keeping going, is
    recorded)."""
    try:
        return body()
    except Exception as e:
        msg = f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if KEEP_GOING:
            fail(msg)
            return None
        raise CaseError(msg) from e


def run_case(fn, inputs, sbps, placement, *, label, grad=True, nograd=(), rtol=RTOL,
             atol=ATOL):
    """``fn`` on GlobalTensors built from the full ``inputs`` (with ``sbps``) against
    ``fn`` on plain tensors: every output's metadata and ``.full()``, then the gradient
    of a fixed random weighting of the outputs for every floating input (the weights
    seed the backward as a broadcast gradient, as a weighted-sum loss would send).
    Non-tensor inputs pass through; inputs whose index is in ``nograd`` get no gradient.
    Returns (global inputs, plain inputs, global out, plain out)."""
    where = describe(label, sbps, placement)
    return guard(where, lambda: _run_case(fn, inputs, sbps, placement, where, grad,
                                          nograd, rtol, atol))


def _run_case(fn, inputs, sbps, placement, where, grad, nograd, rtol, atol):
    gins, plains = [], []
    for k, (v, s) in enumerate(zip(inputs, sbps)):
        if not isinstance(v, torch.Tensor):
            gins.append(v)
            plains.append(v)
            continue
        rg = grad and v.is_floating_point() and k not in nograd
        gins.append(make_global(v, placement, s, requires_grad=rg))
        plains.append(v.clone().requires_grad_(rg))
    out, ref = fn(*gins), fn(*plains)
    outs, refs = _leaves(out), _leaves(ref)
    if has_bystanders(placement):
        same_on_every_rank(f"{where} outputs", outs)
    expect(len(outs) == len(refs), f"{where}: {len(outs)} outputs, torch gives {len(refs)}")
    for i, (o, r) in enumerate(zip(outs, refs)):
        what = f"{where} output {i}"
        if not isinstance(r, torch.Tensor):
            expect(o == r, f"{what}: {o!r} != torch's {r!r}")
            continue
        if not expect(gt.is_global(o), f"{what}: not a GlobalTensor ({type(o).__name__})"):
            continue
        expect(o.placement == placement, f"{what}: placement {o.placement}")
        expect(tuple(o.shape) == tuple(r.shape), f"{what}: shape {tuple(o.shape)} != "
                                                  f"{tuple(r.shape)}")
        expect(o.dtype == r.dtype, f"{what}: dtype {o.dtype} != {r.dtype}")
        close(o.full(), r.detach(), f"{what} value (out sbp {o.sbp})", rtol, atol)
    if not grad:
        return gins, plains, out, ref
    pairs = [(o, r) for o, r in zip(outs, refs)
             if isinstance(r, torch.Tensor) and r.requires_grad and gt.is_global(o)]
    if not pairs:
        return gins, plains, out, ref
    # the gradient of sum_i (out_i * w_i).sum(), seeded directly: the loss's own mul,
    # sum and their backward are not under test, and on the mesh each costs a decision.
    # An output that is an input itself (x.contiguous()) would hand its seed to the leaf
    # as is: it goes through the loss, whose backward gives the leaf its own layout.
    weights = [randn(tuple(r.shape), f"weight{i}{tuple(r.shape)}", dtype=r.dtype)
               for i, (_, r) in enumerate(pairs)]
    roots, seeds = [], []
    for (o, _), w in zip(pairs, weights):
        seed = gt.tensor(w, placement=placement, sbp=nd(B, placement))
        if any(o is x for x in gins):
            roots.append((o * seed).sum())
            seeds.append(None)
        else:
            roots.append(o)
            seeds.append(seed)
    torch.autograd.backward(roots, seeds)
    torch.autograd.backward([r for _, r in pairs], weights)
    if has_bystanders(placement):
        same_on_every_rank(f"{where} gradients",
                           [x.grad for x in gins if gt.is_global(x) and x.requires_grad])
    for k, (x, v) in enumerate(zip(gins, plains)):
        if not isinstance(v, torch.Tensor) or not v.requires_grad:
            continue
        what = f"{where} grad of input {k}"
        if v.grad is None:
            expect(x.grad is None or not x.grad.full().any(), f"{what}: torch gives None")
            continue
        if not expect(x.grad is not None, f"{what}: None"):
            continue
        if not expect(gt.is_global(x.grad), f"{what}: not a GlobalTensor"):
            continue
        expect(x.grad.placement == x.placement and x.grad.sbp == x.sbp,
               f"{what}: grad layout {x.grad.sbp} on {x.grad.placement.ranks}, leaf "
               f"{x.sbp} on {x.placement.ranks}")
        close(x.grad.full(), v.grad, what, rtol, atol)
    return gins, plains, out, ref


def _metadata(t):
    if not gt.is_global(t):
        return type(t).__name__
    return (tuple(t.shape), str(t.dtype), t.placement.ranks, str(t.sbp))


def same_on_every_rank(what, tensors):
    """Every rank, inside the placement or not, sees the same metadata of ``tensors``
    (GlobalTensor, shape, dtype, placement, sbp; else the type), and ranks outside the
    placement hold nothing. A disagreement raises on every rank alike (the ranks would
    otherwise take different paths through the rest of the case)."""
    mine = [_metadata(t) for t in tensors]
    seen = [None] * gt.get_world_size()
    dist.all_gather_object(seen, mine)
    if any(m != seen[0] for m in seen):
        raise CaseError(f"{what}: the ranks disagree on metadata: "
                        + "; ".join(f"rank {r}: {m}" for r, m in enumerate(seen)))
    for t in tensors:
        if gt.is_global(t) and gt.get_rank() not in t.placement:
            expect(t.to_local().numel() == 0, f"{what}: rank {gt.get_rank()} outside the "
                                              f"placement holds {tuple(t.to_local().shape)}")


def case(label, fn, inputs, *, grad=True, nograd=(), choices=None, must=(), places=None,
         rtol=RTOL, atol=ATOL):
    """run_case over the placements and a set of sbp combinations for each. Cases with
    a single combination on the mesh run there for a fixed half of the labels (time)."""
    for placement, limit in places or placements():
        if placement.ndim == 2 and limit == 1 and seed_of(label) % 2:
            continue
        for sbps in combos(placement, inputs, limit, label, choices, must):
            run_case(fn, inputs, sbps, placement, label=label, grad=grad, nograd=nograd,
                     rtol=rtol, atol=atol)


def raises(label, fn, exc, match):
    """``fn()`` must raise ``exc`` with ``match`` (case-insensitive) in its message."""
    where = f"[world {gt.get_world_size()}] {label}"
    try:
        fn()
    except exc as e:
        expect(match.lower() in str(e).lower(), f"{where}: message lacks {match!r}: {e}")
        return
    except Exception as e:
        fail(f"{where}: raised {type(e).__name__} ({e}), expected {exc.__name__}")
        return
    fail(f"{where}: did not raise {exc.__name__}")


def battery_tests(module: str, checks: list, bystander_checks: list = ()):
    """The tests of a family file: ``checks`` (names of functions in ``module``) in the
    session's world of 2, world of 4 and the bystander world of 3; ``bystander_checks``
    (which place tensors on part of the world themselves) in the worlds of 3 and 4. Use
    as ``test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)``."""
    more = list(bystander_checks)
    return world_test(module, 2, checks), world_test(module, 4, list(checks) + more), \
        world_test(module, BYSTANDER_WORLD, list(checks) + more)
