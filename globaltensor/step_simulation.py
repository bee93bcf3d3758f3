"""``gt.debug.simulate_step``: a training step on a placement of any size (8, 64, 1024
ranks), run in this process as one of its ranks, before renting those machines.

``fn()`` builds what the step needs (model, optimizer, batch) and returns the step (a
callable), or is the step. Both run as one rank of a world of processes that do not exist
(``simulated.run_as_rank``: torch's fake process group, this rank's globaltensor state of
its own), on fake tensors (``FakeTensorMode``: shapes and dtypes, no values, no
memory): ``fn`` entirely under fake mode, the step on the fake parts it left, with
every collective counted and none sent (``comm.stats.dry_run``). So the layouts, the
per-op decisions, the boxing plans, backward and gradient sync are those of a real
rank. The step runs ``steps`` times (optimizer state is made at the first); the last
is measured:

- its collectives: kind, bytes this rank sends, the group (``SimulatedStep.events``);
- its memory at its peak, by kind: torch's ``MemTracker`` on the local parts
  (parameters, gradients, optimizer state, activations, other);
- its compute: multiply-adds of products (mm, bmm, addmm, baddbmm, fused attention) on
  this rank's parts, and bytes read and written by the other ops;
- an estimated time from a ``DeviceProfile``: products at the profile's rate for
  their dtype, other ops at its memory bandwidth, each call carried out as the host's
  ``op_seconds`` (overlapping the kernels on a GPU, added to them on a CPU, whose
  ``cores`` a node's ranks share), each collective as its link's launch, the latency
  of its hops and its bytes over the slowest link its group spans (within a node,
  across nodes), communication in sequence (no overlap counted).

Profiles: ``PROFILES`` ("h100" and "h200" from their datasheets, dense rates, NCCL;
edit or add your own) and ``"cpu"``, this machine measured at first use (gloo's
loopback links). The program's collectives are chosen and priced as the profile's
backend's (``comm.simulated.init_fake_rank``).

Limits: whole-step planning is off unless ``planned=True`` (then the step is recorded,
planned and replayed as in a real run, which takes more steps); a value read
(``.item()``, a branch on a value) cannot run on fake tensors; ``torch.compile`` is not
simulated; the time is the model's estimate, not a measurement.

>>> def make():                                                 # doctest: +SKIP
...     P = gt.placement.all("cpu")               # the simulated world's 256 ranks
...     model = gt.nn.to_global(GPT(cfg), P, gt.sbp.broadcast)
...     opt = torch.optim.AdamW(model.parameters())
...     ids = gt.randint(0, cfg.vocab, (256, 1024), placement=P, sbp=gt.sbp.split(0))
...     def step():
...         model(ids).loss.backward(); opt.step(); opt.zero_grad()
...     return step, model, opt                     # (model, opt: memory by kind)
>>> print(gt.debug.simulate_step(make, placement=gt.placement("cpu", ranks=range(256)),
...                              device="h100"))     # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from . import cost, heap, modes, simulated
from .boxing import plan as plans
from .comm import stats
from .comm.stats import CommCounter
from .layout import Layout
from .placement import Placement
from .planner import record
from .sbp import broadcast
from .tensor import from_full

aten = torch.ops.aten


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
    this machine's cores."""
    with _one_thread():
        a, b, c = torch.randn(512, 256), torch.randn(256, 1024), torch.randn(512, 1024)
        # a layer's three products: forward, and its backward's two (transposed operands)
        flops = 3 * 2 * 512 * 256 * 1024 / sum(map(_best_seconds, (
            lambda: a @ b, lambda: c @ b.t(), lambda: a.t() @ c)))
        # the other ops of a step move their operands at rates as different as these:
        # bytes over the time of all four
        F = torch.nn.functional
        bandwidth = 9 * c.nbytes / sum(map(_best_seconds, (
            lambda: c + c, lambda: F.gelu(c), lambda: torch.softmax(c, -1),
            lambda: F.layer_norm(c, (1024,)))))
    return DeviceProfile("this CPU (measured)", {"float32": flops}, bandwidth,
                         (Link(None, 1 / cost.GLOO.beta, cost.GLOO.alpha, cost.GLOO.launch),),
                         "gloo", op_seconds=host_op_seconds(), cores=os.cpu_count() or 1)


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
    costing = _Costing(0)
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


