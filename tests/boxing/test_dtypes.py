"""Boxing keeps the dtype: every dtype x every sbp pair, on the simulator and on 2
processes (gloo). Partial sums of integers used to come back int64 (a local ``sum(0)``),
and int16 failed in gloo ("Invalid scalar type"): collectives lack it, so it travels
widened. A sum of bools is their "or", as torch adds bools.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from mp import world_test

import globaltensor as gt
from globaltensor.boxing import materialize, plan_route, simulate
from globaltensor.boxing.simulate import scatter
from globaltensor.layout import Layout
from globaltensor.placement import Placement

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
SBPS = [gt.sbp.broadcast, gt.sbp.partial_sum, gt.sbp.partial_max, gt.sbp.split(0),
        gt.sbp.split(1)]


def _pairs(dtype):
    for a, b in itertools.product(SBPS, SBPS):
        if dtype.is_complex and gt.sbp.partial_max in (a, b):
            continue  # complex numbers have no order
        yield a, b


def _value(dtype, shape, seed):
    """Small integers (sums stay exact in every dtype), as ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    low = 0 if dtype == torch.uint8 else -3
    real = torch.randint(low, 4, shape, generator=gen)
    if dtype.is_complex:
        return torch.complex(real.float(), torch.randint(-3, 4, shape, generator=gen).float())
    return real.to(dtype)


def _addends(value, layout, seed):
    """Per-rank locals of ``value``; on a partial-sum axis every member holds an
    addend (integer sums wrap alike in every rank's arithmetic), so a reduction that
    drops an addend or widens the dtype shows."""
    locals_ = scatter(value, layout)
    if layout.sbp != (gt.sbp.partial_sum,) or value.dtype == torch.bool:
        return locals_
    ranks = list(layout.placement)
    extra = [_value(value.dtype, value.shape, seed + k) for k in range(1, len(ranks))]
    for r, e in zip(ranks[1:], extra):
        locals_[r] = e
    locals_[ranks[0]] = value - sum(extra)
    return locals_


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mesh", [[0, 1], [0, 1, 2], [[0, 1], [2, 3]]], ids=str)
def test_every_pair_keeps_dtype_on_simulator(monkeypatch, dtype, mesh):
    monkeypatch.setenv("WORLD_SIZE", "4")
    p = Placement("cpu", mesh)
    shape = (5, 4)
    for i, (a, b) in enumerate(_pairs(dtype)):
        src = Layout.make(shape, p, (a,) * p.ndim)
        dst = Layout.make(shape, p, (b,) * p.ndim)
        value = _value(dtype, shape, i)
        out = simulate(plan_route(src, dst, value.element_size()), _addends(value, src, i))
        where = f"{dtype}: {a} -> {b} on {mesh}"
        for r in p:
            assert out[r].dtype == dtype, where
            assert tuple(out[r].shape) == dst.local_shape(r), where
        got = materialize(out, dst)
        assert got.dtype == dtype, where
        assert torch.equal(got, value), where


def test_materialize_keeps_dtype(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    layout = Layout.make((3,), Placement("cpu", [0, 1]), gt.sbp.partial_sum)
    locals_ = {0: torch.tensor([1, 2, 3], dtype=torch.int8),
               1: torch.tensor([1, 1, 1], dtype=torch.int8)}
    assert materialize(locals_, layout).dtype == torch.int8
    bools = {0: torch.tensor([True, False, False]), 1: torch.tensor([True, True, False])}
    assert torch.equal(materialize(bools, layout), torch.tensor([True, True, False]))


# --- on processes ------------------------------------------------------------------------

def check_every_dtype_and_pair():
    rank = gt.get_rank()
    p = gt.placement("cpu", [0, 1])
    shape = (5, 4)
    for dtype in DTYPES:
        for i, (a, b) in enumerate(_pairs(dtype)):
            src, dst = Layout.make(shape, p, a), Layout.make(shape, p, b)
            value = _value(dtype, shape, i)
            locals_ = _addends(value, src, i)
            x = gt.from_local(locals_[rank], placement=p, sbp=a, shape=shape)
            y = x.to_global(sbp=b)
            got = y.to_local()
            where = f"{dtype}: {a} -> {b}, rank {rank}"
            assert got.dtype == dtype and y.dtype == dtype, f"{where}: got {got.dtype}"
            expected = simulate(plan_route(src, dst, value.element_size()), locals_)[rank]
            assert torch.equal(got, expected), f"{where}: {got} != {expected}"
            assert torch.equal(y.full(), value), where
            assert torch.equal(x.to_local(), locals_[rank]), f"{where}: source changed"


def check_int16_reductions():
    # What failed in gloo: a partial int16 reduced (to split and to broadcast), and the
    # gather of an int16 split, with values past int8's range.
    p = gt.placement("cpu", [0, 1])
    value = torch.arange(-600, 600, 100, dtype=torch.int16).reshape(4, 3)
    x = gt.tensor(value, placement=p, sbp=gt.sbp.broadcast).to_global(sbp=gt.sbp.partial_sum)
    for sbp in (gt.sbp.split(0), gt.sbp.broadcast, gt.sbp.split(1)):
        y = x.to_global(sbp=sbp)
        assert y.to_local().dtype == torch.int16
        assert torch.equal(y.full(), value), sbp


CHECKS = ["check_every_dtype_and_pair", "check_int16_reductions"]
test_world2 = world_test(__name__, 2, CHECKS)
