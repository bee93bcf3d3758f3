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

- its collectives: kind, bytes this rank sends, the group, the point-to-point messages
  it posts for them (``SimulatedStep.events``);
- its memory at its peak, by kind: torch's ``MemTracker`` on the local parts
  (parameters, gradients, optimizer state, activations, other);
- its compute: multiply-adds of products (mm, bmm, addmm, baddbmm, fused attention) on
  this rank's parts, bytes read and written by the other ops, and the bytes of new
  tensors of ``heap.MAPPED_BYTES`` or more where the program maps host blocks one by
  one (fully_shard on a "cpu" placement: their pages fault in, ``fresh_bytes``);
- an estimated time from a ``DeviceProfile``: products at the profile's rate for
  their dtype, other ops at its memory bandwidth, fresh host blocks at its
  ``fault_seconds`` per byte, each call carried out as the host's
  ``op_seconds`` (overlapping the kernels on a GPU, added to them on a CPU, whose
  ``cores`` a node's ranks share), each collective as its link's launch, the latency
  of its hops (or of each message posted, where point-to-point messages carry it) and
  its bytes over the slowest link its group spans (within a node, across nodes),
  communication in sequence (no overlap counted).

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
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from . import heap, simulated
from .boxing import plan as plans
from .comm import stats
from .comm.stats import CommCounter
from .device_profile import Costing, DeviceProfile, Link, host_op_seconds, profile_of
from .placement import Placement
from .planner import record

aten = torch.ops.aten


def _latency_hops(kind: str, n: int) -> int:
    """Messages in a row a collective of ``n`` members waits for: a ring's n - 1 (an
    all-reduce's 2(n - 1), or a tree's 2 log2 n where that is fewer, as NCCL picks for
    small messages); a send's one."""
    if n <= 1:
        return 1
    if kind == "all_reduce":
        return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
    return n - 1 if kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast") else 1


def collective_seconds(link: Link, kind: str, nbytes: int, members: int,
                       messages: int = 0) -> float:
    """What one collective costs on ``link``: its launch, its messages in a row at the
    link's latency, and the ``nbytes`` this rank sends at its bandwidth. ``messages``:
    the sends and receives this rank posts one by one where point-to-point messages
    stand for the collective (fully_shard's gathers and reductions on gloo), each at
    the latency, as boxing prices a transfer's messages (``cost.Costs.alpha``)."""
    hops = _latency_hops(kind, members) + messages
    return link.launch + hops * link.latency + nbytes / link.bandwidth


@dataclass(frozen=True)
class SimulatedStep:
    """What ``simulate_step`` measured for one rank of the step (module docstring):
    ``counted`` (collectives by kind), ``events`` ((kind, bytes sent, group, messages
    posted one by one) each),
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
    fresh_bytes: int = 0         # of new host blocks whose pages fault in (fully_shard, cpu)

    @property
    def _shared(self) -> float:
        """How many times longer a rank's work takes than on a core of its own (1 where
        each has its own device): ranks beyond the cores take turns, and cores busy at
        once each run at the profile's ``together``."""
        cores, ranks = self.device.cores, self.ranks_per_node
        if cores is None:
            return 1.0
        return max(1.0, ranks / cores) / (self.device.together if min(ranks, cores) > 1 else 1.0)

    @property
    def compute_seconds(self) -> float:
        products = sum(2 * n / self.device.flops(dtype) for dtype, n in self.macs.items())
        faults = self.fresh_bytes * self.device.fault_seconds
        return (products + self.other_bytes / self.device.memory_bandwidth + faults) \
            * self._shared

    @property
    def host_seconds(self) -> float:
        """The host's time for the step's calls (``DeviceProfile.op_seconds``)."""
        each = self.device.op_seconds
        return self.ops * (host_op_seconds() if each is None else each) * self._shared

    @property
    def comm_seconds(self) -> float:
        total = 0.0
        for kind, nbytes, ranks, messages in self.events:
            total += collective_seconds(self.device.link(ranks, self.rank), kind, nbytes,
                                        len(ranks), messages)
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
        tracker, costing = _tracker(MemTracker)(), Costing(rank)
        if tracked:
            tracker.track_external(*tracked)
        with stats.dry_run(events=True) as counted, tracker, costing:
            result = step()
    # (the program maps its large host blocks, as fully_shard on a "cpu" placement does)
    fresh = costing.fresh_bytes if heap.faulting else 0
    return SimulatedStep(world, rank, profile, counted, tuple(counted.events),
                         _by_kind(tracker), dict(costing.macs), costing.other_bytes, result,
                         costing.ops, local, fresh)


def _tracker(base: type) -> type:
    """torch's ``MemTracker``, which hooks the gradients of each module's parameters as
    the module starts, but not of the gathered copies standing in for them there (a
    ``fully_shard`` unit of a call around the module put them in; their gradients go
    to the parts, which it tracks)."""
    class Tracker(base):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            leaves = all(p.is_leaf for p in module.parameters())
            with warnings.catch_warnings():   # (it reads .grad of each: None on a copy)
                warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that "
                                        "is not a leaf")
                return super()._track_module_params_and_buffers(
                    module, install_grad_hooks and leaves)
    return Tracker


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
