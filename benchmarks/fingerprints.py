"""What the collectives' fingerprints cost (``globaltensor/comm/fingerprint.py``): the
same boxing and the same collective with fingerprints off and on, side by side.

    python benchmarks/fingerprints.py                      # 1 KiB and 16 MiB, 2 processes
    python benchmarks/fingerprints.py --sizes 1024,65536 --iters 40
    python -m globaltensor.launch --nproc_per_node 2 benchmarks/fingerprints.py
    python benchmarks/fingerprints.py --own-cost    # the tagging alone, in this process

Rows: ``to_global`` of a tensor of the given size (the global tensor's bytes, fp32)
from S(0) to B (all_gather), P to B (all_reduce), P to S(0) and S(0) to S(1) (on gloo an
exchange of point-to-point messages), and S(0) on the first half of the ranks to S(0)
on the other half (send/recv); then the comm wrappers themselves on buffers made once:
all_gather, all_reduce, reduce_scatter, all_to_all, broadcast; above 256 KiB also the
small all-gather of tags that such a collective adds (the same in both columns). Each
round times every
row off and on (fingerprints switched on every rank at once) in its own shuffled order,
after a barrier; the table gives the medians of the slowest rank (wall time per call,
and the CPU time of the calling thread, which a busy machine's descheduling does not
inflate), the differences and the ratio of wall times. Small sizes time ``--calls``
calls per batch (a barrier costs more than a 1 KiB collective here).

``--own-cost``: no world; the CPU time per call of the tagged path itself at 1 KiB
(``comm/tagged.py``: tag, packing, comparing, copying out), its collective replaced by
a stand-in that copies this rank's slot or row into the other rank's, in a warm loop,
against the stand-in alone; medians of interleaved batches.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

from globaltensor.testing import spawn


def _rows(numel: int):
    """(name, fn) of every row at ``numel`` fp32 elements (global)."""
    import globaltensor as gt
    from globaltensor import comm
    from globaltensor.comm import fingerprint
    n, rank = gt.get_world_size(), gt.get_rank()
    ranks = tuple(range(n))
    p = gt.placement.all("cpu")
    S0, S1, B, P = gt.sbp.split(0), gt.sbp.split(1), gt.sbp.broadcast, gt.sbp.partial_sum
    cols = 64 if numel < 65536 else 512
    shape = (numel // cols, cols)
    x_s0 = gt.randn(*shape, placement=p, sbp=S0)
    x_p = gt.randn(*shape, placement=p, sbp=P)
    part = numel // n
    local, full = torch.randn(part), torch.zeros(numel)
    gathered, scattered, a2a = torch.empty(numel), torch.empty(part), torch.empty(part)
    rows = [("to_global S(0)->B", lambda: x_s0.to_global(sbp=B)),
            ("to_global P->B", lambda: x_p.to_global(sbp=B)),
            ("to_global P->S(0)", lambda: x_p.to_global(sbp=S0)),
            ("to_global S(0)->S(1)", lambda: x_s0.to_global(sbp=S1))]
    if n >= 2:
        lo, hi = gt.placement("cpu", list(range(n // 2))), gt.placement("cpu", list(range(n // 2, n)))
        y = gt.randn(*shape, placement=lo, sbp=S0)
        rows.append(("to_global S(0)@lo->S(0)@hi", lambda: y.to_global(placement=hi, sbp=S0)))
    splits = [part // n] * n
    rows += [("comm all_gather", lambda: comm.all_gather_into(gathered, local, ranks)),
             ("comm all_reduce", lambda: comm.all_reduce_(full, "sum", ranks)),
             ("comm reduce_scatter", lambda: comm.reduce_scatter_into(scattered, full, "sum", ranks)),
             ("comm all_to_all", lambda: comm.all_to_all_single(a2a, local, splits, splits, ranks)),
             ("comm broadcast", lambda: comm.broadcast_(full, 0, ranks))]
    if numel * 4 > fingerprint.PACK_LIMIT:   # what a collective over PACK_LIMIT adds
        rows.append(("its tag exchange alone", lambda: fingerprint.exchange(
            fingerprint.tag("benchmark", ranks, 1, torch.int64))))
    del rank
    return rows


def _switched(fn, on: bool):
    from globaltensor.comm import fingerprint

    def run():
        before = fingerprint.set_enabled(on)
        try:
            fn()
        finally:
            fingerprint.set_enabled(before)
    return run


def _medians(fns, rounds: int, calls: int) -> list:
    """[(wall, cpu)] seconds per call of each fn: medians over ``rounds`` rounds (each in
    its own order, the same on every rank, after a barrier), the slowest rank's."""
    for fn in fns:
        for _ in range(3):
            fn()
    wall, cpu = [[] for _ in fns], [[] for _ in fns]
    for it in range(rounds):
        order = list(range(len(fns)))
        random.Random(it).shuffle(order)
        for k in order:
            dist.barrier()
            w, c = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                fns[k]()
            cpu[k].append((time.thread_time() - c) / calls)
            wall[k].append((time.perf_counter() - w) / calls)
    out = torch.tensor([[statistics.median(w), statistics.median(c)] for w, c in zip(wall, cpu)],
                       dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.tolist()


def _own_cost(rounds: int = 40, calls: int = 200) -> None:
    """Print the CPU time per call of the tagged all_reduce and all_gather at 1 KiB with
    their collective stubbed (a world of 2 as rank 0 sees it), less the stub's."""
    from unittest import mock

    from globaltensor.comm import fingerprint, tagged

    def reduce_stub(buf, op=None, group=None, async_op=False):  # rank 1's slot := ours
        buf[-4:] = buf[-8:-4] if buf.numel() > 256 else buf[-4:]

    def gather_stub(out, inp, group=None, async_op=False):      # every row := ours
        out.view(2, -1).copy_(inp.view(1, -1).expand(2, -1))
    t, src, out, packed = torch.zeros(256), torch.randn(256), torch.empty(512), torch.zeros(264)
    cases = {"all_reduce": (lambda: tagged.all_reduce(t, "sum", (0, 1)),
                            lambda: reduce_stub(packed)),
             "all_gather": (lambda: tagged.all_gather(out, src, (0, 1)),
                            lambda: gather_stub(out, src))}
    with mock.patch.object(tagged, "get_group", lambda ranks: None), \
            mock.patch.object(tagged, "_all_gather_single", gather_stub), \
            mock.patch.object(dist, "all_reduce", reduce_stub), \
            mock.patch.object(fingerprint, "rank", lambda: 0):
        for name, fns in cases.items():
            took = [[], []]
            for it in range(rounds):
                for k in (it % 2, 1 - it % 2):
                    c = time.thread_time()
                    for _ in range(calls):
                        fns[k]()
                    took[k].append((time.thread_time() - c) / calls)
            on, stub = (statistics.median(x) for x in took)
            print(f"{name} at 1 KiB: the tagged path {_time(on)} of CPU per call, the "
                  f"stand-in collective {_time(stub)}: tagging costs {_time(on - stub)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,16777216", help="bytes of the global tensor (fp32)")
    ap.add_argument("--iters", type=int, default=30, help="rounds (medians over them)")
    ap.add_argument("--calls", type=int, default=20, help="calls per timed batch below 1 MiB")
    args = ap.parse_args(argv)

    import globaltensor as gt
    gt.init()
    results = []
    for size in [int(s) for s in args.sizes.split(",")]:
        rows = _rows(size // 4)
        fns = [f for _, fn in rows for f in (_switched(fn, False), _switched(fn, True))]
        calls = args.calls if size < 2**20 else 1
        t = _medians(fns, args.iters, calls)
        results += [(size, name, t[2 * k], t[2 * k + 1]) for k, (name, _) in enumerate(rows)]
    if gt.get_rank() == 0:
        print(f"\n{gt.get_world_size()} processes, gloo, medians of {args.iters} rounds "
              f"(the slowest rank's), off and on interleaved; wall and CPU time per call")
        head = (f"{'size':>7} {'row':<27}{'wall off':>10}{'on':>10}{'on - off':>10}"
                f"{'on/off':>7}{'CPU off':>10}{'on':>10}{'on - off':>10}")
        print(head)
        print("-" * len(head))
        for size, name, (off, cpu_off), (on, cpu_on) in results:
            print(f"{_size(size):>7} {name:<27}{_time(off):>10}{_time(on):>10}"
                  f"{_time(on - off):>10}{on / off:7.2f}{_time(cpu_off):>10}"
                  f"{_time(cpu_on):>10}{_time(cpu_on - cpu_off):>10}")
    dist.barrier()


def _size(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes // 1024} KiB"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if abs(seconds) >= 1e-3 else f"{seconds * 1e6:.1f} us"


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("fingerprints"):   # --write-docs: its table into docs/benchmarks.md
        if "--own-cost" in sys.argv:
            torch.set_num_threads(1)
            _own_cost()
        else:
            spawn(main, 2)
