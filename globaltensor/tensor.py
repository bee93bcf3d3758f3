"""GlobalTensor: a torch.Tensor whose value is global, held in parts across ranks.

It is a wrapper subclass: the wrapper carries the global shape and dtype (autograd
sees global values), ``_local`` is this rank's part, ``_layout`` says which part.
Ops reach ``__torch_dispatch__``, which hands them to the dispatcher (``dispatch/``
installs itself here, keeping imports pointing downward).

Making and moving GlobalTensors inside the package (users call ``gt.from_local``,
``gt.tensor`` and ``x.to_global``):

* ``GlobalTensor(part, layout)``: around this rank's part, no autograd edge;
  ``wrap_part`` is the same for code already hidden from dynamo (dispatch, rules);
* ``from_local_part(t, layout)``: around this rank's part, differentiable in ``t``;
* ``from_full(value, layout)``: from the whole value, which every rank holds;
* ``to_layout(x, layout)`` (or ``sbp=``): boxed, not recorded by autograd;
  ``boxing.run.box`` moves a bare local part between layouts.

>>> import globaltensor as gt
>>> x = gt.ones(4, 2, placement=gt.placement.all("cpu"), sbp=gt.sbp.split(0))
>>> x.to_global(sbp=gt.sbp.broadcast).to_local().shape
torch.Size([4, 2])
"""
from __future__ import annotations

import functools
import hashlib
import sys
from collections.abc import Callable

import torch

from . import comm, explicit_mode, modes, origins, retrace
from .boxing.run import box
from .layout import Layout
from .local_parts import device_of, empty_local, empty_part_of
from .partials import local_part
from .placement import Placement, check_placement
from .sbp import broadcast

_dispatcher = None  # set by dispatch.py
_watch_leaf = None  # gradsync.watch, set by gradsync.py

__all__ = ["GlobalTensor", "is_global", "hidden_from_dynamo", "skipped_by_dynamo", "wrap_part", "wrapping",
           "wrap_as", "from_local_part", "from_full", "to_layout", "install_dispatcher", "install_leaf_watch",
           "install_methods"]


def install_dispatcher(fn) -> None:
    global _dispatcher
    _dispatcher = fn


def install_leaf_watch(fn) -> None:
    global _watch_leaf
    _watch_leaf = fn


def install_methods(**methods: Callable) -> None:
    """Make each function a method of GlobalTensor: the one way the modules above this
    one (which it must not import) give it theirs: reads (``reads.py``), raw-memory
    refusals (``nn/state.py``), DCP's protocol and pickling (``interop/dcp.py``),
    ``to_dtensor`` (``interop/dtensor.py``).

    >>> install_methods(item=lambda self: whole_value(self, "x.item()").item())  # doctest: +SKIP
    """
    for name, fn in methods.items():
        setattr(GlobalTensor, name, fn)


_make_wrapper = torch.Tensor._make_wrapper_subclass


def hidden_from_dynamo(fn):
    """``torch._disable_dynamo(fn)``, which imports dynamo (about 0.9 s) at its first
    call, but calling ``fn`` as it is while dynamo is not imported: nothing can be
    compiling then, and a process that never compiles never pays for the import."""
    disabled = torch._disable_dynamo(fn)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if "torch._dynamo" in sys.modules:
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


try:  # torch >= 2.7 lets code be marked for dynamo's frame evaluation
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    _SKIP_RECURSIVELY = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
except ImportError:
    _SKIP_RECURSIVELY = None


