"""Pipeline schedules as data: per-worker lists of actions, built by pure functions.

A *worker* is the group of ranks of one stage placement (every rank of a placement runs
the same list). ``stage_worker[k]`` is the worker that runs stage ``k``. A builder
decides the order of the compute actions only (forward and backward of each stage and
micro-batch); ``with_transfers`` adds the point-to-point actions around them:
``recv`` one compute action ahead of the compute that needs it (so the message can
arrive while the previous one runs) and ``send`` right after the compute that
produced it. A new schedule (zero bubble, DualPipe-like) is a new builder, not a new
runtime.

>>> lists = build("1f1b", n_stages=2, n_micro=3, stage_worker=(0, 1))
>>> [str(a) for a in lists[1] if a.kind in ("F", "B")]
['F0.1', 'B0.1', 'F1.1', 'B1.1', 'F2.1', 'B2.1']
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

FORWARD, BACKWARD = "F", "B"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "send_act", "recv_act", "send_grad", "recv_grad"


@dataclass(frozen=True)
class Action:
    """One thing a worker does: ``kind`` on ``stage`` for micro-batch ``mb``.

    ``send_act``/``recv_act`` move stage ``stage``'s output to stage ``stage + 1``;
    ``send_grad``/``recv_grad`` move the gradient of stage ``stage``'s input back to
    stage ``stage - 1`` (named by the stage that sends)."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        if self.kind in (FORWARD, BACKWARD):
            return f"{self.kind}{self.mb}.{self.stage}"
        return f"{self.kind}({self.stage},{self.mb})"


Schedule = tuple  # tuple (one per worker) of tuples of Actions
Builder = Callable[[int, int, Sequence[int]], list]


def _workers(stage_worker: Sequence[int]) -> int:
    return max(stage_worker) + 1


def gpipe(n_stages: int, n_micro: int, stage_worker: Sequence[int]) -> list:
    """All forwards, then all backwards (GPipe). A worker holding several stages runs
    them stage by stage (every micro-batch of its first stage first)."""
    lists = [[] for _ in range(_workers(stage_worker))]
    for k in range(n_stages):
        lists[stage_worker[k]] += [Action(FORWARD, k, i) for i in range(n_micro)]
    for k in reversed(range(n_stages)):
        lists[stage_worker[k]] += [Action(BACKWARD, k, i) for i in range(n_micro)]
    return lists


def one_f_one_b(n_stages: int, n_micro: int, stage_worker: Sequence[int]) -> list:
    """1F1B (PipeDream-flush): stage k runs ``n_stages - k - 1`` warm-up forwards, then
    alternates one forward and one backward, then drains the backwards; at most
    ``n_stages - k`` micro-batches are in flight on stage k (GPipe holds all)."""
    if sorted(stage_worker) != list(range(n_stages)):
        raise ValueError("schedule '1f1b' needs one stage per placement; for several "
                         "stages per placement use 'interleaved_1f1b' or 'gpipe'")
    lists = [[] for _ in range(n_stages)]
    for k in range(n_stages):
        lists[stage_worker[k]] = _one_f_one_b([Action(FORWARD, k, i) for i in range(n_micro)],
                                              [Action(BACKWARD, k, i) for i in range(n_micro)],
                                              n_stages - k - 1)
    return lists


