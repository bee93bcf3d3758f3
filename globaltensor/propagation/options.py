"""Every signature a call's rule allows on its operands, for the whole-step planner
(``planner/``), which chooses among them with the step in view; ``decide.py`` takes the
cheapest for the call alone.

>>> options(aten.mm.default, [x, w], (2, ()), greedy=decision)   # doctest: +SKIP
Options(..., signatures=((...), ...), greedy=0)
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

from torch.utils._python_dispatch import _disable_current_modes

from .. import comm
from ..layout import Layout
from ..rules.registry import lookup
from .call import Call
from .decide import Decision, _call_of, _finish, _meta_run, _MetaRun, _signatures


@dataclass(frozen=True)
class Options:
    """Every valid signature of one call, for a planner that chooses among them with
    the whole step in view (``planner/record.py``); ``greedy`` is the one ``decide``
    takes looking at this call alone."""
    call: Call
    meta: _MetaRun
    local: object
    gidx: tuple
    inplace: bool
    signatures: tuple         # (input layouts, output layouts per output leaf)
    greedy: int

    def decision(self, k: int, in_layouts: tuple) -> Decision:
        """The decision running signature ``k`` on inputs of ``in_layouts``."""
        targets, outs = self.signatures[k]
        return _finish(self.call, self.meta, self.local, self.gidx, targets, list(outs),
                       self.inplace, False, in_layouts)


def options(func, leaves: list, spec, greedy: Decision,
            strided_blocks: tuple = ()) -> "Options | None":
    """Every signature the call's rule allows on these operands (None when it has no
    rule or none fits: the per-op fallback is the only way then); ``strided_blocks``:
    strided splits of these block counts are offered too (``Call.strided_blocks``)."""
    if greedy.fallback:
        return None
    gidx, meta = greedy.gidx, greedy.choice and greedy.choice[0]   # (its meta run)
    if not meta:
        with _disable_current_modes() if comm.tracing() else contextlib.nullcontext():
            meta = _meta_run(func, leaves, spec)
    placement = leaves[gidx[0]].placement
    call = _call_of(func, leaves, spec, gidx, meta, tuple(strided_blocks))
    rule, local = lookup(func)
    found = []
    for targets, outs in _signatures(call, rule, meta, gidx, greedy.inplace, local is None):
        layouts = [None] * len(meta.out_leaves)
        for i, s in zip(meta.out_tensors, outs):
            layouts[i] = Layout.make(meta.out_leaves[i].shape, placement, s)
        found.append((targets, tuple(layouts)))
    chosen = [k for k, (t, _) in enumerate(found) if t == greedy.targets
              and _same_outs(found[k][1], greedy)]
    if not chosen:
        return None
    # Kept past this call: meta tensors only, not the operands.
    call = dataclasses.replace(call, inputs=[meta.leaves[i] for i in gidx], leaves=meta.leaves)
    return Options(call, meta, local, gidx, greedy.inplace, tuple(found), chosen[0])


def _same_outs(layouts: tuple, decision: Decision) -> bool:
    """Whether a signature's output layouts are the decision's (a 0-d output the
    decision reduces at once is compared in the partial layout it is computed in)."""
    reduced = decision.reduced or (None,) * len(layouts)
    return all(l == (o if r is None else r)
               for l, o, r in zip(layouts, decision.out_layouts, reduced))
