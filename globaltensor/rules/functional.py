"""torch functions computed from global ops, at the torch-function level.

Some composites cannot run op by op on parts: ``F.one_hot`` and ``F.embedding_bag``
build plain helper tensors (an arange of classes, bag offsets) inside their kernels,
and ``F.scaled_dot_product_attention`` with dropout, or causal where no fused kernel
runs (inputs other than 4-D, or the fused kernels turned off), takes torch's math path,
which builds a plain causal mask, and would draw dropout per rank; ``torch.stft`` frames
its signal with ``as_strided``, which only a whole copy allows. Here they are written
with global ops (and the placement-invariant ``F.dropout``), so every layout works
and gives the value of the whole-tensor computation. ``interop/torch_patches.py``
installs them in ``torch.nn.functional``, taken when a GlobalTensor is an argument.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import comm
from ..layout import Layout
from ..local_parts import device_of
from ..sbp import Split, broadcast, partial_sum
from ..tensor import GlobalTensor, from_full, from_local_part
from .indices import check_index_range
from .pointwise import aligned_sbp


def _whole(t: torch.Tensor, like: GlobalTensor) -> GlobalTensor:
    """A plain whole value as a broadcast GlobalTensor on ``like``'s placement."""
    placement = like.placement
    layout = Layout.make(t.shape, placement, (broadcast,) * placement.ndim)
    return from_full(t.to(device_of(placement)), layout)


def one_hot(indices, num_classes: int = -1):
    """``F.one_hot``: compares the indices with a broadcast arange of the classes."""
    if not isinstance(indices, GlobalTensor):
        return NotImplemented
    if num_classes < 0:
        # every rank learns the count, also one outside the placement (SPMD: the op
        # runs there too and needs the output shape): full(), not a read
        num_classes = int(indices.max().full().item()) + 1
    check_index_range(indices, num_classes, "one_hot", error=RuntimeError)
    classes = _whole(torch.arange(num_classes), indices)
    return (indices.unsqueeze(-1) == classes).long()


def embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2.0,
                  scale_grad_by_freq=False, mode="mean", sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=None):
    """``F.embedding_bag`` as a lookup of (bags, longest bag) indices and a masked
    reduction over the bag dim. 1-D indices with offsets are first laid out as such a
    padded matrix (the indices are small next to the rows they select)."""
    if not isinstance(weight, GlobalTensor):
        return NotImplemented
    if max_norm is not None or sparse:
        raise ValueError("embedding_bag on GlobalTensors: max_norm and sparse are not "
                         "supported (renormalise the table, or use dense gradients)")
    if input.dim() == 2:
        bags = input if isinstance(input, GlobalTensor) else _whole(input, weight)
        weights = per_sample_weights
        present = None
    else:
        bags, present, weights = _padded_bags(input, offsets, per_sample_weights,
                                              include_last_offset, weight)
    if padding_idx is not None:
        padding_idx %= weight.shape[0]
        not_padding = bags != padding_idx
        present = not_padding if present is None else present & not_padding
    rows = F.embedding(bags, weight, scale_grad_by_freq=scale_grad_by_freq)
    if weights is not None:
        if not isinstance(weights, GlobalTensor):
            weights = _whole(weights, weight)
        rows = rows * weights.unsqueeze(-1)
    if mode == "max":
        if present is not None:
            rows = rows.masked_fill(~present.unsqueeze(-1), -math.inf)
        out = rows.amax(1)
        return out if present is None else out.masked_fill(~present.any(1, keepdim=True), 0)
    if present is not None:
        rows = rows * present.unsqueeze(-1)
    total = rows.sum(1)
    if mode == "sum":
        return total
    count = present.sum(1, keepdim=True).clamp(min=1) if present is not None else bags.shape[1]
    return total / count