def skipped_by_dynamo(fn: Callable) -> Callable:
    """``fn``, which torch's runtime calls (``__torch_dispatch__``, AOTAutograd's
    flatten and unflatten, autograd hooks and backward functions), with its frame and
    every frame it calls skipped by dynamo, as dynamo skips torch's own files.

    Code run eagerly inside a compiled function (after a graph break, such as ``loss.backward()`` in a
    compiled train step) runs with dynamo's frame callback set: dynamo would compile our runtime's
    frames as if they were the user's, and break it (resuming ``_wrap`` after ``_make_wrapper_subclass``
    with a GlobalTensor that has no part yet). The mark costs nothing per call (``hidden_from_dynamo``'s
    wrapper costs about 0.5 us, too much for every op). Dynamo does not trace into ``fn`` either:
    compiled autograd calls gradient sync's hooks from its compiled graph
    (``gradsync._by_compiled_autograd``). Before torch 2.7, which cannot mark code, ``fn`` is hidden as
    ``torch._disable_dynamo`` hides it."""
    if _SKIP_RECURSIVELY is None:
        return torch._disable_dynamo(fn)
    set_code_exec_strategy(fn.__code__, _SKIP_RECURSIVELY)
    return fn


class GlobalTensor(torch.Tensor):
    """A global tensor: global shape/dtype, a placement, an nd-sbp, a local part."""

    _local: torch.Tensor
    _layout: Layout
    # _origin: the recorded call that made it (planner/record.py); _digest: its origin
    # in check mode (origins.py)
    __slots__ = ("_local", "_layout", "_key", "_origin", "_digest")

    # Construction and the conversions are hidden from dynamo (as DTensor's constructor
    # is): dynamo inlining them baked shape-dependent decisions into graphs reused for
    # other shapes. Dynamo keeps such a call as one node (or breaks the graph, across
    # placements); AOTAutograd then traces it, and every op's dispatch, on fake parts.
    @staticmethod
    @hidden_from_dynamo
    def __new__(cls, local: torch.Tensor, layout: Layout, requires_grad: bool = False,
                strides: tuple | None = None):
        # ``strides`` are global strides (contiguous unless given). Dispatch passes those
        # of the op's meta output, so that a transpose looks transposed to autograd (mm's
        # backward then computes a transposed weight's gradient in the weight's memory
        # order). They must not come from the local part: those differ between ranks,
        # and autograd would then take different paths on different ranks.
        return _wrap(cls, local, layout, requires_grad, strides)

    # --- metadata ----------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        return self._layout.placement

    @property
    def sbp(self) -> tuple:
        return self._layout.sbp

    @property
    def is_global(self) -> bool:
        return True

    @property
    def global_layout(self) -> Layout:
        """The (shape, placement, sbp) triple, for internal use and debugging."""
        return self._layout

    @property
    def local_part(self) -> torch.Tensor:
        """This rank's part as stored, for internal use: unlike ``to_local()`` it adds
        no autograd edge (empty outside the placement)."""
        return self._local

    def __repr__(self, *, tensor_contents=None) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (f"GlobalTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"placement={self.placement}, sbp={self.sbp}, "
                f"local_shape={tuple(self._local.shape)}{grad})")

    # --- conversions (all differentiable) -------------------------------------------
    @hidden_from_dynamo
    def to_global(self, placement: Placement | None = None, sbp=None) -> "GlobalTensor":
        """Redistribute to ``placement`` / ``sbp`` (None keeps the current one).

        >>> y = x.to_global(sbp=gt.sbp.broadcast)      # doctest: +SKIP
        """
        placement = self.placement if placement is None else check_placement(placement)
        if sbp is None:
            if placement.ndim != self.placement.ndim:
                raise ValueError(f"the new placement has {placement.ndim} axis(es), the old "
                                 f"{self.placement.ndim}: give an sbp for it")
            sbp = self.sbp
        return _moved(self, Layout.make(self.shape, placement, sbp), "x.to_global()")

    @hidden_from_dynamo
    def to_local(self, grad_sbp=None) -> torch.Tensor:
        """This rank's part, plain (none outside the placement); its gradient comes back
        in ``grad_sbp`` (DTensor's ``grad_placements``; default: this sbp, partial made broadcast)."""
        return _ToLocal.apply(self, grad_sbp)

    @hidden_from_dynamo
    def full(self) -> torch.Tensor:
        """The whole value as a plain tensor on every rank of the world (a collective)."""
        everyone = Placement(self.placement.type, list(range(comm.get_world_size())))
        return _moved(self, Layout.make(self.shape, everyone, (broadcast,)), "x.full()").to_local()

    # Reads (item, tolist, numpy, f"{x:.4f}"), the refusal of raw memory (storage,
    # data_ptr), pickling, DCP's protocol and ``to_dtensor`` are installed
    # (``install_methods``) by reads.py, nn/state.py, interop/dcp.py, interop/dtensor.py.

    # --- traceable-subclass protocol: torch.compile sees the local part as the tensor ----
    @skipped_by_dynamo
    def __tensor_flatten__(self):
        # The local part of a graph input keeps static sizes (a layout holds concrete
        # shapes; the guard on it recompiles for a new one), as mark_static would make
        # it, instead of dims made dynamic after a recompile.
        local = self._local
        if not hasattr(local, "_dynamo_static_indices"):
            local._dynamo_static_indices = set(range(local.dim()))
        if self.requires_grad and self.is_leaf:
            # A compiled graph flattens its inputs on every call and its ops never reach
            # dispatch, where eager code meets a parameter first: gradient sync is set
            # up here instead.
            _watch_leaf(self)
        return ["_local"], (self._layout, self.requires_grad, retrace.current)

    @classmethod
    def __metadata_guard__(cls, saved, now) -> bool:
        # dynamo's guard on a graph input: its layout, and no plan made since the graph
        # was traced that would trace it differently (retrace.py)
        return saved[:2] == now[:2] and retrace.guard(saved[2])

    @staticmethod
    @skipped_by_dynamo
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        layout, requires_grad, _ = ctx
        strides = tuple(outer_stride)
        return _wrap(GlobalTensor, inner["_local"], layout, requires_grad,
                     None if strides == layout.strides else strides)

    def _stable_hash_for_caching(self) -> str:
        # torch.compile's cache key for this input: the same on every run and process.
        # It holds the rank: a graph traced on one rank holds that rank's part offsets
        # and groups, and ranks share the cache directory. A graph traced while step
        # plans are made is not taken from AOTAutograd's cache: its trace is what gets
        # recorded and planned, and the plans (not the inputs) decide its collectives.
        # Inductor's own cache of the traced graph still applies.
        if retrace.planning:
            from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache
            raise BypassAOTAutogradCache("globaltensor plans the steps of traced graphs")
        layout = self._layout
        key = repr((comm.get_rank(), layout.shape, layout.placement, layout.sbp, self.dtype,
                    tuple(self.stride()), tuple(self._local.shape), self.requires_grad))
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    @skipped_by_dynamo
    def __coerce_tangent_metadata__(self):
        # The gradient torch.compile plans for an output: where eager backward puts it.
        return to_layout(self, self._layout.without_partials())

    @skipped_by_dynamo
    def __coerce_same_metadata_as_tangent__(self, ctx, expected_type=None):
        # A gradient that arrives at a compiled backward in another layout than planned.
        if expected_type is not None and expected_type is not GlobalTensor:
            return None
        return to_layout(self, ctx[0])

    # No Python __torch_function__ (as DTensor): with one, every op and every property
    # access (x.shape, x.grad) would enter Python once more (about 2x the dispatch cost).
    # The few functions that need handling above dispatch are wrapped instead
    # (``interop/torch_patches.py``).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    @skipped_by_dynamo
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if _dispatcher is None:
            raise RuntimeError("globaltensor.dispatch is not loaded; import globaltensor")
        return _dispatcher(func, types, args, kwargs or {})


