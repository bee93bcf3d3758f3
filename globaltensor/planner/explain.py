"""``gt.debug.explain_step``: what the whole-step planner chose for one step, op by op.

Per call: the per-op and the planned signature, what each costs by the cost model, the
bytes the boxings into the call send (estimated from their plans, per-op and planned,
counted as ``comm_stats`` counts them) and the bytes this rank sent for it when it ran
op by op, with the reduction of a 0-d result (a loss); and the totals of each. (The
gradient sync after backward is outside the calls.)

>>> report = gt.debug.explain_step(train_step, x, y)      # doctest: +SKIP
>>> print(report)            # every call: per-op choice vs planned, costs, totals
"""
from __future__ import annotations

from dataclasses import dataclass

from ..boxing.plan import plan_route
from ..comm import stats
from . import record


@dataclass(frozen=True)
class CallChoice:
    """One call of the step: its op, the per-op and the planned signature (input
    sbps -> output sbps), what each costs (seconds, the boxing into the call and its
    compute), the bytes its boxings send per-op and planned (estimated, the busiest
    rank), the bytes this rank sent for it when it ran op by op, and whether it ran in
    backward."""
    index: int
    op: str
    per_op: str
    planned: str
    per_op_cost: float
    planned_cost: float
    sent_bytes: int
    per_op_bytes: int = 0
    planned_bytes: int = 0
    in_backward: bool = False


@dataclass(frozen=True)
class StepReport:
    """The planned step: ``calls`` (CallChoice per call), the totals, the time taken
    to plan, and ``result``, what the function returned. ``str()`` is a table."""
    calls: tuple
    per_op_cost: float
    planned_cost: float
    seconds: float
    result: object = None

    @property
    def per_op_bytes(self) -> int:
        """Bytes the boxings into the calls send op by op (estimated)."""
        return sum(c.per_op_bytes for c in self.calls)

    @property
    def planned_bytes(self) -> int:
        """Bytes the boxings into the calls send as planned (estimated)."""
        return sum(c.planned_bytes for c in self.calls)

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sent for the calls when the step ran op by op (measured)."""
        return sum(c.sent_bytes for c in self.calls)

    @property
    def changed(self) -> tuple:
        """The calls whose planned signature differs from the per-op one."""
        return tuple(c for c in self.calls if c.per_op != c.planned)

    def __str__(self) -> str:
        lines = [f"step of {len(self.calls)} calls, planned in {self.seconds:.3f} s; "
                 f"estimated {self.per_op_cost * 1e3:.3f} ms op by op, "
                 f"{self.planned_cost * 1e3:.3f} ms planned; {len(self.changed)} "
                 f"call(s) changed",
                 f"bytes into calls: {self.per_op_bytes} op by op (estimated; "
                 f"{self.sent_bytes} sent by this rank), {self.planned_bytes} planned",
                 f"{'#':>4}  {'op':<34}{'per-op ms':>10}{'plan ms':>9}{'per-op B':>10}"
                 f"{'plan B':>9}{'sent B':>9}  signature (per-op => planned)"]
        for c in self.calls:
            sig = c.per_op if c.per_op == c.planned else f"{c.per_op} => {c.planned}"
            lines.append(f"{c.index:>4}  {c.op:<34}{c.per_op_cost * 1e3:10.3f}"
                         f"{c.planned_cost * 1e3:9.3f}{c.per_op_bytes:10d}{c.planned_bytes:9d}"
                         f"{c.sent_bytes:9d}  {sig}")
        return "\n".join(lines)

    __repr__ = __str__


def explain_step(fn, *args, **kwargs) -> StepReport:
    """Run ``fn(*args, **kwargs)`` once, op by op, recording it as one step, plan it
    with the whole step in view, and report every call's per-op and planned layouts
    and costs. The plan is kept: a later step of the same program replays it.

    >>> report = gt.debug.explain_step(lambda: model(x).sum().backward())  # doctest: +SKIP
    >>> print(report.per_op_cost, report.planned_cost)
    """
    counter = stats.CommCounter()
    record.start_recording(fn)
    stats.push(counter)
    record.state.sent = counter
    try:
        result = fn(*args, **kwargs)
    finally:
        stats.pop(counter)
        record.state.sent = None
        plan = record.finish_recording()
    if plan is None:
        return StepReport((), 0.0, 0.0, 0.0, result)
    problem = plan.problem
    calls = []
    greedy, planned = (lambda n: n.opts.greedy if n.opts else 0), (lambda n: n.choice)
    for v, node in enumerate(plan.nodes):
        sigs = node.signatures()
        calls.append(CallChoice(
            v, _op_name(node.func), _signature(sigs[greedy(node)]), _signature(sigs[node.choice]),
            _node_cost(problem, plan.nodes, v, greedy), _node_cost(problem, plan.nodes, v, planned),
            node.sent_bytes, _boxed_bytes(plan.nodes, v, greedy), _boxed_bytes(plan.nodes, v, planned),
            node.in_backward))
    return StepReport(tuple(calls), plan.per_op_cost, plan.planned_cost, plan.seconds,
                      result)


def _op_name(func) -> str:
    return str(func).removeprefix("aten.").removesuffix(".default")


def _signature(sig) -> str:
    targets, outs = sig
    show = (lambda layout: ", ".join(map(repr, layout.sbp)) if len(layout.sbp) > 1
            else repr(layout.sbp[0]))
    return (f"({'; '.join(show(t) for t in targets)}) -> "
            f"({'; '.join(show(o) for o in outs if o is not None)})")


def _node_cost(problem, nodes, v: int, pick) -> float:
    cost = problem.unary[v][pick(nodes[v])]
    for k in problem.into[v]:
        u, _, matrix = problem.edges[k]
        cost += matrix[pick(nodes[u])][pick(nodes[v])]
    return cost


def _boxed_bytes(nodes, v: int, pick) -> int:
    """Bytes the boxings into call v send when every call takes option ``pick(node)``
    (its operands as their producers make them, or as recorded when made before the
    step), by their plans (``Step.sent_bytes``)."""
    node = nodes[v]
    targets = node.signatures()[pick(node)][0]
    total = 0
    for producer, (layout, size, _), target in zip(node.producers, node.inputs, targets):
        if producer is not None:
            u, k = producer[0], producer[1]
            layout = nodes[u].signatures()[pick(nodes[u])][1][k]
            if len(producer) > 2:    # through a to_global's backward: partials broadcast
                layout = layout.without_partials()
        if target is not None and layout != target:
            total += plan_route(layout, target, size).sent_bytes()
    dtypes = [d for d in node.greedy.out_dtypes if d is not None]
    size = dtypes[0].itemsize if dtypes else 4
    for reduced in node.reductions()[pick(node)]:   # 0-d results reduced at once (a loss)
        total += plan_route(reduced, reduced.without_partials(), size).sent_bytes()
    return total

