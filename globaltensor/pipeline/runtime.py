"""``Pipeline``: run a schedule's actions on this rank's stage(s).

Every rank runs the same program (SPMD). ``step`` cuts the batch into micro-batches
(every rank takes part, since the batch may live anywhere), learns the layouts of the
hand-offs the first time a micro-batch shape is seen (``_Routes``), and then each rank
runs the action list of its placement: forward and backward of its stages, sends
posted right after the compute that produced them, receives posted ahead of the
compute that needs them. A rank outside every stage returns at once.

Receives from one placement are posted in the order in which that placement sends
(the schedule is data, so each rank knows the other lists): point-to-point messages
between two ranks match in posting order, on gloo as on NCCL.
"""
from __future__ import annotations

import contextlib
import functools
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .. import comm, origins
from ..gradsync import no_sync
from ..layout import Layout, balanced_split
from ..local_parts import empty_local
from ..placement import Placement
from ..planner.record import paused
from ..random import get_draw
from ..sbp import broadcast
from ..tensor import GlobalTensor, from_local_part
from . import schedule as S
from .handoff import Handoff
from .microbatch import agree_on_batches, batch_rows, cut_micro_batches, describe
from .plain_stage import PlainStage, agrees, runs_locally
from .timeline import Timeline


@dataclass(frozen=True)
class _Routes:
    """The layouts of one micro-batch shape: each stage's input and output, the loss,
    and the hand-offs forward (stage k -> k + 1) and backward (gradient k -> k - 1)."""

    ins: tuple
    outs: tuple
    loss: Layout | None
    dtype: torch.dtype  # of the last stage's output
    loss_dtype: "torch.dtype | None"   # of the loss (fp32 under autocast, say)
    forward: tuple   # forward[k]: Handoff of stage k's output to stage k + 1's input
    backward: tuple  # backward[k]: Handoff of stage k's input gradient to stage k - 1
    local: frozenset  # the stages this rank runs on plain tensors (see plain_stage.py)
    local_loss: bool  # and the loss, after a last stage in ``local``


def _stage_placement(stage: torch.nn.Module, k: int) -> Placement:
    placements = set()
    for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
        if not isinstance(t, GlobalTensor):
            raise ValueError(f"stage {k}: {name} is not global; place the stage first, e.g. "
                             f"gt.nn.to_global(stage, placement, sbp)")
        placements.add(t.placement)
    if not placements:
        raise ValueError(f"stage {k} has no parameters or buffers, so it has no placement; "
                         f"merge it into a neighbouring stage")
    if len(placements) > 1:
        raise ValueError(f"stage {k} holds tensors on several placements "
                         f"{sorted(map(str, placements))}; a stage lives on one placement")
    return placements.pop()