def interleaved_1f1b(n_stages: int, n_micro: int, stage_worker: Sequence[int]) -> list:
    """Interleaved 1F1B (Megatron-LM): ``v`` stages per worker, stage k on worker
    ``k % workers``. Micro-batches go through in rounds of ``workers``: a worker runs
    the round on its first stage, then on its second, ...; backwards mirror that. The
    warm-up is ``2 (workers - w - 1) + (v - 1) workers`` forwards, so the bubble shrinks
    by ``v`` against 1F1B. The last round may be short (any micro-batch count)."""
    g = _workers(stage_worker)
    if n_stages % g or any(w != k % g for k, w in enumerate(stage_worker)):
        raise ValueError(f"schedule 'interleaved_1f1b' needs stage k on placement k % "
                         f"{g} (round robin over {g} placements, the same number of stages "
                         f"each); got stage placements {list(stage_worker)}")
    v = n_stages // g
    rounds = [list(range(s, min(s + g, n_micro))) for s in range(0, n_micro, g)]
    fwd = [[Action(FORWARD, c * g + w, i) for r in rounds for c in range(v) for i in r]
           for w in range(g)]
    bwd = [[Action(BACKWARD, (v - 1 - c) * g + w, i) for r in rounds for c in range(v)
            for i in r] for w in range(g)]
    # Megatron's warm-up assumes full rounds; a short last round can need a longer
    # one (e.g. 4 workers, 3 stages each, 5 micro-batches), found by trying.
    for extra in range(n_micro * v + 1):
        lists = [_one_f_one_b(fwd[w], bwd[w], 2 * (g - w - 1) + (v - 1) * g + extra)
                 for w in range(g)]
        try:
            simulate(with_transfers(lists, stage_worker, n_stages), stage_worker, n_stages,
                     n_micro)
            return lists
        except ValueError:
            continue
    raise AssertionError("unreachable: all-forwards-first never deadlocks")


def _one_f_one_b(fwd: list, bwd: list, warmup: int) -> list:
    """``warmup`` forwards, then one forward and one backward in turn, then the rest."""
    warmup = min(warmup, len(fwd))
    acts = fwd[:warmup]
    for j in range(len(fwd) - warmup):
        acts += [fwd[warmup + j], bwd[j]]
    return acts + bwd[len(fwd) - warmup:]


SCHEDULES: dict[str, Builder] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b,
}


def forward_only(n_stages: int, n_micro: int, stage_worker: Sequence[int]) -> list:
    """The forwards of GPipe (inference: ``pipe(x)``)."""
    return [[a for a in acts if a.kind == FORWARD]
            for acts in gpipe(n_stages, n_micro, stage_worker)]


def with_transfers(compute: list, stage_worker: Sequence[int], n_stages: int) -> Schedule:
    """Add send/recv actions to per-worker compute lists: a ``recv`` one compute action
    ahead of its consumer, a ``send`` right after its producer. Hand-offs between two
    stages of one worker are sends and receives too (the runtime does them locally)."""
    out = []
    for acts in compute:
        full: list = []
        needs = [_incoming(a, n_stages) for a in acts]
        if acts and needs[0]:
            full.append(needs[0])
        for j, a in enumerate(acts):
            if j + 1 < len(acts) and needs[j + 1]:
                full.append(needs[j + 1])  # posted before the compute that precedes it
            full.append(a)
            outgoing = _outgoing(a, n_stages)
            if outgoing:
                full.append(outgoing)
        out.append(tuple(full))
    return tuple(out)


def _incoming(a: Action, n_stages: int) -> Action | None:
    if a.kind == FORWARD and a.stage > 0:
        return Action(RECV_ACT, a.stage - 1, a.mb)
    if a.kind == BACKWARD and a.stage < n_stages - 1:
        return Action(RECV_GRAD, a.stage + 1, a.mb)
    return None


def _outgoing(a: Action, n_stages: int) -> Action | None:
    if a.kind == FORWARD and a.stage < n_stages - 1:
        return Action(SEND_ACT, a.stage, a.mb)
    if a.kind == BACKWARD and a.stage > 0:
        return Action(SEND_GRAD, a.stage, a.mb)
    return None


def build(schedule: str | Builder, n_stages: int, n_micro: int,
          stage_worker: Sequence[int], forward: bool = False) -> Schedule:
    """Per-worker action lists of a named schedule (or a builder function), checked.

    ``forward=True`` gives the forward-only schedule used by ``pipe(x)``."""
    if forward:
        builder = forward_only
    elif callable(schedule):
        builder = schedule
    elif schedule in SCHEDULES:
        builder = SCHEDULES[schedule]
    else:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)} "
                         f"or pass a builder function")
    if n_micro < 1:
        raise ValueError(f"micro_batches must be at least 1, got {n_micro}")
    stage_worker = tuple(stage_worker)
    lists = with_transfers(builder(n_stages, n_micro, stage_worker), stage_worker, n_stages)
    simulate(lists, stage_worker, n_stages, n_micro, forward_only=forward)  # raises if invalid
    return lists


