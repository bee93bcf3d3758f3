"""``gt.debug.explain_step``: what the whole-step planner chose for one step, op by op.

>>> report = gt.debug.explain_step(train_step, x, y)      # doctest: +SKIP
>>> print(report)            # every call: per-op choice vs planned, costs, totals
"""
from __future__ import annotations

from dataclasses import dataclass

from ..comm import stats
from . import record


@dataclass(frozen=True)
class CallChoice:
    """One call of the step: its op, the per-op and the planned signature (input
    sbps -> output sbps), what each costs (seconds, the boxing into the call and its
    compute) and the bytes this rank sent for it when it ran op by op."""
    index: int
    op: str
    per_op: str
    planned: str
    per_op_cost: float
    planned_cost: float
    sent_bytes: int


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
    def changed(self) -> tuple:
        """The calls whose planned signature differs from the per-op one."""
        return tuple(c for c in self.calls if c.per_op != c.planned)

    def __str__(self) -> str:
        lines = [f"step of {len(self.calls)} calls, planned in {self.seconds:.3f} s; "
                 f"estimated {self.per_op_cost * 1e3:.3f} ms op by op, "
                 f"{self.planned_cost * 1e3:.3f} ms planned; {len(self.changed)} "
                 f"call(s) changed",
                 f"{'#':>4}  {'op':<34}{'per-op ms':>10}{'plan ms':>9}{'sent B':>9}  "
                 f"signature (per-op => planned)"]
        for c in self.calls:
            sig = c.per_op if c.per_op == c.planned else f"{c.per_op} => {c.planned}"
            lines.append(f"{c.index:>4}  {c.op:<34}{c.per_op_cost * 1e3:10.3f}"
                         f"{c.planned_cost * 1e3:9.3f}{c.sent_bytes:9d}  {sig}")
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
    for v, node in enumerate(plan.nodes):
        start = node.opts.greedy if node.opts is not None else 0
        sigs = node.signatures()
        calls.append(CallChoice(
            v, _op_name(node.func), _signature(sigs[start]), _signature(sigs[node.choice]),
            _node_cost(problem, plan.nodes, v, lambda n: n.opts.greedy if n.opts else 0),
            _node_cost(problem, plan.nodes, v, lambda n: n.choice), node.sent_bytes))
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
