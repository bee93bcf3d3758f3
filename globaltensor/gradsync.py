"""Leaf gradients end in the leaf's own layout, reduced lazily and in buckets.

A broadcast parameter used on split data gets a partial_sum gradient. After autograd
accumulates it into ``.grad`` we queue it; once a bucket holds ``BUCKET_MB`` of
gradients of one kind (same placement, dtype and partial axes) it is flattened and
all-reduced asynchronously while backward goes on, the way DDP overlaps. At the end of
backward the last bucket is sent, everything is waited for, and each ``.grad`` becomes
a GlobalTensor with its leaf's placement and sbp. Inside ``no_sync()`` nothing is
reduced: partial gradients accumulate locally across micro-batches and the first
backward outside reduces the total once. The first time a bucket is reduced from a call
path (or gradients are added to kept ones, which all-reduces them outside the buckets),
its ranks meet through the store first (``comm/meet.py``), so a rank that skipped
``backward()`` makes the others fail within GLOBALTENSOR_READ_TIMEOUT, naming it,
instead of waiting GLOBALTENSOR_TIMEOUT in the all-reduce.

>>> import globaltensor as gt
>>> with gt.no_sync():            # doctest: +SKIP
...     loss(micro_batch_1).backward()
>>> loss(micro_batch_2).backward()   # reduces the sum of both, once   # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Iterator

import torch

from . import comm
from .boxing.run import called_from
from .gradient_meet import gradients_meet
from .layout import Layout
from .sbp import Broadcast, Partial
from .tensor import GlobalTensor, hidden_from_dynamo, install_leaf_watch, skipped_by_dynamo, to_layout, wrap_part

BUCKET_MB = 25.0
FIRST_BUCKET_MB = 1.0  # small first bucket: communication starts early in backward

_sync = True
_serial = 0
_pending: "_Reducer | None" = None
# Called as fn(grad, leaf layout) when a gradient not in its leaf's layout reaches
# ``.grad`` (the step planner prices boxing it there: the dispatcher installs it).
_grad_arrived = None


def install_grad_watch(fn) -> None:
    global _grad_arrived
    _grad_arrived = fn


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Skip gradient reduction: partial gradients accumulate locally (no
    communication) until a backward pass outside the context reduces their sum."""
    global _sync
    previous, _sync = _sync, False
    try:
        yield
    finally:
        _sync = previous


class _OwnCopy:
    """Gradient-sync state kept in a leaf's own ``__dict__``, never a weak reference to
    the leaf: ``nn.Module._apply`` (``model.double()``, ``model.cpu()``) swaps a
    GlobalTensor parameter's contents for its cast with ``torch.utils.swap_tensors``,
    which refuses a tensor with weak references. The swap takes the state away with the
    old contents (and their hooks): the cast is watched anew when first used. A copy of
    the leaf (``copy.deepcopy``, pickling) is another leaf: it gets None."""
    __slots__ = ()

    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return type(None), ()


class _Entry(_OwnCopy):
    """A watched leaf's serial number and the flat buffers of the buckets it is first in
    ({bucket key: (flat buffer, its storage's use count alone)}; they die with it)."""
    __slots__ = ("serial", "buffers")

    def __init__(self, serial: int):
        self.serial, self.buffers = serial, {}


_ENTRY, _KEPT = "_gradsync_entry", "_gradsync_kept"
_MODULE_APPLY = torch.nn.Module._apply.__code__


def watch(leaf: GlobalTensor) -> None:
    """Make ``leaf``'s gradient end in its layout (called when a leaf is first used)."""
    global _serial
    if leaf.__dict__.get(_ENTRY) is not None:
        return
    if torch._C._current_graph_task_id() != -1 or comm.tracing() or called_from(_MODULE_APPLY):
        # in backward: a saved view of a parameter, unpacked anew, shows as a leaf (the
        # parameter was first used in forward); traced: a stand-in; cast by model.half()
        # or model.cpu() (nn.Module._apply, which needs no gradient, swaps a parameter
        # for its cast: refused with hooks in between)
        return
    # A serial number, not id(): ids are reused after garbage collection and differ
    # between ranks, while serials follow the program order, the same on every rank.
    _serial += 1
    leaf.__dict__[_ENTRY] = _Entry(_serial)
    if leaf._backward_hooks or leaf._post_accumulate_grad_hooks:
        _reattach_hooks(leaf)
    leaf.register_hook(_before_accumulate(leaf._layout if leaf._layout.placement.size == 1
                                          else None))
    leaf.register_post_accumulate_grad_hook(_after_accumulate)