@dataclass(frozen=True)
class Simulation:
    """Unit-cost run of a schedule: per worker, (action, start, end) of compute actions."""

    timeline: tuple
    makespan: float
    bubble: float          # idle fraction of the workers over the makespan
    peak_in_flight: tuple  # per worker: most micro-batches forwarded but not yet backwarded


def simulate(lists: Schedule, stage_worker: Sequence[int], n_stages: int, n_micro: int,
             forward_cost: float = 1.0, backward_cost: float = 2.0,
             forward_only: bool = False) -> Simulation:
    """Run the schedule with fixed costs and free communication. Raises ValueError if a
    compute action is missing, repeated, on the wrong worker, or if the lists deadlock
    (a worker waits for something that only comes after what it waits in)."""
    kinds = (FORWARD,) if forward_only else (FORWARD, BACKWARD)
    wanted = {(kind, k, i) for kind in kinds for k in range(n_stages) for i in range(n_micro)}
    seen = set()
    for w, acts in enumerate(lists):
        for a in acts:
            if a.kind not in (FORWARD, BACKWARD):
                continue
            key = (a.kind, a.stage, a.mb)
            if key not in wanted or key in seen or stage_worker[a.stage] != w:
                raise ValueError(f"schedule: {a} on worker {w} is unexpected or repeated")
            seen.add(key)
    if seen != wanted:
        raise ValueError(f"schedule: missing {sorted(wanted - seen)[:4]}")
    done: dict = {}
    pos, clock = [0] * len(lists), [0.0] * len(lists)
    timeline = [[] for _ in lists]
    flight, peak = [0] * len(lists), [0] * len(lists)
    remaining = sum(len(acts) for acts in lists)
    while remaining:
        progressed = False
        for w, acts in enumerate(lists):
            while pos[w] < len(acts):
                a = acts[pos[w]]
                if a.kind not in (FORWARD, BACKWARD):
                    pos[w] += 1
                    remaining -= 1
                    continue
                deps = [(FORWARD, a.stage - 1, a.mb)] if a.kind == FORWARD and a.stage else []
                if a.kind == BACKWARD:
                    deps.append((FORWARD, a.stage, a.mb))
                    if a.stage < n_stages - 1:
                        deps.append((BACKWARD, a.stage + 1, a.mb))
                if any(d not in done for d in deps):
                    break
                start = max([clock[w]] + [done[d] for d in deps])
                end = start + (forward_cost if a.kind == FORWARD else backward_cost)
                done[(a.kind, a.stage, a.mb)] = clock[w] = end
                timeline[w].append((a, start, end))
                flight[w] += 1 if a.kind == FORWARD else -1
                peak[w] = max(peak[w], flight[w])
                pos[w] += 1
                remaining -= 1
                progressed = True
        if remaining and not progressed:
            stuck = {w: str(acts[pos[w]]) for w, acts in enumerate(lists) if pos[w] < len(acts)}
            raise ValueError(f"schedule deadlocks: workers wait at {stuck}")
    makespan = max(clock) if clock else 0.0
    busy = sum(e - s for tl in timeline for _, s, e in tl)
    bubble = 1 - busy / (makespan * len(lists)) if makespan else 0.0
    return Simulation(tuple(tuple(t) for t in timeline), makespan, bubble, tuple(peak))


@functools.lru_cache(maxsize=64)
def channels(lists: tuple, stage_worker: tuple) -> dict:
    """(sending worker, receiving worker) -> the messages in the order the sender posts
    (``lists``: each worker's actions): receives from one worker are posted in this
    order, since point-to-point messages between two ranks match in posting order."""
    channels: dict = {}
    for w, acts in enumerate(lists):
        for a in acts:
            if a.kind == SEND_ACT:
                dst, key = stage_worker[a.stage + 1], ("act", a.stage, a.mb)
            elif a.kind == SEND_GRAD:
                dst, key = stage_worker[a.stage - 1], ("grad", a.stage, a.mb)
            else:
                continue
            if dst != w:
                channels.setdefault((w, dst), []).append(key)
    for w in range(len(lists)):
        for v in range(len(lists)):
            channels.setdefault((w, v), [])
    return channels
