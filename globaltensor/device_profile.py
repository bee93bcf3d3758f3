"""What a step's estimate is priced with (``gt.debug.simulate_step``): a
``DeviceProfile`` (compute rates, the host's time per call, the links per level) and
``Costing``, which counts each op's work on one rank's parts as it is carried out.

Profiles: ``PROFILES`` ("h100" and "h200" from their datasheets, dense rates, NCCL;
edit or add your own) and ``cpu_profile()``, this machine measured at first use.

>>> profile_of("h100").links[0].bandwidth     # doctest: +SKIP
450000000000.0
"""
from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from . import cost, heap, modes, simulated
from .layout import Layout
from .placement import Placement
from .sbp import broadcast
from .tensor import from_full


@dataclass(frozen=True)
class Link:
    """One level of the network: ``ranks`` per group of this level (a node's 8; None:
    every rank), the bytes per second each rank sends on it, the latency of one
    message, and the time to start one collective on it."""
    ranks: "int | None"
    bandwidth: float
    latency: float
    launch: float = 0.0   # starting one collective (the host's part: gloo's is large)


@dataclass(frozen=True)
class DeviceProfile:
    """A device and its links: FLOP/s of products per dtype name (``matmul_flops``),
    memory bandwidth in bytes per second, the links innermost first, and the backend
    whose collectives the program's are chosen and priced as ("nccl" for GPUs)."""
    name: str
    matmul_flops: dict
    memory_bandwidth: float
    links: tuple
    backend: str = "nccl"
    # Host seconds per call this library carries out (deciding, autograd, the kernel's
    # launch): on a CPU the same core runs them in turn with the kernels; on a GPU
    # they overlap the kernels, and a step takes the longer of the two. None: this
    # host's, measured at first use (``host_op_seconds``); 0: not counted.
    op_seconds: "float | None" = None
    # Cores a node's ranks share (None: each rank has a device of its own): ranks
    # beyond them run in turn (``cpu_profile``: ranks of a world on this machine).
    cores: "int | None" = None
    # How fast each of them runs while they all do (1: as fast as alone): a machine's
    # cores share memory bandwidth and caches (a virtual machine's, maybe more).
    together: float = 1.0
    # Seconds per byte of a fresh host block's first touch (its pages fault in): what
    # each new tensor of ``heap.MAPPED_BYTES`` or more costs where fully_shard maps
    # them (a "cpu" placement); 0: not counted (device memory, a caching allocator).
    fault_seconds: float = 0.0

    def flops(self, dtype: torch.dtype) -> float:
        name = str(dtype).replace("torch.", "")
        return self.matmul_flops.get(name, self.matmul_flops["float32"])

    def link(self, ranks: tuple, me: int) -> Link:
        """The slowest link a group of ``ranks`` (and ``me``) spans."""
        members = set(ranks) | {me}
        for level in self.links:
            if level.ranks is None or len({r // level.ranks for r in members}) == 1:
                return level
        return self.links[-1]


_NVLINK_IB = (Link(8, 450e9, 3e-6), Link(None, 50e9, 10e-6))   # NVLink 4 in a node; 400 Gb/s IB
PROFILES: dict = {
    "h100": DeviceProfile("NVIDIA H100 SXM (datasheet, dense)",
                          {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
                          3.35e12, _NVLINK_IB),
    "h200": DeviceProfile("NVIDIA H200 SXM (datasheet, dense)",
                          {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
                          4.8e12, _NVLINK_IB),
}


@functools.lru_cache(maxsize=1)
def cpu_profile() -> DeviceProfile:
    """This machine, measured once, as one rank of a world here runs (one thread: the
    launcher's ``OMP_NUM_THREADS``): the rate of a 512 x 256 x 1024 float32 layer's
    products (forward and backward), the bytes per second of an add, GELU, softmax and
    layer norm on 2 MiB, and the host time per call of a small training step
    (``_op_seconds``); links: gloo on loopback (``cost.GLOO``); the ranks share
    this machine's cores. Kernels alone, on operands in cache, run faster than in a
    step (operands written long before, strided views, small batched products): the
    rates are scaled by how much slower a step's kernels ran (``_slower_in_a_step``)."""
    a, b, c = torch.randn(512, 256), torch.randn(256, 1024), torch.randn(512, 1024)
    cores = os.cpu_count() or 1
    # first: after the calibration step's GlobalTensor ops (``_slower_in_a_step``, in a
    # simulated rank's thread) cores busy at once read 0.44-0.67 where they read
    # 0.85-0.99 before it, in the same process, and the ranks of a world run in fresh ones
    together = _together(a, b, cores)
    with _one_thread():
        # a layer's three products: forward, and its backward's two (transposed operands)
        flops = 3 * 2 * 512 * 256 * 1024 / sum(map(_best_seconds, (
            lambda: a @ b, lambda: c @ b.t(), lambda: a.t() @ c)))
        # the other ops of a step move their operands at rates as different as these:
        # bytes over the time of all four
        F = torch.nn.functional
        bandwidth = 9 * c.nbytes / sum(map(_best_seconds, (
            lambda: c + c, lambda: F.gelu(c), lambda: torch.softmax(c, -1),
            lambda: F.layer_norm(c, (1024,)))))
        faults = _fault_seconds()
    host = host_op_seconds()
    slower = _slower_in_a_step(flops, bandwidth, host)
    return DeviceProfile("this CPU (measured)", {"float32": flops / slower}, bandwidth / slower,
                         (Link(None, 1 / cost.GLOO.beta, cost.GLOO.alpha, cost.GLOO.launch),),
                         "gloo", op_seconds=host, cores=cores, together=together,
                         fault_seconds=faults)


def _fault_seconds() -> float:
    """Seconds per byte that the first write of a freshly mapped 16 MiB block takes
    beyond a later write's (its pages fault in: the kernel maps and zeroes each): the
    fastest first write of three blocks less the fastest later write. (Fastest of
    each kind apart: one later write slowed by the scheduler must not cancel a try.)"""
    size, firsts, laters = 16 << 20, [], []
    for _ in range(3):
        block = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
        for value, writes in ((1, firsts), (2, laters), (3, laters)):
            begin = time.perf_counter()
            block.fill_(value)
            writes.append(time.perf_counter() - begin)
    return max(0.0, min(firsts) - min(laters)) / size


def _together(a: torch.Tensor, b: torch.Tensor, cores: int) -> float:
    """How fast a core runs products while every core does (threads of one process,
    each on one thread of torch's, as ranks of a world here run), against alone: the
    medians of tries taken in turn (this machine's speed drifts), at most 1."""
    def work():
        torch.set_num_threads(1)   # (OpenMP's count is per thread: a new one has the default)
        for _ in range(24):        # about 60 ms: shorter tries read 0.6-0.97 from run to run
            a @ b

    def wall(threads: int) -> float:
        runs = [threading.Thread(target=work) for _ in range(threads)]
        t0 = time.perf_counter()
        for run in runs:
            run.start()
        for run in runs:
            run.join()
        return time.perf_counter() - t0
    if cores < 2:
        return 1.0
    with _one_thread():
        work()
        tries = [(wall(1), wall(cores)) for _ in range(5)]
        return min(1.0, statistics.median(a for a, _ in tries) / statistics.median(b for _, b in tries))


def _slower_in_a_step(flops: float, bandwidth: float, host: float) -> float:
    """How many times slower the kernels of a training step ran than ``flops`` and
    ``bandwidth`` say (at least 1): a step's median time less its calls' host time,
    over its counted work at those rates. The step: a small transformer-like layer
    (layer norm, a projection, softmax over blocks of rows, a GELU MLP of 4x the width),
    backward and AdamW, of 512 rows of 256 (about 13 ms of products on one core)."""
    def work():
        step, costing = _calibration_step(), Costing(0)
        step()
        step()
        with costing:
            step()
        counted = 2 * sum(costing.macs.values()) / flops + costing.other_bytes / bandwidth
        return (statistics.median(_seconds(step) for _ in range(5)) - costing.ops * host) / counted
    with _one_thread():
        return max(1.0, simulated.run_as_rank(1, 0, work))


def _calibration_step() -> Callable:
    layout = functools.partial(Layout.make, placement=Placement("cpu", [0]), sbp=(broadcast,))

    def tensor(*shape, grad=True):
        return from_full(torch.randn(*shape) / shape[0] ** 0.5, layout(shape), requires_grad=grad)
    x, (wq, w1, b1, w2) = tensor(512, 256, grad=False), (
        tensor(*s) for s in ((256, 256), (256, 1024), (1024,), (1024, 256)))
    opt = torch.optim.AdamW([wq, w1, b1, w2])
    F = torch.nn.functional

    def step():
        h = F.layer_norm(x, (256,))
        q = (h @ wq).view(8, 64, 256)
        a = (torch.softmax(q @ q.transpose(1, 2) / 16, -1) @ q).view(512, 256)
        y = F.gelu((h + a) @ w1 + b1) @ w2
        (y + x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return step


def _seconds(work: Callable) -> float:
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


@contextlib.contextmanager
def _one_thread():
    """torch on one thread while measuring (as a launched rank runs), then as it was."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _best_seconds(work: Callable, repeats: int = 5, calls: int = 4) -> float:
    """The least time of ``calls`` calls of ``work`` (over ``repeats`` tries), per call:
    what the machine does when nothing else runs."""
    work()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            work()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


@functools.lru_cache(maxsize=1)
def host_op_seconds() -> float:
    """This host's seconds per call of a training step too small for its kernels to
    count (``_op_seconds``), measured once: what a profile without ``op_seconds`` takes
    (a GPU machine's host runs the same Python; its CPU may be faster or slower)."""
    with _one_thread():
        return simulated.run_as_rank(1, 0, _op_seconds)


def _op_seconds() -> float:
    """Host seconds per call of a training step too small for its kernels to count (a
    16-wide layer with layer norm and GELU, backward, AdamW): deciding each call,
    autograd, the optimizer's Python and the kernels' launches, per call carried out."""
    layout = functools.partial(Layout.make, placement=Placement("cpu", [0]), sbp=(broadcast,))
    w, bias = (from_full(torch.randn(*s) / 4, layout(s), requires_grad=True)
               for s in ((16, 16), (16,)))
    x = from_full(torch.randn(8, 16), layout((8, 16)))
    opt = torch.optim.AdamW([w, bias])

    def step():
        h = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x @ w + bias, (16,)))
        h.square().mean().backward()
        opt.step()
        opt.zero_grad()
    step()
    costing = Costing(0)
    with costing:
        step()
    return _best_seconds(step, repeats=3, calls=10) / costing.ops


def profile_of(device: "str | DeviceProfile") -> DeviceProfile:
    if isinstance(device, DeviceProfile):
        return device
    name = str(device).lower()
    if name == "cpu":
        return cpu_profile()
    if name not in PROFILES:
        raise ValueError(f"simulate_step: no device profile {device!r}; known: "
                         f"{['cpu', *PROFILES]}, or pass a DeviceProfile")
    return PROFILES[name]


class Costing(modes.Mode):
    """Counts each op's work on this rank's parts as it is carried out."""

    def __init__(self, rank: int):
        self.rank = rank
        self.macs: Counter = Counter()
        self.other_bytes = 0
        self.fresh_bytes = 0   # of new tensors of heap.MAPPED_BYTES or more (host blocks)
        self.ops = 0   # every call carried out (views, boxing too): each costs host time

    def run(self, func, decision, leaves: list, spec, why):
        self.ops += 1
        if why is None and decision.out_layouts is not None:
            self._count(func, decision)
        return self.below.run(func, decision, leaves, spec, why)

    def _count(self, func, decision) -> None:
        ins = [t for t in decision.targets if t is not None]
        outs = [t for t in decision.out_layouts if t is not None]
        if not ins + outs or self.rank not in (ins + outs)[0].placement:
            return   # (this rank holds no part of the op)
        dtype = decision.out_dtypes[0] if decision.out_dtypes else torch.float32
        here = self.rank
        macs = cost.product_macs(func, tuple(ins), here)
        if not cost.returns_view(func):   # new tensors (the schema's, read once per op)
            for t in outs:
                size = dtype.itemsize * math.prod(t.local_shape(here))
                self.fresh_bytes += size if size >= heap.MAPPED_BYTES else 0
        if macs is not None:
            self.macs[dtype] += macs
        elif not cost.writes_nothing(func):
            self.other_bytes += dtype.itemsize * sum(math.prod(t.local_shape(here))
                                                     for t in (*ins, *outs))