def _reattach_hooks(leaf: GlobalTensor) -> None:
    """After ``torch.utils.swap_tensors`` (a cast by ``nn.Module._apply``) a leaf's hook
    dicts are still attached to its old contents: a hook added to them would never run.
    Where gradient sync's own hooks show it, they are dropped (they are registered
    anew), and the dicts, with any of the program's hooks, are attached to the current
    contents (their setters do that), so that those run on as on a plain module's cast."""
    pre, post = leaf._backward_hooks or {}, leaf._post_accumulate_grad_hooks or {}
    ours = [k for k, h in pre.items() if getattr(h, "_gradsync", False)]
    if not ours:
        return
    for k in ours:
        del pre[k]
    for k in [k for k, h in post.items() if h is _after_accumulate]:
        del post[k]
    leaf._backward_hooks = pre or None
    leaf._post_accumulate_grad_hooks = post or None


def _hooked_leaf() -> GlobalTensor | None:
    """The leaf whose gradient hook runs: the autograd engine's current node is its
    AccumulateGrad, which holds it (None under compiled autograd). A hook holds no
    reference to its leaf: the collector does not see a tensor's hooks, so a strong one
    would never be freed, and a weak one makes ``torch.utils.swap_tensors`` refuse it."""
    return getattr(torch._C._current_autograd_node(), "variable", None)


_kept_grads: list = []   # open ``grads_kept()``: {id(leaf): (leaf, its .grad before)}


@contextlib.contextmanager
def grads_kept() -> Iterator[None]:
    """Put back, on exit, the ``.grad`` of every watched leaf that a backward inside
    reached (``gt.debug.check_step``: a step on fake tensors leaves no gradient)."""
    _kept_grads.append({})
    try:
        yield
    finally:
        for leaf, grad in _kept_grads.pop().values():
            leaf.grad = grad


def _before_accumulate(mine: Layout | None):
    """A hook that, inside ``no_sync()``, gives a kept ``.grad`` (e.g. zeroed with
    ``zero_grad(set_to_none=False)``) the incoming gradient's partial axes before
    autograd adds to it in place: adding a partial sum to a broadcast ``.grad`` in place
    would all-reduce it at every micro-batch. The other ranks' share of the kept value
    becomes zero (free), and the first backward outside reduces the total once.

    A leaf of a one-rank placement (its layout ``mine``) takes its gradient in that layout
    right away, whatever its sbp (the same part: nothing to reduce or move, in
    ``no_sync()`` either), so that ``_after_accumulate`` has nothing to do: there, cold
    after the backward's kernels, the same re-labelling cost 7 us per parameter."""
    relabelled = [None]   # the last gradient layout found to hold ``mine``'s part

    @skipped_by_dynamo
    def hook(grad):
        if _kept_grads and _hooked_leaf() is not None:
            leaf = _hooked_leaf()
            _kept_grads[-1].setdefault(id(leaf), (leaf, leaf.grad))
        if _sync and _decided_task != torch._C._current_graph_task_id():
            _accumulation_meets(_hooked_leaf(), grad)
        if mine is not None and grad.__class__ is GlobalTensor and grad._layout is not mine:
            if (grad._layout is relabelled[0] or grad._layout.same_parts(mine)) \
                    and not _by_compiled_autograd():   # (which boxes in _after_accumulate)
                relabelled[0] = grad._layout
                return wrap_part(grad._local, mine)
        if _sync:
            return None
        if _by_compiled_autograd() or not isinstance(grad, GlobalTensor):
            return None
        leaf = _hooked_leaf()
        kept = None if leaf is None else leaf.grad
        if not isinstance(kept, GlobalTensor) or kept.placement != grad.placement:
            return None
        sbp = tuple(g if isinstance(g, Partial) and g.reduce == "sum" and isinstance(k, Broadcast)
                    else k for g, k in zip(grad.sbp, kept.sbp))
        if sbp != kept.sbp:
            keep_partial(leaf, to_layout(kept, Layout.make(kept.shape, kept.placement, sbp)))
        return None
    hook._gradsync = True  # not a user's hook (see has_other_hooks)
    return hook


