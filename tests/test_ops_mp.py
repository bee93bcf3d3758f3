"""Ops on GlobalTensors in real worlds of 2 and 4 processes (gloo): values AND gradients
equal single-process torch on the full values, for every op family, over many input
sbp combinations (1-D placements of all ranks, and a 2x2 mesh in the world of 4).

Each ``check_*`` runs inside a spawned world (tests/mp.py). Inside a check, a value,
gradient or metadata mismatch is recorded and the check goes on with its other cases,
then fails listing every mismatch (all ranks take the same path, so recording is safe);
an exception ends the check at once, with the case (op, sbps, placement, world size)
in its message. A failing check ends its world, so ``Worlds`` below starts a new world
for the checks that did not get to run: every check reports on its own.

Set GT_OPS_KEEP_GOING=1 to also record exceptions and go on (diagnosis only: an error
on some ranks but not others can then leave the rest waiting for the collective timeout).
"""
from __future__ import annotations

import copy
import functools
import itertools
import os
import random
import zlib

import torch
import torch.nn.functional as F

import globaltensor as gt

from mp import World, checks_in_worlds

B, P = gt.sbp.broadcast, gt.sbp.partial_sum
S = gt.sbp.split
F64 = torch.float64
RTOL = ATOL = 1e-9          # float64 inputs throughout, except the float32 casts/modules
KEEP_GOING = os.environ.get("GT_OPS_KEEP_GOING") == "1"
_FAILURES: list = []


# --------------------------------------------------------------------------------------
# helpers (run inside the spawned processes)
# --------------------------------------------------------------------------------------

def _seed(text: str) -> int:
    return zlib.crc32(text.encode())       # the same in every process (unlike hash())


def _randn(shape, seed, dtype=F64, lo=None):
    """A fixed full value: randn, or uniform in [lo, lo + 1) when lo is given."""
    gen = torch.Generator().manual_seed(_seed(str(seed)) if isinstance(seed, str) else seed)
    if lo is not None:
        return torch.rand(shape, generator=gen, dtype=dtype) + lo
    return torch.randn(shape, generator=gen, dtype=dtype)


def _randint(high, shape, seed):
    gen = torch.Generator().manual_seed(_seed(seed))
    return torch.randint(0, high, shape, generator=gen)


def _line(reverse=False):
    ranks = list(range(gt.get_world_size()))
    return gt.placement("cpu", ranks[::-1] if reverse else ranks)


def _mesh():
    return gt.placement("cpu", [[0, 1], [2, 3]])


def _nd(s, placement):
    """One sbp on every axis of the placement (a tuple)."""
    return (s,) * placement.ndim


def _coord(placement, rank):
    """The rank's index in the placement's hierarchy (from the public ``ranks``)."""
    ranks = placement.ranks
    if placement.ndim == 1:
        return (ranks.index(rank),)
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
    nd = _tuple(sbp)
    if P in nd and value.is_floating_point():
        rank = gt.get_rank()
        local = x.to_local()
        coord = _coord(placement, rank)
        eps = 1.0
        for axis, s in enumerate(nd):
            if s == P:
                eps *= coord[axis] - (placement.shape[axis] - 1) / 2
        # dyadic noise: integer-valued data keeps exact sums (for ==)
        gen = torch.Generator().manual_seed(_seed(f"noise{tuple(local.shape)}"))
        noise = torch.randint(-4, 5, tuple(local.shape), generator=gen).to(value.dtype) / 2
        x = gt.from_local(local + eps * noise, placement=placement, sbp=sbp,
                          shape=tuple(value.shape))
    if requires_grad:
        x.requires_grad_(True)
    return x


def _tuple(s):
    return s if isinstance(s, tuple) else (s,)