_STRIDED = torch.strided


def _wrap(cls, local: torch.Tensor, layout: Layout, requires_grad: bool = False,
          strides: tuple | None = None) -> GlobalTensor:
    """``GlobalTensor(local, layout)`` without the constructor's dynamo guard (about a
    microsecond per call): dispatch, itself hidden from dynamo, builds every op's outputs
    with it."""
    dtype = local.dtype
    # Positional (size, strides, storage_offset, memory_format, dtype, layout, device,
    # pin_memory, requires_grad), no strides where contiguous (torch computes
    # layout.strides itself): keywords cost a third more.
    r = _make_wrapper(cls, layout.shape, strides, None, None, dtype, _STRIDED,
                      device_of(layout.placement), False, requires_grad)
    r._local = local
    r._layout = layout
    r._key = (layout, dtype) if strides is None else (layout, dtype, strides)  # cache key
    if modes.checking:  # check mode: where it was made (dispatch re-stamps an op's outputs)
        origins.made_by_program(r)
    return r


def wrapping(layout: Layout, dtype: torch.dtype, strides: tuple | None = None) -> tuple:
    """What ``wrap_as`` needs to wrap a part of ``layout`` and ``dtype`` (``strides``:
    global, None when contiguous), looked up once: a cached decision keeps one per
    output, so that a repeated call's wrapping reads no layout."""
    return (layout.shape, strides, dtype, device_of(layout.placement), layout,
            (layout, dtype) if strides is None else (layout, dtype, strides))