install_leaf_watch(watch)


def keep_partial(leaf: GlobalTensor, partial: GlobalTensor) -> None:
    """Make ``partial`` (the kept ``.grad`` with partial-sum axes, to which local
    contributions are added) ``leaf``'s ``.grad`` until a backward reduces it; then the
    reduced gradient is written back into the kept tensor, which becomes ``.grad``
    again: as in torch, a ``.grad`` kept (e.g. by ``zero_grad(set_to_none=False)``)
    stays the same tensor however many backward passes add to it.

    >>> keep_partial(p, p.grad + contribution)   # doctest: +SKIP
    """
    kept, earlier = leaf.grad, leaf.__dict__.get(_KEPT)
    if earlier is not None and earlier.partial() is kept:  # kept stands in for an earlier one
        leaf.__dict__[_KEPT] = _Kept(earlier.kept, weakref.ref(partial))
    elif isinstance(kept, GlobalTensor) and kept.global_layout == leaf.global_layout:
        leaf.__dict__[_KEPT] = _Kept(weakref.ref(kept), weakref.ref(partial))
    leaf.grad = partial


class _Kept(_OwnCopy):
    """Weak references to a leaf's kept ``.grad`` and the partial ``.grad`` that
    replaced it until the reducing backward (``keep_partial``)."""
    __slots__ = ("kept", "partial")

    def __init__(self, kept: weakref.ref, partial: weakref.ref):
        self.kept, self.partial = kept, partial


def _settle(leaf: GlobalTensor, source: GlobalTensor, grad: GlobalTensor) -> None:
    """``leaf.grad = grad`` (``source`` reduced): into the kept tensor that ``source``
    stood in for, if that is still alive (``keep_partial``)."""
    record = leaf.__dict__.pop(_KEPT, None)
    kept = None if record is None else record.kept()
    if kept is not None and record.partial() is source and kept.dtype == grad.dtype:
        kept.local_part.copy_(grad.local_part)
        grad = kept
    leaf.grad = grad


def has_other_hooks(leaf: torch.Tensor) -> bool:
    """Whether gradient hooks other than ``watch``'s are registered on ``leaf`` (code
    that computes the gradient by other means must then leave it to autograd)."""
    post = [h for h in (getattr(leaf, "_post_accumulate_grad_hooks", None) or {}).values()
            if h is not _after_accumulate]
    pre = [h for h in (getattr(leaf, "_backward_hooks", None) or {}).values()
           if not getattr(h, "_gradsync", False)]
    return bool(post or pre)


def _by_compiled_autograd() -> bool:
    """Whether compiled autograd runs a hook: dynamo traces its graph, and calls the
    hooks, whose frames it skips (``skipped_by_dynamo``, which keeps them eager when
    the autograd engine runs them inside a compiled function), from the compiled graph."""
    if torch.compiler.is_compiling():
        return True
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled_autograd is not None and compiled_autograd.in_compiled_autograd_region