def _latency_hops(kind: str, n: int) -> int:
    """Messages in a row a collective of ``n`` members waits for: a ring's n - 1 (an
    all-reduce's 2(n - 1), or a tree's 2 log2 n where that is fewer, as NCCL picks for
    small messages); a send's one."""
    if n <= 1:
        return 1
    if kind == "all_reduce":
        return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
    return n - 1 if kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast") else 1


@dataclass(frozen=True)
class SimulatedStep:
    """What ``simulate_step`` measured for one rank of the step (module docstring):
    ``counted`` (collectives by kind), ``events`` ((kind, bytes sent, group) each),
    ``memory`` (bytes at the step's peak by kind, and "peak"), ``macs`` (multiply-adds
    of products by dtype), ``other_bytes`` (read and written by the other ops), and the
    estimate: ``compute_seconds``, ``comm_seconds``, ``seconds``."""
    world: int
    rank: int
    device: DeviceProfile
    counted: CommCounter
    events: tuple
    memory: dict
    macs: dict
    other_bytes: int
    result: object = field(default=None, repr=False)
    ops: int = 0                 # calls carried out on this rank
    ranks_per_node: int = 1      # (the ranks that share a node's ``device.cores``)

    @property
    def _shared(self) -> float:
        """How many ranks take turns on each core (1 where each has its own device)."""
        cores = self.device.cores
        return 1.0 if cores is None else max(1.0, self.ranks_per_node / cores)

    @property
    def compute_seconds(self) -> float:
        products = sum(2 * n / self.device.flops(dtype) for dtype, n in self.macs.items())
        return (products + self.other_bytes / self.device.memory_bandwidth) * self._shared

    @property
    def host_seconds(self) -> float:
        """The host's time for the step's calls (``DeviceProfile.op_seconds``)."""
        each = self.device.op_seconds
        return self.ops * (host_op_seconds() if each is None else each) * self._shared

    @property
    def comm_seconds(self) -> float:
        total = 0.0
        for kind, nbytes, ranks in self.events:
            link = self.device.link(ranks, self.rank)
            total += (link.launch + _latency_hops(kind, len(ranks)) * link.latency
                      + nbytes / link.bandwidth)
        return total

    @property
    def seconds(self) -> float:
        """The estimated step: compute, then communication (none overlapped); on a CPU
        the host's time is added to the compute, on a GPU the longer of the two counts."""
        busy = (self.compute_seconds + self.host_seconds if self.device.cores is not None
                else max(self.compute_seconds, self.host_seconds))
        return busy + self.comm_seconds

    step_seconds = seconds

    @property
    def peak_memory(self) -> int:
        """Bytes this rank holds at the step's peak."""
        return self.memory["peak"]

    @property
    def bytes(self) -> int:
        """Bytes this rank sends in the step."""
        return self.counted.total_bytes

    def __str__(self) -> str:
        mib, ms = 1 << 20, 1e-3
        rows = [("step, estimated", self.seconds / ms, "ms"),
                ("  compute", self.compute_seconds / ms, "ms"),
                ("  communication", self.comm_seconds / ms, "ms"),
                (f"  host ({self.ops} calls)", self.host_seconds / ms, "ms"),
                ("memory at peak", self.peak_memory / mib, "MiB")]
        rows += [(f"  {k}", self.memory[k] / mib, "MiB") for k in
                 ("parameters", "gradients", "optimizer", "activations", "other")]
        rows.append(("sent", self.bytes / mib, "MiB"))
        rows += [(f"  {k} x{self.counted.calls[k]}", self.counted.bytes[k] / mib, "MiB")
                 for k in sorted(self.counted.calls)]
        lines = [f"rank {self.rank} of {self.world} on {self.device.name}"]
        lines += [f"{what:<28}{value:>12.2f} {unit}" for what, value, unit in rows]
        return "\n".join(lines)

    __repr__ = __str__


class _Costing(modes.Mode):
    """Counts each op's work on this rank's parts as it is carried out."""

    def __init__(self, rank: int):
        self.rank = rank
        self.macs: Counter = Counter()
        self.other_bytes = 0
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
        if macs is not None:
            self.macs[dtype] += macs
        elif not cost.writes_nothing(func):
            self.other_bytes += dtype.itemsize * sum(math.prod(t.local_shape(here))
                                                     for t in (*ins, *outs))


