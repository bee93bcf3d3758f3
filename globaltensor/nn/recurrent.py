"""torch's recurrent layers on a split batch run on each rank's own samples.

``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells see each sample alone, so with the
batch split (data parallel) each rank can run the layer on its part, as DDP does, and
the weights' gradients come back as partial sums that gradient sync reduces. Through
dispatch they could not: on CPU ``nn.LSTM`` is one ``mkldnn_rnn_layer`` op whose
workspace has no per-sample layout, and the cells add the input's gates in place into
the product of a hidden state made broadcast (the zeros ``forward`` builds), so the batch
was gathered on every rank. ``gt.nn.to_global`` gives these modules ``forward_on_parts``:
their own ``forward`` on the local parts, the weights swapped in as local views for the
call; a rank outside the placement runs it on no samples, so that its outputs have the
members' layouts. Layouts it does not cover take the module's own ``forward`` through
dispatch (right values, gathered), decided alike on every rank from layouts only:
weights not all broadcast, an input not split on its batch alone, a hidden state on
another placement, packed sequences, unbatched inputs, dropout between layers while
training (its mask would come from each rank's torch generator, not the
placement-invariant one) and code being compiled.

>>> lstm = gt.nn.to_global(torch.nn.LSTM(8, 16), p, gt.sbp.broadcast)      # doctest: +SKIP
>>> out, (h, c) = lstm(gt.randn(5, 4, 8, placement=p, sbp=gt.sbp.split(1)))  # doctest: +SKIP
>>> out.sbp, h.sbp                  # no communication in forward            # doctest: +SKIP
((split(dim=1),), (split(dim=1),))
"""
from __future__ import annotations

import weakref

import torch

from .. import comm
from ..gradsync import watch
from ..layout import Layout
from ..sbp import Broadcast, Split, broadcast, partial_sum, split
from ..tensor import GlobalTensor, from_local_part

_LAYERS = (torch.nn.RNN, torch.nn.LSTM, torch.nn.GRU)
_CELLS = (torch.nn.RNNCell, torch.nn.LSTMCell, torch.nn.GRUCell)
_TORCH_FORWARDS = frozenset(cls.forward for cls in _LAYERS + _CELLS)


def runs_on_parts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of torch's recurrent layers or cells with torch's own
    ``forward`` (a subclass with its own may look across samples)."""
    return type(module).forward in _TORCH_FORWARDS


def forward_on_parts(self: torch.nn.Module, input, hx=None):
    """``self``'s class's ``forward``, on each rank's samples where the layouts allow it
    (the module's docstring), else as it is."""
    batch_sbp = _batch_sbp(self, input, hx)
    if batch_sbp is None:
        return type(self).forward(self, input, hx)
    layer = isinstance(self, torch.nn.RNNBase)
    in_dim, hx_dim = (0 if self.batch_first else 1, 1) if layer else (0, 0)
    batch = input.shape[in_dim]
    placement = input.placement
    inside = comm.get_rank() in placement

    def local(x: GlobalTensor, dim: int) -> torch.Tensor:
        return _stand_in(x.to_global(placement, _split_moved(batch_sbp, in_dim, dim)).to_local(),
                         x.shape, dim, inside)

    def part(t: torch.Tensor, dim: int) -> GlobalTensor:
        shape = list(t.shape)
        shape[dim] = batch
        return from_local_part(t, Layout.make(shape, placement, _split_moved(batch_sbp, in_dim, dim)))

    if hx is not None:
        hx = tuple(local(h, hx_dim) for h in hx) if isinstance(hx, tuple) else local(hx, hx_dim)
    # The weights' gradients are each rank's own samples' share: partial sums where the
    # batch is split, which gradient sync reduces as it does a matmul's.
    grad_sbp = tuple(partial_sum if isinstance(s, Split) else broadcast for s in batch_sbp)
    out = _with_local_weights(self, grad_sbp, inside,
                              lambda: type(self).forward(self, local(input, in_dim), hx))
    if layer:
        output, state = out
        state = tuple(part(h, hx_dim) for h in state) if isinstance(state, tuple) else part(state, hx_dim)
        return part(output, in_dim), state
    return tuple(part(h, 0) for h in out) if isinstance(out, tuple) else part(out, 0)


def _batch_sbp(module: torch.nn.Module, input, hx) -> tuple | None:
    """The input's sbp where ``module`` can run on each rank's samples, else None: decided
    from layouts and the module's settings only, so alike on every rank."""
    if torch.compiler.is_compiling() or not isinstance(input, GlobalTensor):
        return None
    layer = isinstance(module, torch.nn.RNNBase)
    if input.dim() != (3 if layer else 2):
        return None
    if layer and module.training and module.dropout > 0 and module.num_layers > 1:
        return None
    placement = input.placement
    dim = (0 if module.batch_first else 1) if layer else 0
    sbp = input.sbp
    if not any(s == split(dim) for s in sbp) or any(s != split(dim) and not isinstance(s, Broadcast) for s in sbp):
        return None
    states = hx if isinstance(hx, tuple) else () if hx is None else (hx,)
    if any(not isinstance(h, GlobalTensor) or h.placement != placement for h in states):
        return None
    weights = [p for p in module._parameters.values() if p is not None]
    if any(not isinstance(w, GlobalTensor) or w.placement != placement
           or any(not isinstance(s, Broadcast) for s in w.sbp) for w in weights):
        return None
    return sbp


def _split_moved(sbp: tuple, dim: int, to: int) -> tuple:
    return tuple(split(to) if s == split(dim) else s for s in sbp)


def _stand_in(part: torch.Tensor, shape, batch_dim: "int | None", inside: bool) -> torch.Tensor:
    """``part``, this rank's part; on a rank outside the placement (whose part is an
    empty placeholder) a tensor of ``shape`` with no samples (``batch_dim`` of size 0;
    a weight: its shape, expanded from one element, no memory), made from the
    placeholder: the layer runs there on nothing, and backward as on the members."""
    if inside:
        return part
    if batch_dim is not None:
        shape = list(shape)
        shape[batch_dim] = 0
    return part.sum().expand(shape)


def _with_local_weights(module: torch.nn.Module, grad_sbp: tuple, inside: bool, run):
    """``run()`` with ``module``'s parameters replaced by their local parts (views whose
    gradients come back to the parameters in ``grad_sbp``; ``_stand_in`` outside the
    placement), put back after."""
    params = module._parameters
    saved = dict(params)
    flat = getattr(module, "_flat_weights", None)
    saved_flat = (flat, module._flat_weight_refs) if flat is not None else None
    for name, w in saved.items():
        if w is not None:
            if w.requires_grad and w.is_leaf:
                watch(w)   # gradient sync, which dispatch sets up for the leaves it meets
            params[name] = _stand_in(w.to_local(grad_sbp), w.shape, None, inside)
    if saved_flat is not None:
        # RNNBase runs on its list of flat weights; with the list and its references
        # both swapped, ``forward`` sees no change to re-flatten (a cuDNN copy).
        module._flat_weights = [params[n] if n in params else None for n in module._flat_weights_names]
        module._flat_weight_refs = [None if w is None else weakref.ref(w) for w in module._flat_weights]
    try:
        return run()
    finally:
        params.update(saved)
        if saved_flat is not None:
            module._flat_weights, module._flat_weight_refs = saved_flat

