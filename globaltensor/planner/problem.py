"""A recorded step as a min-sum problem, and the plan its solution gives.

``plan_step`` turns the calls ``record.py`` recorded into a ``solve.Problem``: per call,
a unary cost per option (boxing the operands made before the step, and compute:
multiply-adds for matrix products, elements written otherwise, so duplicated work is
not free), and per producer/consumer pair a matrix of boxing costs (``plan_route``'s
alpha-beta estimates, priced by ``route_cost`` without making the plans). The solution
gives each call its planned decision and the cache key a replayed call must match.

>>> plan = plan_step(recorded_nodes)        # doctest: +SKIP
>>> plan.planned_cost <= plan.per_op_cost
True
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter

import numpy as np

from ..boxing.plan import forget_searches, route_cost, route_costs
from ..cost import GLOO, costs_of, max_local_bytes, product_macs, returns_view, ring_seconds, writes_nothing
from ..propagation.decide import Decision, _reduced_scalars
from ..propagation.options import Options
from ..sbp import Broadcast, Partial
from . import reuse as remembered
from . import solve

_INFEASIBLE = 1e9


@dataclass
class Node:
    """One recorded call."""
    func: object
    key: tuple                 # its cache key as recorded
    greedy: Decision           # the per-op decision it ran with
    opts: "Options | None"     # its choices (None: the per-op decision only)
    producers: list            # per global input: (node, output index), or None; a
                               # third item True: through a to_global's backward, in
                               # that output's layout with partial axes broadcast
    inputs: list               # per global input: (layout as recorded, itemsize, weight)
    floats: tuple              # the float arguments, when the decision depends on them
    choice: int = 0
    planned: "Decision | None" = None   # None: decided op by op at replay
    expected: tuple = ()       # the cache key replay expects
    sent_bytes: int = 0        # sent while it ran (explain_step counts)
    origin: tuple = ()         # (recording serial, index): what its outputs' origins hold
    in_backward: bool = False  # recorded inside backward (0-d partials stay partial)
    _made: "tuple | None" = field(default=None, repr=False)

    def signatures(self) -> tuple:
        """(input layouts, output layouts as the call's consumers get them) per option:
        outside backward the call reduces a 0-d partial output to broadcast itself
        (``decide._reduced_scalars``: a loss, a count), as it runs."""
        if self.opts is None:
            if self.greedy.inplace and self.greedy.fallback:   # (``decide``: it takes its
                ins = tuple(layout for layout, _, _ in self.inputs)   # operands as they
                return ((ins, ins[:1]),)                       # come, writes the first)
            return ((self.greedy.targets, self.greedy.out_layouts),)
        if self._made is None:
            signatures = self.opts.signatures
            if self.in_backward or not _scalar_outputs(self.opts):
                self._made = tuple(signatures)   # no 0-d output to reduce: most calls
            else:
                self._made = tuple((targets, _as_made(self, outs)) for targets, outs in signatures)
        return self._made

    def reductions(self) -> tuple:
        """Per option: the 0-d partial outputs the call reduces (one collective per
        layout, ``outputs._reduce_together``), or () when it reduces none."""
        if self.opts is None or self.in_backward or not _scalar_outputs(self.opts):
            return ((),) * len(self.signatures())
        out = []
        for _, outs in self.opts.signatures:
            reduced = _reduced_scalars(self.func, list(outs), self.greedy.inplace)
            out.append(tuple(sorted({r for r in reduced if r is not None}, key=repr))
                       if reduced else ())
        return tuple(out)


def _scalar_outputs(opts) -> bool:
    """Whether the call has a 0-d output (every option's outputs have the same shapes):
    only those are reduced as the call makes them (``_reduced_scalars``)."""
    return not opts.signatures or any(o is not None and not o.shape for o in opts.signatures[0][1])


def _as_made(node: Node, outs: tuple) -> tuple:
    if node.in_backward:
        return outs
    reduced = _reduced_scalars(node.func, list(outs), node.greedy.inplace)
    return outs if not reduced else tuple(o if r is None else r.without_partials()
                                          for o, r in zip(outs, reduced))


@dataclass
class StepPlan:
    """A planned step: per call, its decision and the key it must match."""
    nodes: list
    per_op_cost: float         # what the recorded (per-op) choice costs, seconds
    planned_cost: float        # what the plan costs, seconds
    seconds: float             # time taken to plan
    problem: "solve.Problem | None" = None   # kept for explain_step

    @property
    def first_key(self) -> tuple:
        return self.nodes[0].expected


def plan_step(record: list, sinks: tuple = (), pin_grads: tuple = (),
              reuse: bool = True) -> StepPlan:
    """The cheapest signatures for the recorded calls (``solve.py``), as a plan.
    ``sinks``: (call, output index, layout, itemsize, kind) per output of a call boxed
    into that layout outside any call: "gradient", for a leaf of that layout (boxed
    after backward with other gradients in a bucket; None: reduced where it is); "pin",
    the input of a ``to_global``; "held", the input of a ``to_global`` that moved
    nothing when recorded, which keeps that layout. ``pin_grads``: (call, output index,
    (call, output index) or None, layout, itemsize, the ``to_global``'s target) per
    ``to_global`` backward: the gradient (made by that call, else of that layout)
    boxed into the layout of the ``to_global``'s input, partial axes broadcast
    (``pins.py``). ``reuse``: a step planned before in this process takes the choice
    it got then (``reuse.py``; its plan keeps no problem for ``explain_step``)."""
    # Planning allocates hundreds of thousands of small lists (the cost tables), which
    # set off full collections of the program's whole heap: a 12-layer GPT step plans
    # in 0.66-0.70 s with the collector paused, in 0.71-1.00 s with it running. What
    # planning drops is freed by reference counting; cycles wait for the next collection.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(record, sinks, pin_grads, reuse)
    finally:
        forget_searches()   # tens of MiB on a 2-D placement, needed again only to plan
        if enabled:
            gc.enable()


def _plan(record: list, sinks: tuple, pin_grads: tuple, reuse: bool) -> StepPlan:
    key = remembered.key_of(record, sinks, pin_grads) if reuse else None
    found = remembered.recall(key) if key is not None else None
    if found is not None:
        choice, per_op_cost, planned_cost = found
        for node, k in zip(record, choice):
            node.choice = k
        _expect(record)
        return StepPlan(record, per_op_cost, planned_cost, 0.0)
    problem, compute, bucketed, launch = _problem(record, sinks, pin_grads)
    start = [n.opts.greedy if n.opts is not None else 0 for n in record]
    # Communication alone (compute free) gives a second start: the layouts that move
    # the fewest bytes (Megatron's, on a transformer) differ from per-op choice in long
    # chains that no local move flips at once.
    talk = problem.with_unary([[c - w for c, w in zip(costs, work)]
                               for costs, work in zip(problem.unary, compute)])
    seed = solve.propagate(talk, solve.improve(talk, solve.forward_dp(talk)), sweeps=1)
    choice = solve.solve(problem, start, seeds=(seed,))
    total = _with_bucket_launch(problem, bucketed, launch)
    if bucketed and total(choice) > problem.total(choice):
        # The gradient bucket was priced as launched anyway. Where no other gradient
        # needs it (a tensor-parallel step), the choices that fill it pay its launch
        # alone: the same problem with every bucketed reduction paying a launch.
        alone = problem.with_unary([[c + launch * bucketed.get((v, o), 0) for o, c in
                                     enumerate(costs)] for v, costs in enumerate(problem.unary)])
        other = solve.refine(alone, choice)
        choice = min(choice, other, key=total)
    for node, k in zip(record, choice):
        node.choice = k
    _expect(record)
    plan = StepPlan(record, total(start), total(choice), 0.0, problem)
    if key is not None:
        remembered.remember(key, choice, plan.per_op_cost, plan.planned_cost)
    return plan


def _with_bucket_launch(problem: solve.Problem, bucketed: dict, launch: float):
    """The step's cost: ``problem``'s total, plus one ``launch`` of the gradient bucket
    when any chosen option reduces a gradient into it (``bucketed``: {(node, option):
    how many gradients it reduces there})."""
    def total(choice: list) -> float:
        used = any((v, o) in bucketed for v, o in enumerate(choice))
        return problem.total(choice) + (launch if used else 0.0)
    return total


def _compute_seconds(func, targets: tuple, outs: tuple) -> float:
    """The slowest rank's compute for one signature (``cost.Costs.mac`` and
    ``element``: duplicated work is not free). A view writes nothing: priced by its
    elements, a chain of views on a split tensor would look cheaper than the same chain
    on a broadcast one."""
    if writes_nothing(func):
        return 0.0
    layouts = [t for t in (*targets, *outs) if t is not None]
    rates = costs_of(*layouts) if layouts else GLOO
    ranks = targets[0].placement.flat_ranks if targets else ()
    if ranks and product_macs(func, targets, ranks[0]) is not None:
        return (rates.mac * max(product_macs(func, targets, r) for r in ranks)
                + ring_seconds(func, targets))
    return rates.element * sum(max_local_bytes(o, 1) for o in outs if o is not None)


def _route_cost(src, dst, itemsize: int, cache: dict) -> float:
    key = (src, dst, itemsize)
    cost = cache.get(key)
    if cost is None:
        cost = cache[key] = 0.0 if src == dst else route_cost(src, dst, itemsize) + 1e-9
    return cost


def _written_views(record: list) -> set:
    """View calls whose output the step writes in place (directly or through further
    views): boxed anew, such a view would no longer alias its base and the write would
    miss it, so the plan boxes there only where per-op choice does."""
    written = set()
    for node in record:
        if node.greedy.inplace and node.producers and node.producers[0] is not None \
                and len(node.producers[0]) == 2:
            u = node.producers[0][0]
            while u not in written and returns_view(record[u].func):
                written.add(u)
                if not record[u].producers or record[u].producers[0] is None \
                        or len(record[u].producers[0]) > 2:
                    break
                u = record[u].producers[0][0]
    return written


def _sink_cost(src, leaf, itemsize: int, cache: dict, kind: str = "gradient") -> tuple:
    """(boxing a sink into its layout ``leaf``, whether it goes into the bucket).
    ``leaf`` None: its partial sums reduced, where the leaf is not known. A gradient's
    partial sum reduced to broadcast goes into a bucket with other gradients
    (``gradsync``): one launch shared by many, priced once for the step
    (``_with_bucket_launch``). A "held" sink keeps its layout."""
    if kind == "held":
        return (0.0 if src == leaf else _INFEASIBLE), False
    if leaf is None:
        leaf = src.without_partials()
    cost = _route_cost(src, leaf, itemsize, cache)
    if kind == "gradient" and cost and leaf.sbp == tuple(Broadcast() if isinstance(g, Partial)
                                             and g.reduce == "sum" else g for g in src.sbp):
        return max(cost - costs_of(src).launch, 1e-9), True
    return cost, False


def _problem(record: list, sinks: tuple = (), pin_grads: tuple = ()) -> tuple:
    """(the min-sum problem of the recorded calls, each option's compute cost, the
    options that reduce gradients into the bucket: {(node, option): how many}, the
    bucket's launch cost)."""
    written = _written_views(record)
    prices = _Prices()
    unary, edges, compute = [], [], []
    for v, node in enumerate(record):
        sigs = node.signatures()
        costs = prices.compute(node.func, sigs)
        compute.append(list(costs))
        costs = [c + sum(route_cost(r, r.without_partials()) for r in reduced) if reduced
                 else c for c, reduced in zip(costs, node.reductions())]
        inplace = node.greedy.inplace
        greedy = node.opts.greedy if node.opts is not None else 0
        fixed = _INFEASIBLE if v in written else 0.0
        for i, (producer, (layout, size, weight)) in enumerate(zip(node.producers,
                                                                   node.inputs)):
            into = prices.column(sigs, i)
            if producer is None:
                row = prices.matrix((layout,), into, None, size, weight, fixed, greedy)[0]
                costs = [c + r for c, r in zip(costs, row)]
                continue
            u, k = producer[0], producer[1]
            made_as = prices.made_as(record[u], k, len(producer) > 2)
            outs = prices.column(sigs, 0, outs=True) if inplace and i == 0 else None
            edges.append((u, v, prices.matrix(made_as, into, outs, size, weight, fixed,
                                              greedy)))
        unary.append(costs)
    routes = prices.routes
    for u, k, made_by, layout, size, target in pin_grads:
        # where the plan gives the input the target, the to_global moves nothing and has
        # no backward: the gradient goes on as it is, which the calls after it must take
        ins = _made_as(record[u], k)
        into = [o.without_partials() for o in ins]
        price = [[(0.0 if src == dst else _INFEASIBLE) if made == target
                  else _route_cost(src, dst, size, routes) for made, dst in zip(ins, into)]
                 for src in ([layout] if made_by is None else _made_as(record[made_by[0]],
                                                                          made_by[1]))]
        if made_by is None:
            for o, cost in enumerate(price[0]):
                unary[u][o] += cost
            continue
        w = made_by[0]
        edges.append((u, w, [list(r) for r in zip(*price)]) if u < w else (w, u, price))
    bucketed: dict = {}
    launch = 0.0
    for u, k, leaf, size, kind in sinks:
        for o, (_, outs) in enumerate(record[u].signatures()):
            if k < len(outs) and outs[k] is not None:
                cost, in_bucket = _sink_cost(outs[k], leaf, size, routes, kind)
                unary[u][o] += cost
                if in_bucket:
                    bucketed[u, o] = bucketed.get((u, o), 0) + 1
                    launch = max(launch, costs_of(outs[k]).launch)
    problem = solve.Problem(unary, edges)
    for matrix, array in prices.arrays:
        problem.know(matrix, array)
    return problem, compute, bucketed, launch


def _ids(layouts) -> tuple:
    """Layouts by identity, a key cheap to hash: equal layouts are one object
    (``Layout.make`` interns them), and the record holds them while it is planned."""
    return tuple(map(id, layouts))


class _Prices:
    """The prices of one recording, each made once: layers repeat, so most calls
    have the signatures, and most edges the matrix, of a call or an edge before them
    (edges may share one matrix: the solver does not change them)."""

    def __init__(self):
        self.routes: dict = {}     # (src, dst, itemsize) -> boxing cost
        self.computes: dict = {}   # (func, signatures by ids) -> compute cost per option
        self.columns: dict = {}    # id(signatures) -> (signatures, {(i, outs): layouts})
        self.outputs: dict = {}    # (node, k, through) -> its output layout per option
        self.matrices: dict = {}   # what a matrix depends on (by ids) -> the matrix
        self.blocks: dict = {}     # (made_as, into, itemsize) -> route costs, an array
        self.equal: dict = {}      # (made_as, into) -> which pairs are equal layouts
        self.arrays: list = []     # (matrix, the same as an array): the solver's arrays

    def compute(self, func, sigs: tuple) -> list:
        key = (func, tuple(map(len, sigs[0])) if sigs else (),
               _ids(chain.from_iterable(chain.from_iterable(sigs))))
        costs = self.computes.get(key)
        if costs is None:
            costs = self.computes[key] = [_compute_seconds(func, *sig) for sig in sigs]
        return list(costs)

    def column(self, sigs: tuple, i: int, outs: bool = False) -> tuple:
        """Per option: its i-th input layout (``outs``: its i-th output layout)."""
        held = self.columns.get(id(sigs))
        if held is None or held[0] is not sigs:
            held = self.columns[id(sigs)] = (sigs, {})
        found = held[1].get((i, outs))
        if found is None:
            found = held[1][i, outs] = tuple(map(itemgetter(i), map(itemgetter(
                1 if outs else 0), sigs)))
        return found

    def made_as(self, node: Node, k: int, through: bool) -> tuple:
        key = (id(node), k, through)
        found = self.outputs.get(key)
        if found is None:
            found = self.outputs[key] = tuple(_made_as(node, k, through))
        return found

    def matrix(self, made_as: tuple, into: tuple, outs, size: int, weight: float,
               fixed: float, greedy: int) -> list:
        """[producer option][consumer option]: boxing ``made_as`` into ``into`` (times
        ``weight``); infeasible where an in-place call's first operand would not stay
        its output (``outs``); ``fixed`` where an option other than ``greedy`` boxes."""
        key = (_ids(made_as), _ids(into), None if outs is None else _ids(outs), size, weight,
               fixed, greedy if fixed else None)
        found = self.matrices.get(key)
        if found is None:
            # ``_route_cost`` of every pair from the universes' tables at once, then the
            # same float operations in the same order as pair by pair
            same = self.same(made_as, into)
            cost = np.where(same, 0.0, self.costs(made_as, into, size) + 1e-9) * weight
            if outs is not None:
                cost = cost + np.where(self.same(made_as, outs), 0.0, _INFEASIBLE)
            if fixed:
                moves = ~same & (np.arange(len(into)) != greedy)[None, :]
                cost = cost + np.where(moves, fixed, 0.0)
            found = self.matrices[key] = cost.tolist()
            self.arrays.append((found, cost))
        return found

    def costs(self, made_as: tuple, into: tuple, size: int) -> np.ndarray:
        key = (made_as, into, size)
        found = self.blocks.get(key)
        if found is None:
            found = self.blocks[key] = route_costs(made_as, into, size)
        return found

    def same(self, made_as: tuple, into: tuple) -> np.ndarray:
        """[producer option][consumer option]: whether the two layouts are equal."""
        key = (made_as, into)
        found = self.equal.get(key)
        if found is None:
            number: dict = {}
            a = np.array([number.setdefault(x, len(number)) for x in made_as])
            b = np.array([number.setdefault(x, len(number)) for x in into])
            found = self.equal[key] = a[:, None] == b[None, :]
        return found


def _made_as(node: Node, k: int, through: bool = False) -> list:
    """Per option of ``node``: the layout of its k-th output (``through``: as a
    ``to_global``'s backward hands on its gradient, partial axes broadcast)."""
    outs = [outs[k] for _, outs in node.signatures()]
    return [o.without_partials() for o in outs] if through else outs


def _expect(record: list) -> None:
    """Each node's planned decision and the cache key a replayed call must have: the
    recorded key with its operands in the layouts the plan gives them."""
    for node in record:
        sigs = node.signatures()
        targets, outs = sigs[node.choice]
        in_layouts = []
        for producer, (layout, _, _) in zip(node.producers, node.inputs):
            if producer is not None:
                u, k = producer[0], producer[1]
                layout = record[u].signatures()[record[u].choice][1][k]
                if len(producer) > 2:
                    layout = layout.without_partials()
            in_layouts.append(layout)
        node.planned = None if node.opts is None else \
            node.opts.decision(node.choice, tuple(in_layouts))
        node.expected = _key_with(node, in_layouts)


def _key_with(node: Node, in_layouts: list):
    if node.key is None:
        return None
    func, spec, parts = node.key
    parts = list(parts)
    for i, layout in zip(node.greedy.gidx, in_layouts):
        parts[i] = (layout,) + tuple(parts[i][1:])
    return func, spec, tuple(parts)
