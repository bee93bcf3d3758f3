"""Random ops on global tensors: dropout, bernoulli_, uniform_, normal_, rand_like, ...

They run before the signature machinery (as decompositions): each takes the next draw
number on every rank (inside the placement or not, so every rank's counter stays in
step) and fills only this rank's part from the counter-based generator
(``globaltensor.random``). So the value never depends on the layout, a broadcast
tensor is equal everywhere, and no rank draws what it does not hold. In-place ops keep
their target's layout; on a partial target the first member holds the values and the
others the reduction's identity. ``*_like`` ops keep the source's layout (partial axes
become broadcast: the region is the same, the values are whole). ``F.dropout`` and
``F.dropout1d/2d/3d`` are taken before they decompose (installed by
``interop/torch_patches.py``).
"""
from __future__ import annotations

import torch

from .. import comm, gradsync
from ..layout import Layout
from ..local_parts import device_of, empty_local
from ..partials import keep_on_first
from ..random import local_sample, mantissa_bits, next_draw
from ..sbp import Split, broadcast
from ..tensor import GlobalTensor, to_layout
from .registry import register

aten = torch.ops.aten


def _draw_for(generator) -> tuple[int, int]:
    """A user's ``torch.Generator`` keys the draw with one value taken from it (seed it
    alike on every rank); without one, the global (seed, draw number)."""
    if generator is None:
        return next_draw()
    next_draw()  # the global counter advances for every random op all the same
    return int(torch.randint(1 << 62, (1,), generator=generator)), -1


def watch_leaves(*tensors) -> None:
    """Gradient sync watches the leaves among ``tensors`` that require grad, as dispatch
    does for an op's operands (decompositions that run ops on the parts skip it)."""
    for t in tensors:
        if isinstance(t, GlobalTensor) and t.requires_grad and t.is_leaf:
            gradsync.watch(t)


def _inplace(kind: str, params):
    """``self.<op>_(...)``: this rank's part of ``self`` refilled, layout kept."""
    def run(self, *args, generator=None, **kwargs):
        if not isinstance(self, GlobalTensor):
            return NotImplemented
        bound = params(self, *args, **kwargs)
        draw = _draw_for(generator)
        watch_leaves(self)
        if comm.get_rank() in self.placement:
            local = self.local_part
            dtype = torch.int64 if kind == "integers" and not local.dtype.is_floating_point \
                else local.dtype
            if local.is_contiguous() and dtype == local.dtype:
                local_sample(kind, self.global_layout, draw, dtype, out=local, **bound)
            else:
                local.copy_(local_sample(kind, self.global_layout, draw, dtype, **bound))
        return self
    return run


def _random_bounds(self, *args, **kwargs):
    """``random_()``, ``random_(to)``, ``random_(from, to)``: torch's default bounds."""
    dtype = self.dtype
    top = (1 << mantissa_bits(dtype)) + 1 if dtype.is_floating_point \
        else 2 if dtype == torch.bool else torch.iinfo(dtype).max + 1
    if "to" in kwargs or "from" in kwargs:
        low, high = kwargs.get("from", 0), kwargs.get("to")
    elif len(args) == 2:
        low, high = args
    elif len(args) == 1:
        low, high = 0, args[0]
    else:
        low, high = 0, None
    return {"low": low, "high": top if high is None else high}


_INPLACE = {
    aten.uniform_.default: ("uniform", lambda s, a=0.0, b=1.0, **k: {
        "low": k.get("from", a), "high": k.get("to", b)}),
    aten.normal_.default: ("normal", lambda s, mean=0.0, std=1.0: {"mean": mean, "std": std}),
    aten.log_normal_.default: ("log_normal", lambda s, mean=1.0, std=2.0: {"mean": mean,
                                                                          "std": std}),
    aten.exponential_.default: ("exponential", lambda s, lambd=1.0: {"lambd": lambd}),
    aten.cauchy_.default: ("cauchy", lambda s, median=0.0, sigma=1.0: {"median": median,
                                                                     "sigma": sigma}),
    aten.geometric_.default: ("geometric", lambda s, p: {"p": p}),
    aten.bernoulli_.float: ("bernoulli", lambda s, p=0.5: {"p": p}),
    aten.random_.default: ("integers", _random_bounds),
    aten.random_.to: ("integers", _random_bounds),
    getattr(aten.random_, "from"): ("integers", _random_bounds),
}
for _op, (_kind, _params) in _INPLACE.items():
    register(_op, decompose=True)(_inplace(_kind, _params))