def wrap_as(local: torch.Tensor, how: tuple) -> GlobalTensor:
    """``wrap_part`` with ``how = wrapping(layout, dtype, strides)`` (dispatch's)."""
    shape, strides, dtype, device, layout, key = how
    if local.dtype is not dtype:   # (the default dtype changed since the decision)
        return _wrap(GlobalTensor, local, layout, False, strides)
    r = _make_wrapper(GlobalTensor, shape, strides, None, None, dtype, _STRIDED, device)
    r._local = local
    r._layout = layout
    r._key = key
    if modes.checking:
        origins.made_by_program(r)
    return r


def wrap_part(local: torch.Tensor, layout: Layout, strides: tuple | None = None) -> GlobalTensor:
    """``GlobalTensor(local, layout)`` for code already hidden from dynamo (dispatch, rules
    running inside it): no autograd edge, ``local`` trusted to be this rank's part.

    >>> out = wrap_part(torch.matmul(a_part, b_part), out_layout)      # doctest: +SKIP
    """
    return _wrap(GlobalTensor, local, layout, False, strides)


def is_global(t) -> bool:
    """True for a GlobalTensor, False for a plain tensor."""
    return isinstance(t, GlobalTensor)


# The dispatcher's step planner watches every ``to_global`` (``planner/pins.py``):
# forward(x, dst) -> a link or None, backward(out, grad, link) -> out, and
# unmoved(x, dst) for one that moves nothing (and returns ``x``).
_pin_watch = None


def install_pin_watch(forward, backward, unmoved) -> None:
    global _pin_watch
    _pin_watch = (forward, backward, unmoved)


def _moved(x: GlobalTensor, dst: Layout, call: str) -> GlobalTensor:
    """``x`` in layout ``dst``, differentiably, for the program's ``call`` ("x.to_global()",
    "x.full()"), whose ranks meet the first time it moves data from a call path (so a
    target that differs between ranks fails fast: ``boxing.run.boxing_meets``)."""
    if dst == x._layout:
        if _pin_watch is not None:
            _pin_watch[2](x, dst)
        return x
    if explicit_mode.active() and not explicit_mode.called_by_program():
        call = None   # the library's own to_global (an op's decomposition): not written
    return _ToGlobal.apply(x, dst, call)