def simulate_step(fn: Callable, *args, placement: Placement,
                  device: "str | DeviceProfile" = "cpu", rank: "int | None" = None,
                  ranks_per_node: "int | None" = None, steps: int = 2,
                  planned: bool = False, **kwargs) -> SimulatedStep:
    """Run ``fn(*args, **kwargs)`` as one rank of the world ``placement`` spans (its
    ranks 0..n-1: 8, 64, 1024 ...), on fake tensors, without those processes; report
    the step's collectives, memory and estimated time (module docstring).

    ``fn`` either builds the model, optimizer and batch on the placements of that world
    (``gt.placement.all(...)`` inside it) and returns the step to simulate, a callable,
    or ``(step, *objects)`` whose memory is counted by kind (the model, the
    optimizer); or is the step itself. The step runs ``steps`` times, the last
    reported. ``rank``: the rank simulated (default: the placement's first).
    ``device``: "cpu", "h100", "h200" or a ``DeviceProfile``. ``ranks_per_node``:
    LOCAL_WORLD_SIZE (default: the profile's innermost link's group). ``planned``: as
    whole-step planning replays the step (recorded and planned first: at least
    ``RECORD_AT + 2`` steps run); else each op decided by itself.

    >>> report = gt.debug.simulate_step(make, placement=gt.placement("cpu",   # doctest: +SKIP
    ...                                 ranks=range(1024)), device="h100")
    >>> report.peak_memory, report.bytes, report.step_seconds                  # doctest: +SKIP
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"simulate_step: placement must be a gt.placement, got "
                        f"{type(placement).__name__}")
    world = max(placement.flat_ranks) + 1
    rank = placement.flat_ranks[0] if rank is None else rank
    if steps < 1:
        raise ValueError(f"simulate_step: steps must be >= 1, got {steps!r}")
    profile = profile_of(device)
    local = ranks_per_node or profile.links[0].ranks or world
    if planned:
        steps = max(steps, record.RECORD_AT + 2)
    # Boxing plans are kept by layouts, priced with this process's backend: the
    # simulated rank's (its profile's) may differ, so neither sees the other's plans
    plans.clear_caches()
    try:
        return simulated.run_as_rank(world, rank, _simulate, fn, args, kwargs, rank, world,
                                     profile, steps, planned, min(local, world),
                                     local_world=min(local, world),
                                     backend=profile.backend)
    finally:
        plans.clear_caches()


def _simulate(fn: Callable, args: tuple, kwargs: dict, rank: int, world: int,
              profile: DeviceProfile, steps: int, planned: bool, local: int) -> SimulatedStep:
    from torch.distributed._tools.mem_tracker import MemTracker
    with contextlib.nullcontext() if planned else record.paused(), stats.dry_run(), \
            heap.left_alone():   # (fully_shard would set this process's malloc)
        with FakeTensorMode(allow_non_fake_inputs=True):
            made = fn(*args, **kwargs)
        step, *tracked = made if isinstance(made, tuple) and made else (made,)
        if not callable(step):   # fn is the step: its first run was the first step
            step, tracked, steps = functools.partial(fn, *args, **kwargs), [], steps - 1
        for _ in range(steps - 1):
            step()
        tracker, costing = MemTracker(), _Costing(rank)
        if tracked:
            tracker.track_external(*tracked)
        with stats.dry_run(events=True) as counted, tracker, costing:
            result = step()
    return SimulatedStep(world, rank, profile, counted, tuple(counted.events),
                         _by_kind(tracker), dict(costing.macs), costing.other_bytes, result,
                         costing.ops, local)


def _by_kind(tracker) -> dict:
    """MemTracker's snapshot at its peak, summed over devices, by our kinds."""
    kinds = {"PARAM": "parameters", "BUFFER": "parameters", "GRAD": "gradients",
             "OPT": "optimizer", "ACT": "activations", "TEMP": "other", "OTH": "other"}
    out = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "other",
                         "peak"), 0)
    for per_device in tracker.get_tracker_snapshot("peak").values():
        for key, nbytes in per_device.items():
            name = getattr(key, "name", key)
            if name == "Total":
                out["peak"] += nbytes
            elif name in kinds:
                out[kinds[name]] += nbytes
    return out
