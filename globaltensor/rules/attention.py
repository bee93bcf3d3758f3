"""Fused scaled-dot-product attention kernels: the CPU flash kernel, and the CUDA
flash, memory-efficient and cuDNN kernels, forward and backward.

Query, key and value are (batch, heads, sequence, head dim). Attention mixes positions
of one sequence only, so a split on the batch or the heads dim stays local (data
parallel, and Megatron-style head parallel): every tensor argument and output that
has that dim (q, k, v, the output, the log-sum-exp, a full-size attention bias, the
gradients) keeps the split; the others (random-state scalars, a bias broadcast over
that dim) are broadcast. A split sequence (context parallel) stays split through the
CPU and the CUDA flash kernels, computed as ring attention (``ring_attention.py``; on
the CPU one, a mask split on its query rows); the cost model weighs its hops
(``cost.ring_seconds``) against moving to a head split and back (all-to-all, as
DeepSpeed-Ulysses) or gathering. The CUDA memory-efficient and cuDNN kernels gather a
split sequence or move it to a head split. Dropout
inside a kernel would draw per part, not as on the whole tensor, so it runs only
broadcast; ``F.scaled_dot_product_attention`` with dropout does not reach these
kernels (``functional.py`` computes it with placement-invariant dropout).
"""
from __future__ import annotations

import math

import torch

from ..sbp import Split, broadcast, partial_sum
from ..tensor import GlobalTensor
from .registry import register
from .ring_attention import (
    cuda_flash_backward_local,
    cuda_flash_forward_local,
    flash_backward_local,
    flash_forward_local,
)

aten = torch.ops.aten
B = broadcast


def _sbp_of(shape, q_shape, d, right_aligned=False, kv_heads=None):
    """Split on q's dim d for a tensor that has q's size there (or, on the heads dim of
    grouped-query attention, the keys' ``kv_heads``), broadcast for one of size 1 or
    without that dim, None when it cannot follow the split. Masks align with q from the
    right (they broadcast); everything else from the left."""
    k = d - (4 - len(shape)) if right_aligned else (d if len(shape) >= 3 else -1)
    if k < 0 or shape[k] == 1:
        return B
    return Split(k) if shape[k] in (q_shape[d], kv_heads) else None


def _grouped_heads_align(call, shapes: dict) -> int | None:
    """The key/value head count of grouped-query attention (``enable_gqa``: query head
    h reads key head h // (query heads / key heads)) when a head split keeps each
    rank's query heads with the key heads they read: even parts of both on every
    placement axis (balanced uneven parts would not line up), or one key head
    (multi-query: broadcast, read by every part). Else None."""
    hq, hk, hv = (shapes[n][1] for n in ("query", "key", "value"))
    if hk != hv or hq % hk or (hk > 1 and hk % math.prod(call.axis_sizes)):
        return None
    return hk


def _input_names(call) -> list:
    """The schema name of each GlobalTensor argument, in ``call.inputs`` order."""
    args, kwargs = call.args_kwargs
    names = []
    for i, a in enumerate(call.func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(value, GlobalTensor):
            names.append(a.name)
    return names


def _out_sbp(call, shape, q_shape, d, kv_heads=None):
    # A bias broadcast over the split dim gets its gradient summed over the parts.
    if len(shape) == 4 and shape[d] == 1 and call.func.overloadpacket.__name__.endswith(
            "_backward"):
        return partial_sum
    return _sbp_of(shape, q_shape, d, kv_heads=kv_heads) or B


def attention_rule(call):
    n_in, n_out = len(call.inputs), len(call.out_shapes)
    cands = [((B,) * n_in, (B,) * n_out)]
    if call.arg("dropout_p", 0.0) != 0.0:
        return cands
    names = _input_names(call)
    shapes = dict(zip(names, call.in_shapes))
    if len(names) != n_in or not {"query", "key", "value"} <= set(shapes):
        return cands
    q = shapes["query"]
    # the ring gives no attention weights (the CUDA flash kernel's debug mask)
    ring = call.func in _RING and not call.arg("return_debug_mask", False)
    for d in (0, 1, 2) if ring else (0, 1):
        kv_heads = None
        if len({shapes[n][d] for n in ("query", "key", "value")}) != 1:
            # grouped-query heads split where they line up; cross attention's lengths not
            kv_heads = _grouped_heads_align(call, shapes) if d == 1 else None
            if kv_heads is None:
                continue
        ins = tuple(_sbp_of(s, q, d, n in ("attn_mask", "attn_bias"), kv_heads)
                    for n, s in zip(names, call.in_shapes))
        outs = tuple(_out_sbp(call, s, q, d, kv_heads) for s in call.out_shapes)
        if None not in ins:
            cands.append((ins, outs))
    return cands


_RING = (aten._scaled_dot_product_flash_attention_for_cpu.default,
         aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
         aten._scaled_dot_product_flash_attention.default,
         aten._scaled_dot_product_flash_attention_backward.default)
register(aten._scaled_dot_product_flash_attention_for_cpu,
         local=flash_forward_local)(attention_rule)
register(aten._scaled_dot_product_flash_attention_for_cpu_backward,
         local=flash_backward_local)(attention_rule)
register(aten._scaled_dot_product_flash_attention,
         local=cuda_flash_forward_local)(attention_rule)
register(aten._scaled_dot_product_flash_attention_backward,
         local=cuda_flash_backward_local)(attention_rule)
register(aten._scaled_dot_product_efficient_attention,
         aten._scaled_dot_product_efficient_attention_backward,
         aten._scaled_dot_product_cudnn_attention,
         aten._scaled_dot_product_cudnn_attention_backward)(attention_rule)