@skipped_by_dynamo
def _after_accumulate(leaf: GlobalTensor) -> None:
    if _by_compiled_autograd():
        # Buckets need the engine's end-of-backward callback, which compiled autograd
        # lacks: the gradient is boxed right away instead.
        return _box_now(leaf)
    grad = leaf.grad   # (fields read directly: this runs for every parameter)
    if not isinstance(grad, GlobalTensor) or not _sync:
        return
    src, dst = grad._layout, leaf._layout
    if _grad_arrived is not None:   # (also in the leaf's layout: a plan may differ)
        _grad_arrived(grad, dst)
    if src == dst:
        return
    if src.same_parts(dst):
        # differs only on axes of one rank (a world of one): nothing to reduce or move
        _settle(leaf, grad, wrap_part(grad._local, dst))
        return
    axes = src.summed_axes_to(dst)
    if axes is None:  # anything but a plain partial-sum reduction: box right away
        _settle(leaf, grad, to_layout(grad, leaf.global_layout))
        return
    global _pending
    if _pending is None:
        _pending = _Reducer()
        torch.autograd.Variable._execution_engine.queue_callback(_finish)
    try:
        _pending.add(leaf, grad, axes)
    except BaseException:
        # A failed backward runs no end-of-backward callback: the next one starts anew.
        _pending = None
        raise


@hidden_from_dynamo
def _box_now(leaf: GlobalTensor) -> None:
    grad = leaf.grad
    if _sync and isinstance(grad, GlobalTensor) and grad.global_layout != leaf.global_layout:
        _settle(leaf, grad, to_layout(grad, leaf.global_layout))


@skipped_by_dynamo
def _finish() -> None:
    global _pending
    reducer, _pending = _pending, None
    if reducer is not None:
        reducer.finish()


def _storage_uses(t: torch.Tensor) -> int:
    """How many tensors (views, aliases) hold ``t``'s memory, ``t`` included."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _flat_buffer(items, serials: tuple) -> torch.Tensor:
    """The bucket's gradients copied once into a flat buffer kept between steps. The
    previous step's ``.grad`` are views into it: the buffer is reused only when none of
    them (nor any other view of it) is alive any more, as after ``zero_grad()`` when no
    one kept a gradient; else the new gradients get new memory, so that a gradient
    a user kept never changes (torch gives every backward after ``set_to_none`` fresh
    gradients; DDP reuses its buckets only with ``gradient_as_bucket_view=True``).
    ``serials``: the leaves' serial numbers."""
    key = tuple((serial, g.local_part.shape, g.dtype) for serial, (_, g) in zip(serials, items))
    owned = items[0][0].__dict__[_ENTRY].buffers   # (kept by the bucket's first leaf)
    flat, alone = owned.get(key, (None, 0))
    if flat is None or _storage_uses(flat) != alone:
        total = sum(g.local_part.numel() for _, g in items)
        flat = torch.empty(total, dtype=items[0][1].dtype, device=items[0][1].local_part.device)
        owned[key] = (flat, _storage_uses(flat))
    offset = 0
    for _, g in items:
        n = g.local_part.numel()
        flat[offset:offset + n].view(g.local_part.shape).copy_(g.local_part)
        offset += n
    return flat


# The order in which the last backward pass produced its gradients, as (leaf serial, kind,
# bytes). Like DDP, the buckets of the next pass are drawn up from it, so a bucket is
# sent the moment its last gradient is ready instead of when the next one overflows it.
_last_order: list = []


def _plan(order) -> dict:
    """leaf serial -> bucket number, filling buckets in gradient order up to the caps."""
    plan, sizes, bucket_of_kind, next_bucket = {}, {}, {}, 0
    for serial, kind, nbytes in order:
        b = bucket_of_kind.get(kind)
        cap = (FIRST_BUCKET_MB if b == 0 else BUCKET_MB) * 2**20
        if b is None or (sizes[b] and sizes[b] + nbytes > cap):
            b = bucket_of_kind[kind] = next_bucket
            next_bucket += 1
            sizes[b] = 0
        plan[serial] = b
        sizes[b] += nbytes
    return plan


# The backward pass (autograd graph task) whose gradients' kind of reduction was seen
# (``_accumulation_meets``): the other gradients of that pass cost one comparison.
_decided_task = -1