def _padded_bags(input, offsets, per_sample_weights, include_last_offset, weight):
    """(bags, present, weights): 1-D indices cut at ``offsets`` into rows padded to the
    longest bag, a mask of real entries, and the per-sample weights laid out alike."""
    flat = input.full() if isinstance(input, GlobalTensor) else input
    offsets = offsets.full() if isinstance(offsets, GlobalTensor) else offsets
    n = flat.numel()
    starts = offsets[:-1] if include_last_offset else offsets
    ends = offsets[1:] if include_last_offset else torch.cat([offsets[1:], offsets.new_tensor([n])])
    longest = max(int((ends - starts).max()) if starts.numel() else 0, 1)
    position = starts.unsqueeze(1) + torch.arange(longest, device=starts.device)
    present = position < ends.unsqueeze(1)
    where = position.clamp(max=max(n - 1, 0))
    bags = torch.where(present, flat[where], torch.zeros_like(where)) if n else \
        torch.zeros_like(where)
    weights = None
    if per_sample_weights is not None:
        # laid out by global indexing, so that their gradient reaches them
        w = per_sample_weights if isinstance(per_sample_weights, GlobalTensor) \
            else _whole(per_sample_weights, weight)
        weights = w[_whole(where, weight)] * _whole(present, weight) if n else \
            _whole(torch.zeros(where.shape, dtype=w.dtype), weight)
    return _whole(bags, weight), _whole(present, weight), weights


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """With dropout, or causal on torch's math path: attention on each rank's batch or
    head part, the probabilities wrapped as a GlobalTensor and dropped out
    placement-invariantly. Otherwise the fused kernels run (rules/attention.py), or the
    math path op by op (no plain mask to build)."""
    if not all(isinstance(t, GlobalTensor) for t in (query, key, value)):
        return NotImplemented
    if dropout_p == 0.0 and not (is_causal and _math_path(query)):
        return NotImplemented
    placement = query.placement
    outer = query.dim() - 2  # batch and head dims; the rest are (sequence, features)
    sbp = tuple(s if isinstance(s, Split) and s.dim < outer and key.sbp[a] == s
                and value.sbp[a] == s and key.shape[s.dim] == query.shape[s.dim]
                else broadcast for a, s in enumerate(query.sbp))
    q, k, v = (t.to_global(sbp=sbp) for t in (query, key, value))
    ql, kl, vl = q.to_local(), k.to_local(), v.to_local()
    if enable_gqa and kl.dim() >= 3 and kl.shape[-3] != ql.shape[-3]:
        repeat = ql.shape[-3] // kl.shape[-3]
        kl, vl = kl.repeat_interleave(repeat, -3), vl.repeat_interleave(repeat, -3)
    length, source = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (ql @ kl.transpose(-2, -1)) * scale
    mask = None if attn_mask is None else _mask_part(attn_mask, tuple(q.shape[:-1]) + (source,), q)
    if comm.get_rank() in placement:  # (an empty part outside would not broadcast)
        if is_causal:
            keep = torch.ones(length, source, dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~keep, -math.inf)
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool \
                else scores + mask
    probs_shape = tuple(q.shape[:-1]) + (source,)
    probs = from_local_part(torch.softmax(scores, -1), Layout.make(probs_shape, placement, sbp))
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    out = probs.to_local() @ vl
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    return from_local_part(out, Layout.make(out_shape, placement, sbp))


def _math_path(query: GlobalTensor) -> bool:
    """Whether torch's ``scaled_dot_product_attention`` takes its math path (which builds
    a plain causal mask) rather than a fused kernel: decided from what every rank knows
    alike (the inputs' number of dims, the device type, the enabled kernels), so the
    ranks choose the same way. Erring towards the math path costs speed, not values."""
    if query.dim() != 4:
        return True
    if torch.compiler.is_compiling():   # (as before: dynamo would stop at the flags)
        return False
    kernels = torch.backends.cuda
    if device_of(query.placement).type == "cpu":
        return not kernels.flash_sdp_enabled()
    return not (kernels.flash_sdp_enabled() or kernels.mem_efficient_sdp_enabled()
                or kernels.cudnn_sdp_enabled())


def stft(input, n_fft, hop_length=None, win_length=None, window=None, center=True,
         pad_mode="reflect", normalized=False, onesided=None, return_complex=None,
         align_to_window=None):
    """``torch.stft`` of a batch of signals ``(B, T)``: each rank transforms its rows (or
    its addend of a partial sum: the transform is linear), the frames never gathered
    (torch frames a signal with ``as_strided``, which only a whole copy allows; other
    layouts are made broadcast first). A window that requires grad, or a single signal,
    takes the general path."""
    if not isinstance(input, GlobalTensor) or input.dim() != 2 or (
            isinstance(window, torch.Tensor) and window.requires_grad):
        return NotImplemented
    placement = input.placement
    sbp = tuple(s if s in (Split(0), partial_sum) else broadcast for s in input.sbp)
    x = input if sbp == input.sbp else input.to_global(sbp=sbp)
    whole = window.full() if isinstance(window, GlobalTensor) else window
    args = (n_fft, hop_length, win_length)
    kwargs = dict(center=center, pad_mode=pad_mode, normalized=normalized, onesided=onesided,
                  return_complex=return_complex, align_to_window=align_to_window)
    meta = torch.stft(torch.empty(input.shape, dtype=input.dtype, device="meta"), *args,
                      window=None if whole is None else whole.to("meta"), **kwargs)
    layout = Layout.make(meta.shape, placement, sbp)
    part = x.to_local()
    if comm.get_rank() in placement and part.shape[0]:
        out = torch.stft(part, *args, window=whole, **kwargs)
    else:   # an empty part (torch refuses it), kept in the graph for the backward's turn
        out = torch.zeros(layout.local_shape(comm.get_rank()), dtype=meta.dtype,
                          device=part.device) + part.sum() * 0
    return from_local_part(out, layout)


def _mask_part(mask, scores_shape, q: GlobalTensor) -> torch.Tensor:
    """This rank's part of an attention mask that broadcasts against the scores."""
    if not isinstance(mask, GlobalTensor):
        mask = _whole(mask, q)
    sbp = tuple(aligned_sbp(tuple(mask.shape), scores_shape, s.dim) if isinstance(s, Split)
                else broadcast for s in q.sbp)
    return mask.to_global(sbp=sbp).to_local()