def _identity_on_partial(local: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Keep a whole value on the first member of every partial axis, identities elsewhere."""
    return keep_on_first(local, layout, comm.get_rank())


@register(aten.bernoulli_.Tensor, decompose=True)
def bernoulli_tensor_(self, p, generator=None):
    """``self.bernoulli_(p)`` with a tensor of probabilities (boxed to self's regions)."""
    if not isinstance(self, GlobalTensor) or not isinstance(p, GlobalTensor):
        return NotImplemented
    whole = self.global_layout.without_partials()
    p = to_layout(p.expand(self.shape) if p.shape != self.shape else p, sbp=whole.sbp)
    draw = _draw_for(generator)
    watch_leaves(self)
    if comm.get_rank() in self.placement:
        u = local_sample("uniform", whole, draw, torch.float64 if p.dtype == torch.float64
                         else torch.float32)
        self.local_part.copy_(_identity_on_partial((u < p.local_part).to(self.dtype),
                                                   self.global_layout))
    return self


def _fresh(x: GlobalTensor, kind: str, dtype, generator=None, **params) -> GlobalTensor:
    """A new random tensor with ``x``'s regions (partial axes broadcast)."""
    layout = x.global_layout.without_partials()
    draw = _draw_for(generator)
    return GlobalTensor(local_sample(kind, layout, draw, dtype, **params), layout)


@register(aten.bernoulli.default, decompose=True)
def bernoulli(self, generator=None):
    """``torch.bernoulli(probs)``: ones where a uniform value falls below the probability."""
    if not isinstance(self, GlobalTensor):
        return NotImplemented
    out = self.to_global(sbp=self.global_layout.without_partials().sbp)
    u = _fresh(out, "uniform", self.dtype, generator)
    return GlobalTensor((u.local_part < out.local_part).to(self.dtype), u.global_layout)


@register(aten.bernoulli.p, decompose=True)
def bernoulli_p(self, p=0.5, generator=None):
    if not isinstance(self, GlobalTensor):
        return NotImplemented
    return _fresh(self, "bernoulli", self.dtype, generator, p=p)


def _like(kind, bounds=None):
    def run(self, *args, dtype=None, layout=None, device=None, pin_memory=None,
            memory_format=None, generator=None):
        if not isinstance(self, GlobalTensor):
            return NotImplemented
        params = bounds(*args) if bounds else {}
        return _fresh(self, kind, dtype or self.dtype, generator, **params)
    return run


register(aten.rand_like.default, decompose=True)(_like("uniform"))
register(aten.randn_like.default, decompose=True)(_like("normal"))
register(aten.randint_like.default, decompose=True)(
    _like("integers", lambda high: {"low": 0, "high": high}))
register(aten.randint_like.low_dtype, decompose=True)(
    _like("integers", lambda low, high: {"low": low, "high": high}))


@register(aten.native_dropout.default, decompose=True)
def native_dropout(x, p: float, train=True):
    """Dropout drawing only this rank's part of the mask. A partial input stays partial:
    every addend meets the same mask (the mask of its whole region)."""
    if not isinstance(x, GlobalTensor):
        return NotImplemented
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability has to be between 0 and 1, got {p}")
    watch_leaves(x)
    mask_layout = x.global_layout.without_partials()
    strides = None if x.is_contiguous() else tuple(x.stride())
    rank = comm.get_rank()
    if train is False or p == 0:
        ones = torch.ones(mask_layout.local_shape(rank), dtype=torch.bool,
                          device=device_of(x.placement))
        return (GlobalTensor(x.local_part.clone(), x.global_layout, strides=strides),
                GlobalTensor(ones, mask_layout))
    draw = next_draw()
    if rank not in x.placement:
        layout = x.global_layout
        return (GlobalTensor(empty_local(layout, x.dtype), layout, strides=strides),
                GlobalTensor(empty_local(mask_layout, torch.bool), mask_layout))
    mask = local_sample("bernoulli", mask_layout, draw, torch.bool, p=1 - p)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    # (torch.where allocates only the output; a float * bool product casts the mask)
    out = torch.where(mask, x.local_part, 0.0).mul_(scale)
    return (GlobalTensor(out, x.global_layout, strides=strides), GlobalTensor(mask, mask_layout))


def dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
    """``F.dropout`` on a GlobalTensor: torch's CPU dropout is empty_like + bernoulli_ +
    mul and keeps a float noise tensor for backward; ``native_dropout`` (the accelerator
    path) keeps a bool mask, a quarter of it. Other cases go to torch's own."""
    if not isinstance(input, GlobalTensor) or inplace or not training or not 0 < p < 1:
        return NotImplemented
    return aten.native_dropout(input, p, True)[0]


FEATURE_DROPOUT_DIMS = {"dropout1d": (2, 3), "dropout2d": (3, 4), "dropout3d": (4, 5)}


def feature_dropout(name: str):
    """``F.<name>`` (``dropout1d``/``2d``/``3d``) on a GlobalTensor."""
    unbatched, batched = FEATURE_DROPOUT_DIMS[name]

    def run(input, p: float = 0.5, training: bool = True, inplace: bool = False):
        """Whole channels dropped: a mask of shape (N, C, 1, ...) drawn placement-
        invariantly, split like the input's batch and channel dims."""
        if not isinstance(input, GlobalTensor) or inplace or not training or not 0 < p < 1 \
                or input.dim() not in (unbatched, batched):
            return NotImplemented
        lead = input.dim() - unbatched + 1     # dims of the mask that are not 1
        shape = tuple(input.shape[:lead]) + (1,) * (input.dim() - lead)
        sbp = tuple(s if isinstance(s, Split) and s.dim < lead else broadcast
                    for s in input.sbp)
        layout = Layout.make(shape, input.placement, sbp)
        mask = local_sample("bernoulli", layout, next_draw(), input.dtype, p=1 - p)
        return input * GlobalTensor(mask.div_(1 - p), layout)
    return run