def _accumulation_meets(leaf: GlobalTensor | None, grad) -> None:
    """At the first gradient of a backward pass that must be reduced (partial where its
    parameter is broadcast): if the parameter keeps a reduced ``.grad`` from an earlier
    backward (no ``zero_grad()`` in between: gradient accumulation, or
    ``set_to_none=False``), autograd adds the gradient to it with an op that all-reduces
    it, outside the buckets; its ranks meet first, as a bucket's (``gradient_meet.gradients_meet``).
    Without a kept ``.grad`` the gradients go to buckets, which meet when sent. Either
    way the pass's other gradients are not looked at again."""
    global _decided_task
    if leaf is None or not isinstance(grad, GlobalTensor) \
            or not grad.global_layout.summed_axes_to(leaf.global_layout):
        return
    _decided_task = torch._C._current_graph_task_id()
    kept = leaf.grad
    if isinstance(kept, GlobalTensor) and kept.global_layout == leaf.global_layout \
            and not comm.tracing() and not _by_compiled_autograd():
        gradients_meet(leaf.placement, grad.dtype, [(leaf, grad)], (leaf.__dict__[_ENTRY].serial,),
                        " to add them to the kept .grad")


class _Reducer:
    """The buckets of one backward pass."""

    def __init__(self) -> None:
        self.plan = _plan(_last_order)
        self.waiting: dict = {}   # planned bucket -> leaf serials not yet ready
        for serial, b in self.plan.items():
            self.waiting.setdefault(b, set()).add(serial)
        self.planned: dict = {}   # planned bucket -> (kind, items)
        self.open: dict = {}      # kind -> items of gradients the plan did not foresee
        self.size: dict = {}      # kind -> bytes in self.open
        self.sent: list = []      # (kind, items, flat buffer, work)
        self.order: list = []

    def add(self, leaf, grad, axes) -> None:
        kind = (leaf.placement, grad.dtype, axes)
        nbytes = grad.local_part.numel() * grad.element_size()
        serial = leaf.__dict__[_ENTRY].serial
        self.order.append((serial, kind, nbytes))
        b = self.plan.get(serial)
        if b is not None and self.planned.get(b, (kind,))[0] == kind:
            self.planned.setdefault(b, (kind, []))[1].append((leaf, grad))
            self.waiting[b].discard(serial)
            if not self.waiting[b]:
                self._send(kind, self.planned.pop(b)[1])
            return
        self.open.setdefault(kind, []).append((leaf, grad))
        self.size[kind] = self.size.get(kind, 0) + nbytes
        if self.size[kind] >= BUCKET_MB * 2**20:
            self.size.pop(kind)
            self._send(kind, self.open.pop(kind))

    def _send(self, kind, items) -> None:
        placement, dtype, axes = kind
        rank = comm.get_rank()
        if rank not in placement:
            self.sent.append((kind, items, None, None))
            return
        serials = tuple(leaf.__dict__[_ENTRY].serial for leaf, _ in items)
        if not comm.tracing():
            gradients_meet(placement, dtype, items, serials)
        flat = _flat_buffer(items, serials)
        # Several partial axes reduce one after another; the first runs asynchronously.
        work = comm.all_reduce_async(flat, placement.group(rank, axes[0]),
                                     what=f"gradient all-reduce of {len(items)} "
                                          f"parameter(s) on {placement}")
        self.sent.append((kind, items, flat, work))

    def finish(self) -> None:
        global _last_order
        for b in sorted(self.planned):  # buckets whose gradients did not all come
            kind, items = self.planned[b]
            self._send(kind, items)
        for kind in list(self.open):
            self._send(kind, self.open.pop(kind))
        _last_order = self.order
        rank = comm.get_rank()
        for (placement, _, axes), items, flat, work in self.sent:
            if flat is not None:
                work.wait()
                for axis in axes[1:]:
                    comm.all_reduce_(flat, "sum", placement.group(rank, axis))
            offset = 0
            for leaf, grad in items:
                n = grad.local_part.numel()
                local = flat[offset:offset + n].view_as(grad.local_part) if flat is not None \
                    else grad.local_part
                offset += n
                _settle(leaf, grad, GlobalTensor(local, leaf.global_layout))
