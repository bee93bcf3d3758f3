"""``gt.nn.MoE``: a mixture-of-experts feed-forward layer with its experts split across
ranks (expert parallel; on a 2-D placement data x expert: the experts split on the
second axis, copied on the first, tokens routed within each row).

Every expert weight is one parameter with a leading expert dimension (``w1``: experts x
dim x hidden, ``w2``: experts x hidden x dim) laid out ``split(0)``: each rank of the
placement holds ``experts / n`` whole experts. Tokens stay split on dim 0 (data
parallel). A token goes to the ranks holding its top-k experts and comes back by two
all-to-alls of data-dependent sizes (the per-expert counts are exchanged first, one
all-gather of integers), differentiable: backward is the reverse all-to-all.

Tokens beyond an expert's capacity are dropped by a rule that does not depend on the
number of ranks (global token order), so the layer on n ranks equals the same layer on
plain tensors in one process, which is the reference the tests compare against.

>>> layer = gt.nn.MoE(16, 32, experts=4, placement=gt.placement.all("cpu"))  # doctest: +SKIP
>>> y = layer(x)                 # x: (tokens, 16) or (batch, seq, 16), split(0)  # doctest: +SKIP
>>> layer.aux_loss, layer.last_dropped                                       # doctest: +SKIP
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from .. import comm
from ..factory import tensor as global_tensor
from ..placement import Placement
from ..sbp import Split, broadcast, partial_sum, split
from ..tensor import GlobalTensor, from_local_part
from .module import to_global

__all__ = ["MoE"]

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


class _Exchange(torch.autograd.Function):
    """All-to-all of rows: ``send_rows[i]`` rows of ``send`` go to member ``i``,
    ``recv_rows[j]`` arrive from member ``j``; backward sends the gradients back the same
    way reversed."""

    @staticmethod
    def forward(ctx, send: torch.Tensor, send_rows: list, recv_rows: list, ranks: tuple):
        ctx.rows, ctx.ranks = (send_rows, recv_rows), ranks
        return _all_to_all(send, send_rows, recv_rows, ranks)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_rows, recv_rows = ctx.rows
        return _all_to_all(grad, recv_rows, send_rows, ctx.ranks), None, None, None


def _all_to_all(send: torch.Tensor, send_rows: list, recv_rows: list,
                ranks: tuple) -> torch.Tensor:
    width = send.shape[1]
    out = send.new_empty(sum(recv_rows), width)
    # splits in elements of the flattened rows: what comm.all_to_all_single counts
    comm.all_to_all_single(out.view(-1), send.contiguous().view(-1),
                           [r * width for r in recv_rows], [r * width for r in send_rows],
                           ranks)
    return out


class MoE(torch.nn.Module):
    """Top-k mixture of ``experts`` SiLU (or GELU) feed-forward experts of width
    ``hidden`` with a linear router, the experts split(0) over ``placement`` (None: a
    plain layer; ``gt.nn.to_global(model, p, MoE.expert_sbp(model))`` lays it out later).
    Each expert takes at most ``ceil(capacity_factor * tokens * top_k / experts)``
    tokens (tokens: the global count); later ones (in global token order) are dropped
    from that expert. After each forward: ``aux_loss`` (the Switch/GShard load-balancing
    loss, differentiable, equal on every rank) and ``last_dropped`` (token-expert
    assignments dropped, global).

    >>> layer = gt.nn.MoE(8, 16, experts=4, top_k=2)      # plain, one process
    >>> layer(torch.randn(5, 8)).shape
    torch.Size([5, 8])
    """

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int = 2,
                 capacity_factor: float = 1.25, placement: Placement | None = None,
                 activation: str = "silu"):
        super().__init__()
        _check_config(dim, hidden, experts, top_k, capacity_factor, activation)
        if placement is not None:
            _check_placement(placement, experts)
        self.dim, self.hidden, self.experts, self.top_k = dim, hidden, experts, top_k
        self.capacity_factor, self.activation = capacity_factor, activation
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = torch.nn.Parameter(torch.empty(experts, hidden, dim))
        self.reset_parameters()
        self._last = _LastForward()
        self.last_dropped = 0
        if placement is not None:
            to_global(self, placement, MoE.expert_sbp(self, placement=placement))

    @property
    def aux_loss(self) -> "torch.Tensor | None":
        """The load-balancing loss of the last forward (None before one).

        >>> layer(x); loss = loss + 0.01 * layer.aux_loss    # doctest: +SKIP
        """
        return self._last.aux_loss

    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear`` initialises its weights (uniform, +-1/sqrt(fan
        in)); the router too. Works on global parameters (placement-invariant values).

        >>> gt.nn.MoE(8, 16, experts=4).reset_parameters()
        """
        self.router.reset_parameters()
        torch.nn.init.uniform_(self.w1, -self.dim ** -0.5, self.dim ** -0.5)
        torch.nn.init.uniform_(self.w2, -self.hidden ** -0.5, self.hidden ** -0.5)

    @staticmethod
    def expert_sbp(model: torch.nn.Module, default=broadcast,
                   placement: Placement | None = None) -> Callable:
        """The ``sbp`` callable for ``gt.nn.to_global(model, ...)``: split(0) for the
        expert weights of every MoE in ``model`` (expert parallel), ``default`` for every
        other tensor. On a 2-D ``placement`` (data x expert) the experts split on its
        second axis and are copied on its first: ``(broadcast, split(0))``.

        >>> gt.nn.to_global(model, p, gt.nn.MoE.expert_sbp(model))     # doctest: +SKIP
        >>> gt.nn.to_global(model, grid, gt.nn.MoE.expert_sbp(model, placement=grid))  # doctest: +SKIP
        """
        experts = {id(t) for m in model.modules() if isinstance(m, MoE)
                   for t in (m.w1, m.w2)}
        ndim = 1 if placement is None else placement.ndim
        split_experts = (broadcast,) * (ndim - 1) + (split(0),)
        other = default if ndim == 1 or isinstance(default, tuple) else (default,) * ndim

        def choose(name: str, t: torch.Tensor):
            if id(t) in experts:
                return split_experts if ndim > 1 else split(0)
            return other
        return choose

    def capacity(self, tokens: int) -> int:
        """Assignments each expert takes when ``tokens`` tokens (global) come in.

        >>> gt.nn.MoE(8, 16, experts=4, top_k=2, capacity_factor=1.0).capacity(10)
        5
        """
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., dim): a GlobalTensor on a 1-D placement (best split(0), else it
        is boxed there and back) when the weights are global, a plain tensor when they
        are not. Returns the combined expert outputs in ``x``'s layout.

        >>> gt.nn.MoE(8, 16, experts=4)(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
        """
        self._check_input(x)
        if not isinstance(x, GlobalTensor):
            probs = F.softmax(self.router(x), dim=-1)
            return self._route(x, probs, self.w1, self.w2, (0,), 0,
                               math.prod(x.shape[:-1]))
        return self._global_forward(x)

    def _check_input(self, x: torch.Tensor) -> None:
        # every check before any communication: bad input raises on every rank alike
        if x.dim() < 2 or x.shape[-1] != self.dim:
            raise ValueError(f"MoE: input of shape {tuple(x.shape)}: need (..., {self.dim})"
                             f" with at least 2 dims")
        weights_global = isinstance(self.w1, GlobalTensor)
        if isinstance(x, GlobalTensor) != weights_global:
            raise ValueError("MoE: the input is " + ("" if isinstance(x, GlobalTensor)
                             else "not ") + "a GlobalTensor but the expert weights are "
                             + ("" if weights_global else "not ") + "global; make both "
                             "global (MoE(..., placement=p) or gt.nn.to_global) or neither")
        if weights_global:
            _check_placement(x.placement, self.experts)
            if self.w1.placement != x.placement:
                raise ValueError(f"MoE: input on {x.placement} but experts on "
                                 f"{self.w1.placement}")

    def _global_forward(self, x: GlobalTensor) -> GlobalTensor:
        place = x.placement
        tokens_sbp = (Split(0),) * place.ndim   # tokens over every rank, in rank order
        xs = x if x.sbp == tokens_sbp else x.to_global(sbp=tokens_sbp)
        probs = F.softmax(self.router(xs), dim=-1)            # global ops
        if probs.sbp != tokens_sbp:     # the ops' rules may choose another layout
            probs = probs.to_global(sbp=tokens_sbp)
        w1, w2 = (_local_experts(w, place) for w in (self.w1, self.w2))
        ranks, rank = place.flat_ranks, comm.get_rank()
        member = rank in place
        tokens = math.prod(x.shape[:-1])
        local = xs.to_local()
        group = place.group(rank, place.ndim - 1) if member else ranks   # its expert axis
        out = self._route(local, probs.to_local(), w1, w2, ranks,
                          ranks.index(rank) if member else -1, tokens, probs, group)
        y = from_local_part(out, xs._layout)   # (its layout is known: no shape exchange)
        return y if x.sbp == tokens_sbp else y.to_global(sbp=x.sbp)

    def _route(self, x: torch.Tensor, probs: torch.Tensor, w1: torch.Tensor,
               w2: torch.Tensor, ranks: tuple, me: int, tokens: int,
               global_probs: torch.Tensor | None = None,
               group: tuple = (0,)) -> torch.Tensor:
        """This rank's output rows: ``x``/``probs`` its local rows, ``w1``/``w2`` its
        experts, ``me`` its index in ``ranks`` (every rank holding tokens, in token
        order; -1: not a member, nothing to route), ``group`` the ranks among which its
        tokens meet their experts (the expert axis: one copy of every expert)."""
        shape, flat = x.shape, x.reshape(-1, self.dim)
        probs = probs.reshape(-1, self.experts)
        top, chosen = probs.topk(self.top_k, dim=-1)
        gates = (top / top.sum(-1, keepdim=True)).reshape(-1)
        expert = chosen.reshape(-1)                  # assignment order = token order
        token = torch.arange(flat.shape[0], device=x.device).repeat_interleave(self.top_k)
        counts = torch.bincount(expert, minlength=self.experts)
        rows = _gather_counts(counts.tolist(), ranks, me)
        plan = _Plan(rows, me, self.capacity(tokens), self.experts,
                     [ranks.index(r) for r in group])
        self.last_dropped = plan.dropped
        self._set_aux_loss(plan.totals, tokens, probs if global_probs is None
                           else global_probs, global_probs is not None)
        if me < 0:
            return x.new_zeros(shape)
        order = torch.sort(expert, stable=True).indices   # by expert, token order within
        sorted_expert = expert[order]
        start = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=x.device) - start[sorted_expert]
        offset = torch.tensor(plan.offsets[me], device=x.device)
        kept = order[position + offset[sorted_expert] < plan.capacity]
        sent = flat[token[kept]]
        if len(group) > 1:
            sent = _Exchange.apply(sent, plan.send_rows(), plan.recv_rows(), tuple(group))
        done = self._experts(sent, plan, w1, w2)
        if len(group) > 1:
            done = _Exchange.apply(done, plan.recv_rows(), plan.send_rows(), tuple(group))
        # (in the input's dtype: under autocast the experts' products and the gates
        # come in bf16, and a rank outside the placement returns zeros of x's dtype)
        out = flat.new_zeros(flat.shape).index_add(
            0, token[kept], (done * gates[kept].unsqueeze(1)).to(flat.dtype))
        return out.reshape(shape)

    def _experts(self, received: torch.Tensor, plan: "_Plan", w1: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
        """Each local expert on its rows of ``received`` (grouped by source member, then
        expert), results in the same rows."""
        act, device = _ACTIVATIONS[self.activation], received.device
        mine = plan.local_experts()
        starts, at = {}, 0      # (source, expert) -> first row, in the order received
        for q in plan.group:
            for e in mine:
                starts[q, e] = at
                at += plan.kept[q][e]
        chunks, perm = [], []
        for j, e in enumerate(mine):
            # one expert's rows from every source in member order: global token order,
            # as the one-process layer sees them (the same matmul rows)
            idx = torch.cat([torch.arange(starts[q, e], starts[q, e] + plan.kept[q][e],
                                          device=device) for q in plan.group])
            perm.append(idx)
            chunks.append(act(received[idx] @ w1[j]) @ w2[j])
        if not chunks:
            return received
        inverse = torch.argsort(torch.cat(perm))
        return torch.cat(chunks)[inverse]

    def _set_aux_loss(self, totals: list, tokens: int, probs: torch.Tensor,
                      is_global: bool) -> None:
        # Switch/GShard: experts * sum_e f_e * P_e; f_e (no gradient) the share of all
        # assignments routed to e, P_e the mean router probability (differentiable)
        share = torch.tensor(totals, dtype=probs.dtype,
                             device=None if is_global else probs.device) / max(tokens * self.top_k, 1)
        if is_global:
            share = global_tensor(share, placement=probs.placement,
                                  sbp=(broadcast,) * probs.placement.ndim)
        mean_prob_times_f = (probs * share).sum() / max(tokens, 1)
        self._last.aux_loss = mean_prob_times_f * self.experts


class _LastForward:
    """What the last forward left for the caller (its aux loss, a tensor in that
    forward's graph). A copy of the layer starts without it: ``copy.deepcopy`` refuses
    tensors that are not graph leaves, and models are copied (``auto_parallel`` tries
    candidates on copies)."""

    def __init__(self):
        self.aux_loss = None

    def __deepcopy__(self, memo) -> "_LastForward":
        return _LastForward()


def _gather_counts(counts: list, ranks: tuple, me: int) -> list:
    """Every member's per-expert assignment counts, in member order."""
    if me < 0 or len(ranks) == 1:
        return [counts] if me >= 0 else [[0] * len(counts)] * len(ranks)
    return comm.all_gather_ints(counts, ranks, same_length=True)


class _Plan:
    """Who keeps and sends what, the same on every member: from the per-member counts
    ``rows`` (members x experts, every rank holding tokens), each expert keeps its first
    ``capacity`` assignments in global token order (members in order), ``kept[q][e]``
    of them from member ``q``. Tokens travel within ``group`` (the members, by index,
    of this rank's expert axis; all of them on a 1-D placement), whose k-th member
    holds the k-th share of the experts."""

    def __init__(self, rows: list, me: int, capacity: int, experts: int,
                 group: "list | None" = None):
        self.members, self.me, self.capacity, self.experts = len(rows), me, capacity, experts
        self.group = list(range(self.members)) if group is None else group
        self.per_member = experts // len(self.group)
        running = [0] * experts
        self.offsets, self.kept = [], []
        for row in rows:
            self.offsets.append(list(running))
            self.kept.append([max(0, min(c, capacity - before)) for c, before in
                              zip(row, running)])
            running = [a + c for a, c in zip(running, row)]
        self.totals = running
        self.dropped = sum(max(0, t - capacity) for t in running)

    def local_experts(self) -> range:
        return self._owned(self.group.index(self.me))

    def _owned(self, position: int) -> range:
        return range(position * self.per_member, (position + 1) * self.per_member)

    def send_rows(self) -> list:
        """Rows this member sends each member of its group (its kept assignments to
        their experts)."""
        return [sum(self.kept[self.me][e] for e in self._owned(k))
                for k in range(len(self.group))]

    def recv_rows(self) -> list:
        """Rows this member receives from each member of its group (for its experts)."""
        return [sum(self.kept[q][e] for e in self.local_experts()) for q in self.group]


def _local_experts(weight, placement: Placement) -> torch.Tensor:
    """This rank's experts of an expert weight as a plain tensor: split(0) on the
    expert (last) axis, broadcast on a data axis before it, whose ranks each compute
    with their own tokens (so the gradient comes back partial there). A weight in
    another layout is boxed to that one first (broadcast weights: every rank stores
    every expert; correct, not expert parallel)."""
    want = (broadcast,) * (placement.ndim - 1) + (Split(0),)
    if weight.sbp != want:
        weight = weight.to_global(sbp=want)
    if placement.ndim == 1:
        return weight.to_local()
    return weight.to_local(grad_sbp=(partial_sum,) * (placement.ndim - 1) + (Split(0),))


def _check_config(dim, hidden, experts, top_k, capacity_factor, activation) -> None:
    for name, value in (("dim", dim), ("hidden", hidden), ("experts", experts),
                        ("top_k", top_k)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"MoE: {name} must be a positive int, got {value!r}")
    if top_k > experts:
        raise ValueError(f"MoE: top_k={top_k} is more than experts={experts}")
    if not capacity_factor > 0:
        raise ValueError(f"MoE: capacity_factor must be > 0, got {capacity_factor!r}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"MoE: activation {activation!r} is not one of "
                         f"{sorted(_ACTIVATIONS)}")


def _check_placement(placement: Placement, experts: int) -> None:
    if not isinstance(placement, Placement):
        raise ValueError(f"MoE: placement must be a gt.placement, got {placement!r}")
    if placement.ndim not in (1, 2):
        raise ValueError(f"MoE: needs a 1-D placement (experts and tokens split on one "
                         f"axis) or a 2-D one (data x expert), got {placement} of shape "
                         f"{placement.shape}")
    n = placement.shape[-1]   # the expert axis
    if experts % n:
        raise ValueError(f"MoE: {experts} experts do not divide evenly over the {n} ranks "
                         f"of {placement}'s expert axis; use a multiple of {n} experts")