class Pipeline:
    """Pipeline-parallel training over stages that are already global.

    >>> pipe = gt.pipeline.Pipeline([stage0, stage1], micro_batches=4,   # doctest: +SKIP
    ...                             schedule="1f1b", loss_fn=F.cross_entropy)
    >>> loss = pipe.step(x, target); opt.step()                          # doctest: +SKIP
    >>> y = pipe(x)                                                       # doctest: +SKIP

    ``input_sbp`` (optional) gives per stage the sbp of its input (None: stage 0 keeps
    the batch's sbp, or broadcast for a plain tensor; stage k > 0 keeps stage k - 1's
    output sbp with partial axes made broadcast). ``target_sbp`` likewise for targets.
    """

    def __init__(self, stages: Sequence[torch.nn.Module], micro_batches: int = 1,
                 schedule: str | Callable = "1f1b", loss_fn: Callable | None = None, *,
                 input_sbp: Sequence | None = None, target_sbp=None):
        stages = list(stages)
        if not stages or not all(isinstance(s, torch.nn.Module) for s in stages):
            raise ValueError("stages must be a non-empty list of nn.Modules")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        if input_sbp is not None and len(input_sbp) != len(stages):
            raise ValueError(f"input_sbp has {len(input_sbp)} entries for {len(stages)} stages")
        self.stages, self.micro_batches, self.loss_fn = stages, micro_batches, loss_fn
        self.placements = [_stage_placement(s, k) for k, s in enumerate(stages)]
        workers: list[Placement] = []
        for k, p in enumerate(self.placements):
            for q in workers:
                if p != q and set(p.flat_ranks) & set(q.flat_ranks):
                    raise ValueError(f"stage {k}'s placement {p} overlaps {q} without being "
                                     f"equal; stages share ranks only by sharing a placement")
            if p not in workers:
                workers.append(p)
        self.workers = workers
        self._ranks = tuple(sorted({r for p in workers for r in p.flat_ranks}))
        self.stage_worker = tuple(workers.index(p) for p in self.placements)
        n = len(stages)
        self.schedule = schedule
        # compared among the ranks before each run's hand-offs (agree_on_batches)
        self._shape = (micro_batches, n, zlib.crc32(getattr(schedule, "__name__",
                                                            str(schedule)).encode()))
        self._lists = {True: S.build(schedule, n, micro_batches, self.stage_worker),
                       False: S.build(schedule, n, micro_batches, self.stage_worker,
                                      forward=True)}
        self._input_sbp = list(input_sbp) if input_sbp is not None else [None] * n
        self._target_sbp = target_sbp
        rank = comm.get_rank()
        self.worker = next((w for w, p in enumerate(workers) if rank in p), None)
        self._local = {k: PlainStage(s, self.placements[k]) for k, s in enumerate(stages)
                       if runs_locally(s, self.placements[k], rank)}
        self._routes: dict = {}
        self.last_timeline = Timeline()

    # --- public -------------------------------------------------------------------
    def step(self, x, target) -> GlobalTensor:
        """Forward and backward of every micro-batch in schedule order; parameter
        ``.grad`` accumulates the gradient of the whole batch's loss. Returns that loss,
        broadcast on every rank of the pipeline (each reads it without communication)."""
        if self.loss_fn is None:
            raise ValueError("Pipeline.step needs a loss_fn")
        return self._run(x, target, train=True)

    @torch.no_grad()
    def __call__(self, x) -> GlobalTensor:
        """Forward only (no gradients), micro-batched: the last stage's output for the
        whole batch, concatenated along dim 0."""
        return self._run(x, None, train=False)

    def timeline(self, path: str | None = None, title: str | None = None):
        """When each action of the last ``step`` or call ran on each rank; with ``path``,
        rank 0 writes a PNG (ranks x time). A collective: call it on every rank."""
        events = self.last_timeline.gather()
        if path is not None and comm.get_rank() == 0:
            Timeline.plot(events, path, title or f"{self.schedule}, {len(self.stages)} stages, "
                                                  f"{self.micro_batches} micro-batches")
        return events

    # --- steps --------------------------------------------------------------------
    def _run(self, x, target, train: bool):
        # Stages run per micro-batch and must give one layout for all: op-by-op choice.
        with paused():
            return self._run_micro_batches(x, target, train)

    def _run_micro_batches(self, x, target, train: bool):
        m = self.micro_batches
        rows = batch_rows(x), batch_rows(target) if train else None  # tensors with a batch dim
        # Before anything that depends on this rank's batch: one shape on every rank
        if comm.get_rank() in self._ranks:
            agree_on_batches(self._ranks, (x, target), self._shape)
        if train and rows[1] != rows[0]:
            raise ValueError(f"target has {rows[1]} rows, the batch {rows[0]}")
        sizes = [size for _, size in balanced_split(rows[0], m)]
        if min(sizes) == 0:
            raise ValueError(f"a batch of {batch_rows(x)} rows cannot make {m} micro-batches")
        with torch.no_grad():
            xs = cut_micro_batches(x, sizes, self.placements[0], self._input_sbp[0])
            ts = (cut_micro_batches(target, sizes, self.placements[-1], self._target_sbp)
                  if train else None)
        routes = [self._routes_for(xs[i], ts[i] if train else None) for i in range(m)]
        self.last_timeline = Timeline()
        if self.worker is not None:
            run = _Run(self, routes, xs, ts, [s / sum(sizes) for s in sizes], train)
            run.execute(self._lists[train][self.worker])
            results = run.results
        else:
            results = None
        if train:
            self._grads_outside_stages()
            layout = routes[-1].loss  # the summed loss; ranks without it build its metadata
            if comm.get_rank() in layout.placement:
                loss = functools.reduce(torch.add, results)
            else:
                loss = GlobalTensor(empty_local(layout, routes[-1].loss_dtype), layout)
            self._same_origins([loss] + [p.grad for s in self.stages for p in s.parameters()])
            # to every rank of the pipeline, so that each can read it without
            # communication: `if rank == 0: log(loss.item())` with rank 0 in stage 0
            everyone = Placement(layout.placement.type, list(self._ranks))
            return loss.to_global(everyone, broadcast)
        outs = results if results is not None and comm.get_rank() in self.placements[-1] \
            else [GlobalTensor(empty_local(r.outs[-1], r.dtype), r.outs[-1])
                  for r in routes]
        self._same_origins(outs)
        return outs[0] if m == 1 else torch.cat(outs, dim=0)

    @staticmethod
    def _same_origins(tensors) -> None:
        """Check mode: what a step leaves (loss, outputs, gradients) was computed on some
        ranks and stood in for on the others; it counts as made by the step's line on
        every rank (origins.py), or later boxings of it would differ by origin alone."""
        if comm.check_mode():
            for t in tensors:
                if isinstance(t, GlobalTensor):
                    origins.made_by_program(t)

    def _grads_outside_stages(self) -> None:
        """On a rank outside a stage, give its trainable parameters the ``.grad`` that a
        backward without pipeline leaves there: a GlobalTensor in the parameter's layout
        with an empty part. The code that follows a step (``clip_grad_norm_`` over every
        stage, optimizers, ``zero_grad``, checkpoints) then runs the same on every rank."""
        rank = comm.get_rank()
        for stage, placement in zip(self.stages, self.placements):
            if rank in placement:
                continue
            for p in stage.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = GlobalTensor(empty_local(p.global_layout, p.dtype), p.global_layout)

    def _routes_for(self, x0: GlobalTensor, t0) -> _Routes:
        """Layouts of every hand-off for this micro-batch shape: learnt once by running
        the stages on it one after another on every rank (stage members compute, the
        others only derive metadata), without gradients and restoring buffers."""
        key = (x0.global_layout, x0.dtype, None if t0 is None else (t0.global_layout, t0.dtype))
        routes = self._routes.get(key)
        if routes is not None:
            return routes
        ins, outs, local, local_loss, h = [], [], set(), False, x0
        dtypes, loss_dtype = [], None   # each stage's output's; the loss's
        with torch.no_grad(), _buffers_kept(self.stages):
            for k, stage in enumerate(self.stages):
                if k:
                    h = h.to_global(self.placements[k], self._in_sbp(k, h.global_layout))
                ins.append(h.global_layout)
                inp, draws = h, get_draw()
                h = stage(h)
                if not isinstance(h, GlobalTensor) or h.placement != self.placements[k]:
                    raise ValueError(f"stage {k} must return one GlobalTensor on its own "
                                     f"placement {self.placements[k]}, got {describe(h)}")
                outs.append(h.global_layout)
                dtypes.append(h.dtype)
                if k in self._local:
                    plain = get_draw() == draws and \
                        self._local[k].agrees(inp.local_part, h.local_part)
                    if self._agreed(k, plain):
                        local.add(k)
            loss = None
            if t0 is not None:
                value = self.loss_fn(h, t0)
                if not isinstance(value, GlobalTensor) or value.numel() != 1:
                    raise ValueError(f"loss_fn must return a one-element GlobalTensor, got "
                                     f"{describe(value)}")
                loss, loss_dtype = (value * 1.0).global_layout, value.dtype
                last = self._local.get(len(self.stages) - 1)
                local_loss = last is not None and not last.shared and \
                    len(self.stages) - 1 in local and get_draw() == draws and \
                    agrees(self.loss_fn, (h.local_part, t0.local_part), value.local_part)
        # (each hand-off in its own dtype: under autocast, or a stage that casts, the
        # stages' outputs and the loss differ)
        forward = tuple(Handoff(outs[k], ins[k + 1], dtypes[k],
                                f"pipeline hand-off: stage {k} output to stage {k + 1}")
                        for k in range(len(outs) - 1))
        backward = (None,) + tuple(
            Handoff(ins[k].without_partials(), outs[k - 1].without_partials(), dtypes[k - 1],
                    f"pipeline hand-off: stage {k} input gradient to stage {k - 1}")
            for k in range(1, len(ins)))
        routes = self._routes[key] = _Routes(tuple(ins), tuple(outs), loss, h.dtype, loss_dtype,
                                             forward, backward, frozenset(local), local_loss)
        return routes

    def _agreed(self, k: int, plain: bool) -> bool:
        """``plain`` on every member of stage k (a data-parallel stage's members must
        all take the same path: the global one may communicate)."""
        if not self._local[k].shared:
            return plain
        votes = comm.all_gather_ints([int(plain)], self.placements[k].flat_ranks)
        return all(v for (v,) in votes)

    def _in_sbp(self, k: int, prev: Layout):
        if self._input_sbp[k] is not None:
            return self._input_sbp[k]
        placement = self.placements[k]
        if placement.ndim != prev.placement.ndim:
            return (broadcast,) * placement.ndim
        return prev.without_partials().sbp