def _placements(limit1=8, limit_rev=2, limit2=4):
    """(placement, how many sbp combinations to run on it): all ranks, all ranks in
    reverse order, and the 2x2 mesh in the world of 4. Four processes share the cores:
    the world of 4 runs fewer combinations on each."""
    if gt.get_world_size() != 4:
        return [(_line(), limit1)] + ([(_line(reverse=True), limit_rev)] if limit_rev else [])
    out = [(_line(), -(-limit1 // 2))]
    if limit_rev >= 2:
        out.append((_line(reverse=True), limit_rev - 1))
    if limit2:
        out.append((_mesh(), -(-limit2 // 4)))
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


def _combos(placement, inputs, limit, label, choices=None, must=()):
    """sbp per input (a tuple of two on the mesh): every combination when there are at
    most ``limit``, else a fixed sample of ``limit`` plus the ``must`` ones."""
    per_input = choices or [_choices(t) for t in inputs]
    if placement.ndim == 2:
        per_input = [[None] if c == [None] else list(itertools.product(c, c))
                     for c in per_input]
    everything = list(itertools.product(*per_input))
    if len(everything) > limit:
        rng = random.Random(_seed(f"{label}{placement}"))
        everything = rng.sample(everything, limit)
    for m in must:
        if placement.ndim == 1 and m not in everything:
            everything.append(m)
    return everything


def _fmt(sbps):
    return "(" + ", ".join("-" if s is None else str(s) for s in sbps) + ")"


def _where(label, sbps, placement):
    return (f"[world {gt.get_world_size()}] {label} sbp={_fmt(sbps)} on "
            f"ranks={placement.ranks}")


def _fail(msg: str):
    _FAILURES.append(msg)


def _expect(cond, msg):
    if not cond:
        _fail(msg)
    return bool(cond)


def _close(got, want, what, rtol=RTOL, atol=ATOL):
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    except AssertionError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        _fail(f"{what}: " + " | ".join(lines[:4]))
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


def _guard(where, body):
    """Run ``body``; an exception gets the case in its message (or, keeping going, is
    recorded)."""
    try:
        return body()
    except Exception as e:
        msg = f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if KEEP_GOING:
            _fail(msg)
            return None
        raise CaseError(msg) from e


def run_case(fn, inputs, sbps, placement, *, label, grad=True, nograd=(), rtol=RTOL,
             atol=ATOL):
    """``fn`` on GlobalTensors built from the full ``inputs`` (with ``sbps``) against
    ``fn`` on plain tensors: every output's metadata and ``.full()``, then the gradient
    of a fixed random weighting of the outputs for every floating input. Non-tensor
    inputs pass through; inputs whose index is in ``nograd`` get no gradient.
    Returns (global inputs, plain inputs, global out, plain out)."""
    where = _where(label, sbps, placement)
    return _guard(where, lambda: _run_case(fn, inputs, sbps, placement, where, grad,
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
    _expect(len(outs) == len(refs), f"{where}: {len(outs)} outputs, torch gives {len(refs)}")
    for i, (o, r) in enumerate(zip(outs, refs)):
        what = f"{where} output {i}"
        if not isinstance(r, torch.Tensor):
            _expect(o == r, f"{what}: {o!r} != torch's {r!r}")
            continue
        if not _expect(gt.is_global(o), f"{what}: not a GlobalTensor ({type(o).__name__})"):
            continue
        _expect(o.placement == placement, f"{what}: placement {o.placement}")
        _expect(tuple(o.shape) == tuple(r.shape), f"{what}: shape {tuple(o.shape)} != "
                                                  f"{tuple(r.shape)}")
        _expect(o.dtype == r.dtype, f"{what}: dtype {o.dtype} != {r.dtype}")
        _close(o.full(), r.detach(), f"{what} value (out sbp {o.sbp})", rtol, atol)
    if not grad:
        return gins, plains, out, ref
    pairs = [(o, r) for o, r in zip(outs, refs)
             if isinstance(r, torch.Tensor) and r.requires_grad and gt.is_global(o)]
    if not pairs:
        return gins, plains, out, ref
    loss_g = loss_p = 0
    for i, (o, r) in enumerate(pairs):
        w = _randn(tuple(r.shape), f"weight{i}{tuple(r.shape)}", dtype=r.dtype)
        wg = gt.tensor(w, placement=placement, sbp=_nd(B, placement))
        loss_g = loss_g + (o * wg).sum()
        loss_p = loss_p + (r * w).sum()
    loss_g.backward()
    loss_p.backward()
    for k, (x, v) in enumerate(zip(gins, plains)):
        if not isinstance(v, torch.Tensor) or not v.requires_grad:
            continue
        what = f"{where} grad of input {k}"
        if v.grad is None:
            _expect(x.grad is None or not x.grad.full().any(), f"{what}: torch gives None")
            continue
        if not _expect(x.grad is not None, f"{what}: None"):
            continue
        if not _expect(gt.is_global(x.grad), f"{what}: not a GlobalTensor"):
            continue
        _expect(x.grad.placement == x.placement and x.grad.sbp == x.sbp,
                f"{what}: grad layout {x.grad.sbp} on {x.grad.placement.ranks}, leaf "
                f"{x.sbp} on {x.placement.ranks}")
        _close(x.grad.full(), v.grad, what, rtol, atol)
    return gins, plains, out, ref


def case(label, fn, inputs, *, grad=True, nograd=(), choices=None, must=(), places=None,
         rtol=RTOL, atol=ATOL):
    """run_case over the placements and a set of sbp combinations for each. Cases with
    a single combination on the mesh run there for a fixed half of the labels (time)."""
    for placement, limit in places or _placements():
        if placement.ndim == 2 and limit == 1 and _seed(label) % 2:
            continue
        for sbps in _combos(placement, inputs, limit, label, choices, must):
            run_case(fn, inputs, sbps, placement, label=label, grad=grad, nograd=nograd,
                     rtol=rtol, atol=atol)


def _raises(label, fn, exc, match):
    """``fn()`` must raise ``exc`` with ``match`` (case-insensitive) in its message."""
    where = f"[world {gt.get_world_size()}] {label}"
    try:
        fn()
    except exc as e:
        _expect(match.lower() in str(e).lower(), f"{where}: message lacks {match!r}: {e}")
        return
    except Exception as e:
        _fail(f"{where}: raised {type(e).__name__} ({e}), expected {exc.__name__}")
        return
    _fail(f"{where}: did not raise {exc.__name__}")


# --------------------------------------------------------------------------------------
# 1. pointwise
# --------------------------------------------------------------------------------------

@checked
def check_pointwise():
    a, d = _randn((5, 3), "pa"), _randn((5, 3), "pd")
    row, col = _randn((3,), "prow"), _randn((5, 1), "pcol")
    pos, pos_row = _randn((5, 3), "ppos", lo=0.5), _randn((3,), "pposrow", lo=0.5)
    binary = {"add": torch.add, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
              "div": lambda x, y: x / y}
    pairs = ((a, d, "(5,3)x(5,3)"), (a, row, "(5,3)x(3,)"), (col, a, "(5,1)x(5,3)"),
             (row, col, "(3,)x(5,1)"))
    for name, op in binary.items():
        for lhs, rhs, tag in pairs if name in ("add", "mul") else pairs[1:3]:
            if name == "div":
                rhs = {(5, 3): pos, (3,): pos_row}.get(tuple(rhs.shape), rhs.abs() + 0.5)
            case(f"{name} {tag}", op, [lhs, rhs], places=_placements(6, 1, 3))
    scalar_ops = {
        "x+2": lambda x: x + 2, "2-x": lambda x: 2 - x, "x*3.5": lambda x: x * 3.5,
        "x/4": lambda x: x / 4, "x*plain0d": lambda x: x * torch.tensor(3.0, dtype=F64),
        "plain(1,)+x": lambda x: torch.tensor([0.5], dtype=F64) + x,
        "x-plain0d_f32": lambda x: x - torch.tensor(1.5),
        "add alpha": lambda x: torch.add(x, x, alpha=2.0),
    }
    for name, op in scalar_ops.items():
        case(name, op, [a], places=_placements(4, 1, 3))
    case("1/x", lambda x: 1 / x, [pos], places=_placements(4, 1, 3))
    unary = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
             "exp": torch.exp, "neg": torch.neg, "-x": lambda x: -x, "abs": torch.abs,
             "pow(2)": lambda x: x.pow(2), "x**2": lambda x: x ** 2,
             "where(x>0,x,0)": lambda x: torch.where(x > 0, x, 0.0)}
    for name, op in unary.items():
        case(name, op, [a], places=_placements(4, 1, 3))
    case("where(x>y,x,y)", lambda x, y: torch.where(x > y, x, y), [a, row],
         places=_placements(6, 1, 3))

    def inplace(x, y):
        z = x * 1.5
        z.add_(y)
        z.mul_(2)
        return z

    def inplace_alpha(x, y):
        z = x.clone()
        z.add_(y, alpha=-0.5)
        return z.mul_(2)

    case("inplace add_/mul_ (5,3)+(5,3)", inplace, [a, d], places=_placements(8, 1, 4))
    case("inplace add_/mul_ (5,3)+(3,)", inplace, [a, row], places=_placements(6, 1, 3))
    case("inplace add_(alpha) on clone", inplace_alpha, [a, d], places=_placements(6, 0, 3))
    ia = torch.randint(0, 3, (5, 3), generator=torch.Generator().manual_seed(1)).to(F64)
    ib = torch.randint(0, 3, (5, 3), generator=torch.Generator().manual_seed(2)).to(F64)
    ir = torch.tensor([0.0, 1.0, 2.0], dtype=F64)
    for name, op, ins in (("eq", torch.eq, [ia, ib]), ("gt", torch.gt, [ia, ib]),
                          ("x==row", lambda x, y: x == y, [ia, ir]),
                          ("x>1", lambda x: x > 1, [ia])):
        case(name, op, ins, grad=False, places=_placements(6, 1, 3))


# --------------------------------------------------------------------------------------
# 2. matmul family
# --------------------------------------------------------------------------------------

MM_MUST = [(S(0), B), (B, S(1)), (S(1), S(0)), (P, B), (B, B)]
MM_OUT = {(S(0), B): S(0), (B, S(1)): S(1), (S(1), S(0)): P, (P, B): P, (B, P): P, (B, B): B}


@checked
def check_matmul():
    x, w = _randn((5, 4), "mx"), _randn((4, 3), "mw")
    case("x @ w (5,4)@(4,3)", lambda x, w: x @ w, [x, w], must=MM_MUST,
         places=_placements(16, 3, 8))
    case("torch.matmul 2-D", torch.matmul, [x, w], must=MM_MUST, places=_placements(6, 0, 3))
    case("torch.mm", torch.mm, [x, w], places=_placements(4, 0, 2))
    x3 = _randn((2, 5, 4), "mx3")
    case("matmul (2,5,4)@(4,3)", torch.matmul, [x3, w], places=_placements(10, 2, 6))
    a, b = _randn((3, 5, 4), "ba"), _randn((3, 4, 2), "bb")
    case("bmm (3,5,4)x(3,4,2)", torch.bmm, [a, b], places=_placements(10, 2, 6))
    case("matmul (3,5,4)@(3,4,2)", torch.matmul, [a, b], places=_placements(4, 0, 2))
    lw, lb = _randn((3, 4), "lw"), _randn((3,), "lb")
    case("F.linear bias", F.linear, [x, lw, lb], places=_placements(12, 2, 6),
         must=[(S(0), B, B), (B, S(0), S(0)), (S(1), S(1), B), (B, B, B)])
    case("F.linear no bias", F.linear, [x, lw], places=_placements(8, 1, 4))
    case("F.linear 3-D", F.linear, [x3, lw, lb], places=_placements(8, 0, 4))
    case("addmm bias (3,)", torch.addmm, [lb, x, w], places=_placements(10, 1, 5))
    full_bias = _randn((5, 3), "fb")
    case("addmm bias (5,3) beta/alpha",
         lambda c, x, w: torch.addmm(c, x, w, beta=0.5, alpha=2.0), [full_bias, x, w],
         places=_placements(10, 1, 5))
    bb = _randn((3, 5, 2), "bbias")
    case("baddbmm", torch.baddbmm, [bb, a, b], places=_placements(10, 1, 5))
    case("baddbmm bias (5,2) beta/alpha",
         lambda c, x, y: torch.baddbmm(c, x, y, beta=2.0, alpha=0.5),
         [_randn((5, 2), "bb2"), a, b], places=_placements(6, 0, 3))
    case("matmul (5,4)@(4,)", torch.matmul, [x, _randn((4,), "mv")],
         places=_placements(6, 0, 3))
    # the output sbp before any boxing (DESIGN: matmul signatures, 1-D)
    p = _line()
    for (sx, sw), so in MM_OUT.items():
        where = _where("sbp of x @ w", (sx, sw), p)
        out = _guard(where, lambda: (gt.tensor(x, placement=p, sbp=sx)
                                     @ gt.tensor(w, placement=p, sbp=sw)))
        if out is not None:
            _expect(out.sbp == (so,), f"{where}: sbp {out.sbp}, expected {(so,)}")


# --------------------------------------------------------------------------------------
# 3. reductions
# --------------------------------------------------------------------------------------

@checked
def check_reductions():
    x = _randn((5, 3), "rx")
    small = _randn((3, 2), "rsmall")      # both dims smaller than 4 ranks
    ops = {
        "sum()": lambda x: x.sum(), "sum(0)": lambda x: x.sum(0), "sum(1)": lambda x: x.sum(1),
        "sum(1,keepdim)": lambda x: x.sum(1, keepdim=True),
        "sum((0,1))": lambda x: torch.sum(x, (0, 1)),
        "mean()": lambda x: x.mean(), "mean(0)": lambda x: x.mean(0),
        "mean(1,keepdim)": lambda x: x.mean(-1, keepdim=True),
        "amax(0)": lambda x: x.amax(0), "amin(1)": lambda x: x.amin(1),
        "amax()": lambda x: torch.amax(x), "max()": lambda x: x.max(),
        "max(dim=0)": lambda x: tuple(x.max(dim=0)), "min(dim=1)": lambda x: tuple(x.min(1)),
        "max(dim=1,keepdim)": lambda x: tuple(torch.max(x, 1, keepdim=True)),
        "var()": lambda x: x.var(), "var(0)": lambda x: x.var(0),
        "var(1,unbiased=False)": lambda x: x.var(1, unbiased=False),
        "std(0)": lambda x: x.std(0), "std(unbiased=False)": lambda x: x.std(unbiased=False),
        "std(1,keepdim)": lambda x: x.std(1, keepdim=True),
        "vector_norm": torch.linalg.vector_norm,
        "vector_norm(dim=1)": lambda x: torch.linalg.vector_norm(x, dim=1),
        "vector_norm(ord=1,dim=0)": lambda x: torch.linalg.vector_norm(x, ord=1, dim=0),
        "x.norm()": lambda x: x.norm(), "x.norm(dim=0)": lambda x: x.norm(dim=0),
    }
    for name, op in ops.items():
        case(name, op, [x], places=_placements(4, 1, 3))
    for name in ("sum(0)", "mean()", "amax(0)", "max(dim=1,keepdim)", "var(0)",
                 "vector_norm(dim=1)"):
        case(f"{name} on (3,2)", ops[name], [small], places=_placements(4, 0, 3))
    x3 = _randn((2, 5, 3), "rx3")
    case("sum(1) 3-D", lambda x: x.sum(1), [x3], places=_placements(5, 0, 3))
    case("mean((0,2)) 3-D", lambda x: x.mean((0, 2)), [x3], places=_placements(5, 0, 3))
    # DESIGN: reducing a split dim gives a partial
    p = _line()
    for label, op in (("x.sum(0)", lambda t: t.sum(0)), ("x.sum()", lambda t: t.sum())):
        where = _where(f"sbp of {label}", (S(0),), p)
        out = _guard(where, lambda: op(gt.tensor(x, placement=p, sbp=S(0))))
        if out is not None:
            _expect(out.sbp == (P,), f"{where}: sbp {out.sbp}, expected {(P,)}")


# --------------------------------------------------------------------------------------
# 4. views and shape ops
# --------------------------------------------------------------------------------------

@checked
def check_views():
    x = _randn((5, 4), "vx")
    x3 = _randn((2, 3, 4), "vx3")
    unary = [
        ("view(4,5)", lambda x: x.view(4, 5), x),
        ("reshape(2,10) (5,4)", lambda x: x.reshape(2, 10), x),
        ("reshape(-1)", lambda x: x.reshape(-1), x),
        ("reshape(5,2,2) split dim", lambda x: x.reshape(5, 2, 2), x),
        ("view(6,4) merge dims", lambda x: x.view(6, 4), x3),
        ("reshape(2,12) merge dims", lambda x: x.reshape(2, 12), x3),
        ("view(2,3,2,2) split last", lambda x: x.view(2, 3, 2, 2), x3),
        ("flatten()", lambda x: x.flatten(), x3),
        ("flatten(1)", lambda x: torch.flatten(x, 1), x3),
        ("transpose(0,1)", lambda x: x.transpose(0, 1), x),
        ("transpose(1,2) 3-D", lambda x: torch.transpose(x, 1, 2), x3),
        ("permute(2,0,1)", lambda x: x.permute(2, 0, 1), x3),
        ("t()", lambda x: x.t(), x),
        ("t().reshape(-1)", lambda x: x.t().reshape(-1), x),
        ("unsqueeze(0)", lambda x: x.unsqueeze(0), x),
        ("unsqueeze(-1)", lambda x: x.unsqueeze(-1), x),
        ("squeeze(1)", lambda x: x.squeeze(1), _randn((5, 1, 3), "vsq")),
        ("squeeze()", lambda x: x.squeeze(), _randn((1, 5, 1), "vsq2")),
        ("expand(5,4)", lambda x: x.expand(5, 4), _randn((5, 1), "vex")),
        ("expand(3,5,4)", lambda x: x.expand(3, -1, -1), x),
        ("x[1:4]", lambda x: x[1:4], x),
        ("x[:, 0]", lambda x: x[:, 0], x),
        ("x[:, 1:3]", lambda x: x[:, 1:3], x),
        ("x[::2]", lambda x: x[::2], x),
        ("x[-1]", lambda x: x[-1], x),
        ("select(1,2)", lambda x: x.select(1, 2), x),
        ("narrow(0,1,3)", lambda x: x.narrow(0, 1, 3), x),
        ("split(2) tuple", lambda x: x.split(2), x),
        ("split(3,dim=1)", lambda x: torch.split(x, 3, dim=1), x),
        ("chunk(2,dim=1)", lambda x: x.chunk(2, dim=1), x),
        ("unbind(0) 3-D", lambda x: x.unbind(0), x3),
        ("t().contiguous()", lambda x: x.t().contiguous(), x),
        ("contiguous()", lambda x: x.contiguous(), x),
    ]
    for name, op, v in unary:
        case(name, op, [v], places=_placements(4, 1, 3))
    y = _randn((3, 4), "vy")
    z = _randn((5, 4), "vz")
    case("cat dim 0 (5,4)+(3,4)", lambda a, b: torch.cat([a, b]), [x, y],
         places=_placements(8, 1, 4))
    case("cat dim 1 (5,4)+(5,4)", lambda a, b: torch.cat([a, b], dim=1), [x, z],
         places=_placements(8, 0, 4))
    case("stack dim 0", lambda a, b: torch.stack([a, b]), [x, z], places=_placements(8, 1, 4))
    case("stack dim 2", lambda a, b: torch.stack((a, b), dim=2), [x, z],
         places=_placements(6, 0, 3))
    case("view then add", lambda a, b: a.view(4, 5) + b.reshape(4, 5), [x, z],
         places=_placements(6, 0, 3))


@checked
def check_along_dim_and_attention():
    x3 = _randn((2, 5, 4), "ad3")
    unary = [
        ("cumsum(1)", lambda x: x.cumsum(1)),
        ("logcumsumexp(2)", lambda x: x.logcumsumexp(2)),
        ("sort(1).values", lambda x: x.sort(1).values),
        ("argsort(2) as float", lambda x: x.argsort(2).to(x.dtype)),
        ("topk(2, dim=2).values", lambda x: x.topk(2, dim=2).values),
        ("kthvalue(2, 1).values", lambda x: x.kthvalue(2, 1).values),
        ("kthvalue keepdim", lambda x: x.kthvalue(3, 2, keepdim=True).values),
        ("flip(1, 2)", lambda x: x.flip(1, 2)),
        ("roll(2, 1)", lambda x: x.roll(2, 1)),
        ("roll(3) flattened", lambda x: x.roll(3)),
        ("tril()", lambda x: torch.tril(x)),
        ("triu(1)", lambda x: torch.triu(x, 1)),
        ("tril(-2)", lambda x: x.tril(-2)),
        ("gather(2, argsort)", lambda x: x.gather(2, x.argsort(2)[..., :3])),
        ("x[:, 1:4] backward", lambda x: x[:, 1:4] * 2),
        ("x[:, 2] backward", lambda x: x[:, 2] * 2),
        ("median(1).values", lambda x: x.median(1).values),
        ("F.pad last dim", lambda x: F.pad(x, (1, 2))),
        ("F.pad dims 1, 2 value 1", lambda x: F.pad(x, (1, 0, 0, 2), value=1.0)),
        # a gradient that arrives split (the weighted loss alone would send a broadcast one)
        ("x[:, 1:4] ** 2 backward", lambda x: x[:, 1:4] ** 2),
        ("x[:, 2] ** 2 backward", lambda x: x[:, 2] ** 2),
        # backward formulas that build plain helper tensors (zeros, indices)
        ("cummax(1).values", lambda x: x.cummax(1).values),
        ("cumprod(2)", lambda x: x.cumprod(2)),
        ("trace of x[0]", lambda x: x[0].trace()),
    ]
    for name, op in unary:
        case(name, op, [x3], places=_placements(4, 1, 3))
    index = _randint(5, (2, 3, 4), "adidx")

    def index_like(a):
        return gt.tensor(index, placement=a.placement, sbp=_nd(B, a.placement)) \
            if gt.is_global(a) else index

    case("scatter_add(1)", lambda a, b: a.scatter_add(1, index_like(a), b),
         [_randn((2, 5, 4), "adsa"), _randn((2, 3, 4), "adsb")], places=_placements(4, 0, 2))

    q, k, v = (_randn((2, 2, 5, 4), f"attn{c}", dtype=torch.float32) for c in "qkv")
    attention = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa
    same = [(s, s, s) for s in (B, S(0), S(1), S(2))]
    case("scaled_dot_product_attention", attention, [q, k, v], choices=None, must=same,
         places=_placements(3, 0, 2), rtol=1e-5, atol=1e-6)
    # batch- and head-split attention runs where the parts are, forward and backward
    p = _line()
    for d in (0, 1):
        qs, ks, vs = (gt.tensor(t, placement=p, sbp=S(d), requires_grad=True) for t in (q, k, v))
        with gt.debug.comm_stats() as stats:
            out = attention(qs, ks, vs)
            out.backward(gt.ones(out.shape, placement=p, sbp=S(d)))
        _expect(stats.total_bytes == 0 and out.sbp == (S(d),),
                f"attention split({d}): moved {stats} and gave {out.sbp}")
    # with dropout, torch takes its math path; our dropout draws the same mask whatever
    # the layout (torch's own generators differ between ranks here on purpose)
    torch.manual_seed(gt.get_rank())
    outs = []
    for sbp in (B, S(0), S(1)):
        gt.manual_seed(5)
        qs, ks, vs = (gt.tensor(t, placement=p, sbp=sbp) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, dropout_p=0.5).full())
    _expect(all(torch.equal(outs[0], o) for o in outs[1:]),
            "attention with dropout: the value depends on the layout")


# --------------------------------------------------------------------------------------
# 5. softmax and losses
# --------------------------------------------------------------------------------------

@checked
def check_softmax_and_losses():
    x = _randn((5, 4), "sx")
    x3 = _randn((2, 3, 4), "sx3")
    for v in (x, x3):
        for d in range(v.dim()):
            case(f"softmax dim {d} of {tuple(v.shape)}", lambda t, d=d: F.softmax(t, dim=d),
                 [v], places=_placements(5, 0, 3))
            case(f"log_softmax dim {d} of {tuple(v.shape)}",
                 lambda t, d=d: F.log_softmax(t, dim=d), [v], places=_placements(5, 0, 3))
    case("x.softmax(-1)", lambda t: t.softmax(-1), [x], places=_placements(4, 1, 0))
    logits, target = _randn((5, 7), "logits"), _randint(7, (5,), "target")
    ce_choices = [[B, S(0), S(1), P], [B, S(0)]]
    for red in ("mean", "sum", "none"):
        case(f"cross_entropy {red}",
             lambda z, t, red=red: F.cross_entropy(z, t, reduction=red), [logits, target],
             choices=ce_choices, must=[(S(1), B), (S(0), S(0)), (S(1), S(0))],
             places=_placements(6, 1, 4))
    ignored = target.clone()
    ignored[2] = -100
    case("cross_entropy ignore_index", lambda z, t: F.cross_entropy(z, t), [logits, ignored],
         choices=ce_choices, must=[(S(1), B)], places=_placements(4, 0, 2))
    case("cross_entropy label_smoothing",
         lambda z, t: F.cross_entropy(z, t, label_smoothing=0.1), [logits, target],
         choices=ce_choices, must=[(S(1), B)], places=_placements(4, 0, 2))
    logits3, target3 = _randn((2, 7, 3), "logits3"), _randint(7, (2, 3), "target3")
    case("cross_entropy (N,C,d)", F.cross_entropy, [logits3, target3],
         choices=[[B, S(0), S(1), S(2)], [B, S(0), S(1)]], places=_placements(5, 0, 3))
    for red in ("mean", "sum"):
        case(f"nll_loss {red}",
             lambda z, t, red=red: F.nll_loss(F.log_softmax(z, dim=1), t, reduction=red),
             [logits, target], choices=ce_choices, places=_placements(6, 0, 3))
    y = _randn((5, 4), "sy")
    for red in ("mean", "sum"):
        case(f"mse_loss {red}", lambda a, b, red=red: F.mse_loss(a, b, reduction=red), [x, y],
             places=_placements(6, 1, 3))
    others = {"smooth_l1_loss": lambda a, b, red: F.smooth_l1_loss(a, b, reduction=red, beta=0.5),
              "huber_loss": lambda a, b, red: F.huber_loss(a, b, reduction=red, delta=0.7),
              "soft_margin_loss": lambda a, b, red: F.soft_margin_loss(a, b.sign(), reduction=red)}
    for name, loss in others.items():
        for red in ("mean", "sum", "none"):
            case(f"{name} {red}", lambda a, b, loss=loss, red=red: loss(a, b, red), [x, y],
                 nograd=(1,) if name == "soft_margin_loss" else (), places=_placements(3, 0, 2))


# --------------------------------------------------------------------------------------
# 6. normalisation, convolution, pooling
# --------------------------------------------------------------------------------------

@checked
def check_norm_conv_pool():
    x, w, b = _randn((5, 6), "lnx"), _randn((6,), "lnw"), _randn((6,), "lnb")
    case("layer_norm (5,6) w,b", lambda x, w, b: F.layer_norm(x, (6,), w, b), [x, w, b],
         places=_placements(8, 1, 4), must=[(S(0), B, B), (S(1), S(0), S(0))])
    x3 = _randn((2, 3, 6), "lnx3")
    case("layer_norm (2,3,6) no affine", lambda x: F.layer_norm(x, (6,)), [x3],
         places=_placements(5, 0, 3))
    case("layer_norm over (3,6)", lambda x: F.layer_norm(x, (3, 6), eps=1e-3), [x3],
         places=_placements(4, 0, 2))
    gx, gw, gb = _randn((5, 4, 3), "gnx"), _randn((4,), "gnw"), _randn((4,), "gnb")
    case("group_norm 2 groups w,b", lambda x, w, b: F.group_norm(x, 2, w, b), [gx, gw, gb],
         places=_placements(5, 0, 3), must=[(S(0), B, B)])
    # batch norm, training mode, batch split; running stats as GlobalTensors
    bx = _randn((5, 3, 4), "bnx")
    bw, bb = _randn((3,), "bnw", lo=0.5), _randn((3,), "bnb")
    rm, rv = _randn((3,), "bnrm"), _randn((3,), "bnrv", lo=0.5)

    def bn(x, w, b, rm, rv):
        return F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1)

    for placement, limit in _placements(6, 1, 3):
        choices = [[B, S(0), S(2)], [B], [B], [B, S(0)], [B, S(0)]]
        combos = _combos(placement, [bx, bw, bb, rm, rv], limit, "batch_norm", choices,
                         must=[(S(0), B, B, B, B)])
        for sbps in combos:
            got = run_case(bn, [bx, bw, bb, rm, rv], sbps, placement, label="batch_norm",
                           nograd=(3, 4))
            if got is None:
                continue
            gins, plains = got[0], got[1]
            where = _where("batch_norm running stats", sbps, placement)
            for k, name in ((3, "running_mean"), (4, "running_var")):
                _expect(gins[k].sbp == _tuple(sbps[k]),
                        f"{where}: {name} sbp changed to {gins[k].sbp}")
                _close(gins[k].full(), plains[k], f"{where} {name}")
    case("batch_norm 2-D input no stats",
         lambda x: F.batch_norm(x, None, None, training=True), [_randn((6, 3), "bn2")],
         choices=[[B, S(0), S(1)]], places=_placements(3, 0, 3))
    img = _randn((5, 3, 6, 6), "img")
    cw, cb = _randn((4, 3, 3, 3), "cw"), _randn((4,), "cb")
    case("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1), [img, cw, cb],
         choices=[[B, S(0), P], [B, S(0)], [B, S(0)]], must=[(S(0), B, B)],
         places=_placements(5, 0, 3))
    small = _randn((2, 3, 6, 6), "img2")
    case("conv2d stride 2 no bias", lambda x, w: F.conv2d(x, w, stride=2), [small, cw],
         choices=[[B, S(0)], [B]], places=_placements(2, 0, 2))
    for name, op in (("max_pool2d(2)", lambda x: F.max_pool2d(x, 2)),
                     ("max_pool2d(3,2,1)", lambda x: F.max_pool2d(x, 3, stride=2, padding=1)),
                     ("avg_pool2d(2)", lambda x: F.avg_pool2d(x, 2))):
        case(name, op, [img], choices=[[B, S(0), S(1), P]], places=_placements(4, 0, 3))
    case("max_pool2d batch 2", lambda x: F.max_pool2d(x, 2), [small],
         choices=[[B, S(0)]], places=_placements(2, 0, 2))


# --------------------------------------------------------------------------------------
# 7. embedding
# --------------------------------------------------------------------------------------

@checked
def check_embedding():
    weight = _randn((7, 4), "ew")
    idx = _randint(7, (2, 3), "eidx")
    idx[0, 0] = idx[1, 2] = 3   # a repeated index accumulates its gradient
    case("embedding", F.embedding, [idx, weight], choices=[[B, S(0), S(1)], [B, S(0), S(1), P]],
         must=[(B, S(0)), (S(0), S(0)), (S(1), S(0)), (S(0), B)], places=_placements(12, 1, 6))
    idx0 = idx.clone()
    idx0[1, 0] = 0
    case("embedding padding_idx=0", lambda i, w: F.embedding(i, w, padding_idx=0),
         [idx0, weight], choices=[[B, S(0)], [B, S(0)]], places=_placements(4, 0, 3))
    case("embedding then sum", lambda i, w: F.embedding(i, w).sum(1), [idx, weight],
         choices=[[B, S(0)], [B, S(0)]], places=_placements(4, 0, 2))


# --------------------------------------------------------------------------------------
# 8. dropout and random ops
# --------------------------------------------------------------------------------------

def _allequal_locals(t, where):
    """A broadcast result: every rank holds the same values (and they are the full)."""
    import torch.distributed as dist
    if not _expect(t.sbp == _nd(B, t.placement), f"{where}: sbp {t.sbp}, not broadcast"):
        return
    _close(t.to_local(), t.full(), f"{where}: local vs full")
    parts = [None] * gt.get_world_size()
    dist.all_gather_object(parts, t.to_local())
    _expect(all(torch.equal(parts[0], q) for q in parts[1:]),
            f"{where}: the ranks hold different values")


def _dropout_mask_ok(full, scale, where, lo=0.3, hi=0.7):
    zeros = (full == 0).double().mean().item()
    _expect(lo <= zeros <= hi, f"{where}: {zeros:.2f} of the elements are zero")
    kept = full[full != 0]
    _expect(torch.allclose(kept, torch.full_like(kept, scale)),
            f"{where}: kept elements are not scaled by {scale}: {kept.unique()[:5]}")


@checked
def check_dropout_and_random():
    places = [_line()] + ([_mesh()] if gt.get_world_size() == 4 else [])
    ones = torch.ones(20, 10, dtype=F64)
    for p in places:
        where = f"[world {gt.get_world_size()}] dropout(p=0.5) broadcast on {p.ranks}"

        def broadcast_case():
            x = gt.tensor(ones, placement=p, sbp=_nd(B, p), requires_grad=True)
            gt.manual_seed(11)
            y = F.dropout(x, 0.5, training=True)
            _expect(y.placement == p and tuple(y.shape) == (20, 10), f"{where}: metadata")
            full = y.full()
            _allequal_locals(y, where)
            _dropout_mask_ok(full, 2.0, where)
            g = _randn((20, 10), "dropg")
            (y * gt.tensor(g, placement=p, sbp=_nd(B, p))).sum().backward()
            _expect(x.grad.sbp == x.sbp, f"{where}: grad sbp {x.grad.sbp}")
            _close(x.grad.full(), (full != 0).double() * 2.0 * g, f"{where} grad")
            gt.manual_seed(11)
            again = F.dropout(x, 0.5, training=True).full()
            _close(again, full, f"{where}: gt.manual_seed(11) again")
            gt.manual_seed(12)
            other = F.dropout(x, 0.5, training=True).full()
            _expect(not torch.equal(other, full), f"{where}: another seed, the same mask")
            _close(F.dropout(x, 0.5, training=False).full(), ones, f"{where} training=False")
            _close(F.dropout(x, 0.0, training=True).full(), ones, f"{where} p=0")

        _guard(where, broadcast_case)
        for sbp in ((S(0),) * p.ndim, (S(1),) + (S(0),) * (p.ndim - 1)):
            where_s = f"[world {gt.get_world_size()}] dropout(p=0.25) sbp {sbp} on {p.ranks}"

            def split_case():
                x = gt.tensor(torch.ones(40, 6, dtype=F64), placement=p, sbp=sbp)
                gt.manual_seed(3)
                y = F.dropout(x, 0.25, training=True)
                _expect(y.placement == p and tuple(y.shape) == (40, 6), f"{where_s}: metadata")
                full = y.full()
                _dropout_mask_ok(full, 1 / 0.75, where_s, 0.1, 0.4)
                # independent masks per part: the ranks' parts are not all the same
                parts = [full]
                for axis, s in enumerate(sbp):
                    parts = [q for t in parts for q in t.tensor_split(p.shape[axis], s.dim)]
                common = [min(t.shape[d] for t in parts) for d in range(2)]
                parts = [t[:common[0], :common[1]] for t in parts]
                _expect(any(not torch.equal(parts[0], q) for q in parts[1:]),
                        f"{where_s}: every part has the same mask")
                gt.manual_seed(3)
                _close(F.dropout(x, 0.25, training=True).full(), full,
                       f"{where_s}: gt.manual_seed(3) again")

            _guard(where_s, split_case)
        where_r = f"[world {gt.get_world_size()}] rand_like on {p.ranks}"

        def rand_like_case():
            x = gt.tensor(ones, placement=p, sbp=_nd(B, p))
            gt.manual_seed(5)
            r = torch.rand_like(x)
            _expect(r.placement == p and tuple(r.shape) == (20, 10) and r.dtype == F64,
                    f"{where_r}: metadata")
            _allequal_locals(r, where_r)
            full = r.full()
            _expect(bool(((full >= 0) & (full < 1)).all()) and full.std() > 0.1,
                    f"{where_r}: not uniform values")
            gt.manual_seed(5)
            _close(torch.rand_like(x).full(), full, f"{where_r}: gt.manual_seed(5) again")
            xs = gt.tensor(ones, placement=p, sbp=_nd(S(0), p))
            gt.manual_seed(5)
            a = torch.randn_like(xs).full()
            gt.manual_seed(5)
            _close(torch.randn_like(xs).full(), a, f"{where_r}: randn_like split, seed again")

        _guard(where_r, rand_like_case)


# --------------------------------------------------------------------------------------
# 9. factory-likes and casts
# --------------------------------------------------------------------------------------

@checked
def check_likes_and_casts():
    x = _randn((5, 3), "lx")
    x32 = x.float()
    for p, limit in _placements(4, 1, 6):
        for (s,) in _combos(p, [x], limit, "likes"):
            where = _where("likes", (s,), p)

            def likes():
                g = gt.tensor(x, placement=p, sbp=s)
                made = {"zeros_like": (torch.zeros_like(g), torch.zeros(5, 3, dtype=F64)),
                        "ones_like": (torch.ones_like(g), torch.ones(5, 3, dtype=F64)),
                        "full_like": (torch.full_like(g, 3.5), torch.full((5, 3), 3.5, dtype=F64)),
                        "zeros_like f32": (torch.zeros_like(g, dtype=torch.float32),
                                           torch.zeros(5, 3)),
                        "new_zeros((2,3))": (g.new_zeros((2, 3)), torch.zeros(2, 3, dtype=F64)),
                        "new_ones(4)": (g.new_ones(4), torch.ones(4, dtype=F64)),
                        "new_full((2,2),7)": (g.new_full((2, 2), 7.0),
                                              torch.full((2, 2), 7.0, dtype=F64)),
                        # of the source's own size: the source's layout (a partial only
                        # where the values are zeros)
                        "new_zeros(own size)": (g.new_zeros((5, 3)), torch.zeros(5, 3, dtype=F64)),
                        "new_ones(own size)": (g.new_ones((5, 3)), torch.ones(5, 3, dtype=F64)),
                        "new_full(own size)": (g.new_full((5, 3), 2.0),
                                               torch.full((5, 3), 2.0, dtype=F64)),
                        "new_empty_strided(own).zero_()": (
                            g.new_empty_strided((5, 3), (1, 5)).zero_(),
                            torch.zeros(5, 3, dtype=F64)),
                        "detach": (g.detach(), x)}
                for name, (got, want) in made.items():
                    if not _expect(gt.is_global(got), f"{where} {name}: not a GlobalTensor"):
                        continue
                    _expect(got.placement == p, f"{where} {name}: placement {got.placement}")
                    _expect(tuple(got.shape) == tuple(want.shape) and got.dtype == want.dtype,
                            f"{where} {name}: {tuple(got.shape)} {got.dtype}")
                    _close(got.full(), want, f"{where} {name}")
                e = torch.empty_like(g)
                _expect(gt.is_global(e) and e.placement == p and tuple(e.shape) == (5, 3)
                        and e.sbp == g.sbp and e.dtype == F64,
                        f"{where} empty_like: {type(e).__name__} {tuple(e.shape)} "
                        f"{getattr(e, 'sbp', None)}")
                _expect(not g.detach().requires_grad, f"{where} detach requires grad")
                n = g.new_empty((5, 3))
                _expect(n.sbp == g.sbp and tuple(n.to_local().shape) == tuple(g.to_local().shape),
                        f"{where} new_empty(own size): {n.sbp}, local {tuple(n.to_local().shape)}")

            _guard(where, likes)
    case("clone", lambda t: t.clone(), [x], places=_placements(4, 1, 4))
    casts = {"to(float64)": lambda t: t.to(torch.float64), "double()": lambda t: t.double(),
             "type(float64)": lambda t: t.type(torch.float64),
             "to(dtype=float64)*2": lambda t: t.to(dtype=torch.float64) * 2}
    for name, op in casts.items():
        case(name, op, [x32], places=_placements(4, 1, 3), rtol=1e-6, atol=1e-6)
    case("float()", lambda t: t.float(), [x], places=_placements(4, 1, 3), rtol=1e-6, atol=1e-6)
    case("long()", lambda t: (t * 3).long(), [x], grad=False, places=_placements(4, 0, 3))
    case("detach()+y", lambda t, u: t.detach() * u, [x, _randn((5, 3), "ly")],
         places=_placements(4, 0, 2))


# --------------------------------------------------------------------------------------
# 10. bad input
# --------------------------------------------------------------------------------------

@checked
def check_bad_input():
    n = gt.get_world_size()
    p, rev, first = _line(), _line(reverse=True), gt.placement("cpu", [0])
    v = _randn((5, 3), "bad")
    x = gt.tensor(v, placement=p, sbp=S(0))
    for other in (rev, first) + ((_mesh(),) if n == 4 else ()):
        y = gt.tensor(v, placement=other, sbp=_nd(B, other))
        w = gt.tensor(_randn((3, 2), "badw"), placement=other, sbp=_nd(B, other))
        tag = f"placements {p.ranks} and {other.ranks}"
        _raises(f"x + y on {tag}", lambda: x + y, ValueError, "placement")
        _raises(f"torch.mul(y, x) on {tag}", lambda: torch.mul(y, x), ValueError, "placement")
        _raises(f"x @ w on {tag}", lambda: x @ w, ValueError, "placement")
        _raises(f"F.linear on {tag}", lambda: F.linear(x, w.t()), ValueError, "placement")
        _raises(f"torch.cat on {tag}", lambda: torch.cat([x, y]), ValueError, "placement")
    for label, fn in (("x + plain (5,3)", lambda: x + torch.ones(5, 3, dtype=F64)),
                      ("x * plain (3,)", lambda: x * torch.ones(3, dtype=F64)),
                      ("plain (5,1) - x", lambda: torch.ones(5, 1, dtype=F64) - x),
                      ("x @ plain (3,2)", lambda: x @ torch.ones(3, 2, dtype=F64)),
                      ("F.linear(x, plain)", lambda: F.linear(x, torch.ones(2, 3, dtype=F64))),
                      ("torch.cat([x, plain])",
                       lambda: torch.cat([x, torch.ones(1, 3, dtype=F64)]))):
        _raises(label, fn, ValueError, "")
    # and one-element plain tensors are fine
    where = f"[world {n}] x + plain one-element"
    got = _guard(where, lambda: (x + torch.ones(1, dtype=F64)) * torch.tensor(2.0, dtype=F64))
    if got is not None:
        _close(got.full(), (v + 1) * 2, where)


# --------------------------------------------------------------------------------------
# 11. optimizers and modules
# --------------------------------------------------------------------------------------

def _mlp():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(),
                                   torch.nn.Linear(5, 3))


OPTIMIZERS = {
    "SGD(momentum)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Adam(foreach)": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
    "Adam(for-loop)": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _train(label, placement, sbp, data_sbp, make_opt, steps=3):
    where = f"[world {gt.get_world_size()}] {label} on {placement.ranks}"
    X, Y = _randn((7, 6), "trainX", dtype=torch.float32), _randn((7, 3), "trainY",
                                                                  dtype=torch.float32)
    ref = _mlp()
    model = gt.nn.to_global(copy.deepcopy(ref), placement, sbp)
    gx = gt.tensor(X, placement=placement, sbp=data_sbp)
    gy = gt.tensor(Y, placement=placement, sbp=data_sbp)
    opt, ref_opt = make_opt(list(model.parameters())), make_opt(list(ref.parameters()))
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = F.mse_loss(model(gx), gy)
        ref_loss = F.mse_loss(ref(X), Y)
        loss.backward()
        ref_loss.backward()
        _close(loss.full(), ref_loss.detach(), f"{where} loss at step {step}", 1e-5, 1e-6)
        opt.step()
        ref_opt.step()
    for (name, got), (_, want) in zip(model.named_parameters(), ref.named_parameters()):
        if not _expect(gt.is_global(got), f"{where} {name}: not a GlobalTensor"):
            continue
        expected = sbp(name, want) if callable(sbp) else sbp
        _expect(got.placement == placement and got.sbp == _tuple(expected),
                f"{where} {name}: layout {got.sbp} on {got.placement.ranks}")
        _close(got.full(), want.detach(), f"{where} {name} after {steps} steps", 1e-5, 1e-5)


def _clip(label, placement, sbp, data_sbp, foreach):
    where = f"[world {gt.get_world_size()}] {label} on {placement.ranks}"
    X, Y = _randn((7, 6), "clipX", dtype=torch.float32), _randn((7, 3), "clipY",
                                                                dtype=torch.float32)
    ref = _mlp()
    model = gt.nn.to_global(copy.deepcopy(ref), placement, sbp)
    F.mse_loss(model(gt.tensor(X, placement=placement, sbp=data_sbp)),
               gt.tensor(Y, placement=placement, sbp=data_sbp)).backward()
    F.mse_loss(ref(X), Y).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=foreach)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=foreach)
    total = total.full() if gt.is_global(total) else torch.as_tensor(total)
    _close(total, ref_total, f"{where} total norm", 1e-5, 1e-6)
    for (name, got), (_, want) in zip(model.named_parameters(), ref.named_parameters()):
        _close(got.grad.full(), want.grad, f"{where} clipped grad of {name}", 1e-5, 1e-6)


@checked
def check_optimizers_and_modules():
    p = _line()

    def rows_of_first(name, t):
        return S(0) if name == "0.weight" else B

    configs = [("broadcast params", p, B, S(0)), ("0.weight split(0)", p, rows_of_first, S(0))]
    if gt.get_world_size() == 4:
        def mesh_sbp(name, t):
            return (B, S(0)) if name == "0.weight" else (B, B)
        configs.append(("mesh params", _mesh(), mesh_sbp, (S(0), B)))
    for label, placement, sbp, data_sbp in configs:
        for opt_name, make in OPTIMIZERS.items():
            if label == "mesh params" and opt_name in ("Adam(for-loop)", "AdamW"):
                continue
            name = f"{opt_name} {label}, data {data_sbp}"
            _guard(f"[world {gt.get_world_size()}] {name} on {placement.ranks}",
                   lambda: _train(name, placement, sbp, data_sbp, make))
        for foreach in (True, False):
            name = f"clip_grad_norm_(foreach={foreach}) {label}"
            _guard(f"[world {gt.get_world_size()}] {name} on {placement.ranks}",
                   lambda: _clip(name, placement, sbp, data_sbp, foreach))


# --------------------------------------------------------------------------------------
# the worlds
# --------------------------------------------------------------------------------------

CHECKS = ["check_pointwise", "check_matmul", "check_reductions", "check_views",
          "check_along_dim_and_attention", "check_softmax_and_losses", "check_norm_conv_pool",
          "check_embedding", "check_dropout_and_random", "check_likes_and_casts",
          "check_bad_input", "check_optimizers_and_modules"]


class Worlds:
    """``World``s of ``n`` processes running CHECKS in order. The harness ends a world at
    its first failing check; a check that did not get to run then runs in a new world
    together with the checks after it, so every check reports on its own."""

    def __init__(self, n: int, names: list, timeout: float = 150):
        self.n, self.names, self.timeout = n, names, timeout
        self.runs: list = []

    def check(self, name: str) -> None:
        for w in self.runs:
            if name in w.errors or w.done.get(name) == self.n:
                return w.check(name)
            if "<timeout>" in w.errors and name == self._first_unfinished(w):
                raise AssertionError(w.errors["<timeout>"])
        world = World(self.n, __name__, self.names[self.names.index(name):],
                      timeout=self.timeout, env={"GLOBALTENSOR_TIMEOUT": "30"})
        self.runs.append(world)
        world.check(name)

    def _first_unfinished(self, w):
        return next((x for x in w.names if w.done.get(x) != self.n), None)


world2, world4, test_world2, test_world4 = checks_in_worlds(__name__, CHECKS, make_world=Worlds)