class _ToGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor, dst: Layout, call: str):
        ctx.src = x._layout
        ctx.link = None if _pin_watch is None else _pin_watch[0](x, dst)
        return GlobalTensor(box(x._local, x._layout, dst, why=_boxing_of(x), call=call), dst)

    @staticmethod
    @skipped_by_dynamo  # the autograd engine calls it
    def backward(ctx, grad):
        # Partial axes become broadcast: every addend of a sum has the sum's gradient,
        # so each rank holds it whole. Boxing it back to a partial would be correct too,
        # but the next backward ops would then produce (and later reduce) full-size
        # partials.
        with explicit_mode.written():   # the backward of a to_global the program wrote
            out = to_layout(grad, ctx.src.without_partials())
        if ctx.link is not None:
            out = _pin_watch[1](out, grad, ctx.link)
        return out, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor, sbp=None):   # (the gradient's, to_local's grad_sbp)
        # An addend's gradient is the whole sum's on each rank (``_FromLocal``'s too):
        # labelled partial, it would be counted once per rank.
        ctx.layout = x._layout.without_partials() if sbp is None else Layout.make(x.shape, x.placement, sbp)
        return x._local.view_as(x._local)

    @staticmethod
    @skipped_by_dynamo  # the autograd engine calls it
    def backward(ctx, grad):
        return GlobalTensor(grad, ctx.layout), None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, layout: Layout):
        ctx.layout = layout
        return GlobalTensor(t.view_as(t), layout)

    @staticmethod
    @skipped_by_dynamo  # the autograd engine calls it
    def backward(ctx, grad):
        return to_layout(grad, ctx.layout.without_partials())._local, None


def to_layout(x, layout: Layout | None = None, donate: bool = False, *, sbp=None,
              placement: Placement | None = None) -> GlobalTensor:
    """``x`` boxed to ``layout`` (or to ``sbp`` on ``placement``, by default ``x``'s),
    not recorded by autograd: for gradients, which arrive in any layout, and code below
    autograd (decompositions inside dispatch). ``donate``: ``x`` is a temporary no one
    else holds, whose memory boxing may reuse.

    >>> total = to_layout(partial_norm, sbp=gt.sbp.broadcast)   # doctest: +SKIP
    """
    if not isinstance(x, GlobalTensor):
        raise TypeError(f"expected a GlobalTensor, got {type(x).__name__}")
    if layout is None:
        layout = Layout.make(x.shape, x.placement if placement is None else placement, sbp)
    if x._layout == layout:
        return x
    if x._layout.same_parts(layout):   # nothing moves: the same part, relabelled
        return GlobalTensor(x._local, layout)
    return GlobalTensor(box(x._local, x._layout, layout, donate, _boxing_of(x)), layout)


def _boxing_of(x: GlobalTensor) -> str:
    """How a boxing of ``x`` is named; in check mode with ``x``'s origin, so that ranks
    boxing different tensors from one line are told apart (origins.py)."""
    return f"to_global of origin {origins.of(x):08x}" if comm.check_mode() else "to_global"


def from_local_part(t: torch.Tensor, layout: Layout, requires_grad: bool = False
                    ) -> GlobalTensor:
    """A GlobalTensor around ``t``, this rank's part of ``layout`` (trusted, unlike
    ``gt.from_local``'s), differentiable in ``t``; any rank may call it (outside the
    placement ``t`` is replaced by an empty part).

    >>> out = from_local_part(torch.softmax(scores_part, -1), layout)   # doctest: +SKIP
    """
    if comm.get_rank() not in layout.placement:
        t = empty_part_of(t, layout)
    if t.requires_grad:
        return _FromLocal.apply(t, layout)
    return GlobalTensor(t, layout, requires_grad=requires_grad)


def from_full(value: torch.Tensor, layout: Layout, requires_grad: bool = False) -> GlobalTensor:
    """A GlobalTensor of ``value``, the same whole value on every rank (the inverse of
    ``x.full()``); each rank keeps its part. No autograd edge to ``value``.

    >>> ids = from_full(torch.arange(8), Layout.make((8,), p, (split(0),)))  # doctest: +SKIP
    """
    rank = comm.get_rank()
    if rank in layout.placement:
        local = local_part(value, layout, rank).to(device_of(layout.placement))
    else:
        local = empty_local(layout, value.dtype)
    return GlobalTensor(local.detach(), layout, requires_grad=requires_grad)