class _Run:
    """One execution of a worker's action list."""

    def __init__(self, pipe: Pipeline, routes, xs, ts, shares, train: bool):
        self.pipe, self.routes, self.xs, self.ts = pipe, routes, xs, ts
        self.shares, self.train = shares, train
        self.last = len(pipe.stages) - 1
        self.mailbox: dict = {}   # ("act"|"grad", sending stage, mb) -> pending hand-off
        self.held: dict = {}      # (stage, mb) -> (input leaf, output or weighted loss)
        self.sends: dict = {}     # ("act"|"grad", stage, mb) -> posted send
        self.results: list = [None] * len(xs)
        self.plain: set = set()   # stages run on plain tensors in this step
        self.last_backward: dict = {}  # stage -> its last micro-batch in this step
        self.rank = comm.get_rank()

    def execute(self, actions) -> None:
        lists = self.pipe._lists[self.train]
        me = self.pipe.worker
        self.channels = S.channels(lists, self.pipe.stage_worker)
        self.posted = {c: 0 for c in self.channels}
        last_backward = {a.stage: a.mb for a in actions if a.kind == S.BACKWARD}
        timeline = self.pipe.last_timeline
        mine = {a.stage for a in actions}
        self.last_backward = last_backward
        self.plain = {k for k, stage in self.pipe._local.items()
                      if k in mine and self.pipe._agreed(k, stage.refresh())}
        for a in actions:
            self.started = time.time()  # moved past any wait for a message
            if a.kind == S.FORWARD:
                self._forward(a.stage, a.mb)
            elif a.kind == S.BACKWARD:
                with contextlib.nullcontext() if last_backward[a.stage] == a.mb else no_sync():
                    self._backward(a.stage, a.mb)
            elif a.kind in (S.SEND_ACT, S.SEND_GRAD):
                self._send(a)
            else:
                self._post_receives(a, me)
            timeline.record(self.rank, a, self.started, time.time())
            self._reap()
        for work in self.sends.values():
            work.wait()
        for k in self.plain:
            if not self.pipe._local[k].shared:
                self.pipe._local[k].flush_grads()

    # --- compute ------------------------------------------------------------------
    def _wait(self, key) -> torch.Tensor:
        t0 = time.time()
        local = self.mailbox.pop(key).wait()
        self.started = time.time()
        self.pipe.last_timeline.record_wait(self.rank, key, t0, self.started)
        return local

    def _forward(self, k: int, i: int) -> None:
        routes = self.routes[i]
        leaf = None
        if k > 0:
            leaf = self._wait(("act", k - 1, i)).detach().requires_grad_(self.train)
        plain = k in routes.local and k in self.plain and not self._syncs(k, i)
        if plain:  # tensors in and out
            out = self.pipe._local[k](self.xs[i].local_part if k == 0 else leaf)
            found = (tuple(out.shape), out.dtype)
            expected = (routes.outs[k].local_shape(self.rank),
                        routes.dtype if k == self.last else found[1])
        else:
            out = self.pipe.stages[k](self.xs[i] if k == 0 else from_local_part(leaf, routes.ins[k]))
            found, expected = out.global_layout, routes.outs[k]
        if found != expected:
            raise RuntimeError(f"stage {k} returned {found} for micro-batch {i}, but "
                               f"{expected} for the first of its shape")
        if k == self.last and self.train and plain and routes.local_loss:
            out = self.pipe.loss_fn(out, self.ts[i].local_part) * self.shares[i]
            self.results[i] = from_local_part(out.detach(), routes.loss)
        elif k == self.last:
            if not isinstance(out, GlobalTensor):
                out = from_local_part(out, routes.outs[k])
            if self.train:
                out = self.pipe.loss_fn(out, self.ts[i]) * self.shares[i]
                self.results[i] = out.detach()
            else:
                self.results[i] = out
        self.held[(k, i)] = (leaf, out)

    def _syncs(self, k: int, i: int) -> bool:
        """Whether micro-batch i is the last of data-parallel stage k: it runs global,
        and its backward reduces the gradients of every micro-batch."""
        return self.train and self.pipe._local[k].shared and self.last_backward[k] == i

    def _backward(self, k: int, i: int) -> None:
        leaf, out = self.held.pop((k, i))
        if k in self.plain and self._syncs(k, i):
            self.pipe._local[k].hand_over(self.routes[i].ins[k])
        if k == self.last:
            torch.autograd.backward(out)
        else:
            sent = self.sends.pop(("act", k, i), None)
            if sent is not None:
                sent.wait()  # the next stage used it: the gradient came back
            grad = self._wait(("grad", k + 1, i))
            if isinstance(out, GlobalTensor):
                grad = GlobalTensor(grad, out.global_layout.without_partials())
            torch.autograd.backward(out, grad)
        if leaf is not None:
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            self.held[("grad", k, i)] = g

    # --- communication --------------------------------------------------------------
    def _send(self, a: S.Action) -> None:
        if a.kind == S.SEND_ACT:
            key, handoff = ("act", a.stage, a.mb), self.routes[a.mb].forward[a.stage]
            leaf, out = self.held[(a.stage, a.mb)]
            if not self.train:
                self.held.pop((a.stage, a.mb))
            local = (out.local_part if isinstance(out, GlobalTensor) else out).detach()
        else:
            key, handoff = ("grad", a.stage, a.mb), self.routes[a.mb].backward[a.stage]
            local = self.held.pop(("grad", a.stage, a.mb))
        work = handoff.send(local)
        if handoff.local:
            self.mailbox[key] = work
        else:
            self.sends[key] = work

    def _post_receives(self, a: S.Action, me: int) -> None:
        kind, sender = ("act", a.stage) if a.kind == S.RECV_ACT else ("grad", a.stage)
        src = self.pipe.stage_worker[sender]
        if src == me:
            return  # a local hand-off: its send puts it in the mailbox
        channel = self.channels[(src, me)]
        key = (kind, a.stage, a.mb)
        while key not in self.mailbox:  # post in the sender's order, up to this one
            kind_j, stage, mb = channel[self.posted[(src, me)]]
            self.posted[(src, me)] += 1
            routes = self.routes[mb]
            handoff = routes.forward[stage] if kind_j == "act" else routes.backward[stage]
            self.mailbox[(kind_j, stage, mb)] = handoff.receive()

    def _reap(self) -> None:
        done = [key for key, work in self.sends.items() if key[0] == "grad"
                and work.is_completed()]
        for key in done:
            self.sends.pop(key).wait()


@contextlib.contextmanager
def _buffers_kept(stages):
    """Restore every buffer (batch-norm statistics) of ``stages`` on exit."""
    kept = [(b, b.local_part.clone() if isinstance(b, GlobalTensor) else b.clone())
            for s in stages for b in s.buffers()]
    try:
        yield
    finally:
        for b, value in kept:
            (b.local_part if isinstance(b, GlobalTensor) else b).copy_(value)


__all__ = ["Pipeline"]
