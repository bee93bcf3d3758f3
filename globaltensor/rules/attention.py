"""Fused scaled-dot-product attention (what F.scaled_dot_product_attention runs on CPU).

Query, key and value are (batch, heads, sequence, head dim). Attention mixes positions
of one sequence only, so a split on the batch or the heads dim stays local (data
parallel, and Megatron-style head parallel); the output and the log-sum-exp it saves
for backward keep that split. A split sequence (context parallel) is gathered.
"""
from __future__ import annotations

import torch

from ..sbp import Split, broadcast
from . import register

aten = torch.ops.aten
B = broadcast


def _batch_or_head_splits(call, n_qkv: int, n_in: int, n_out: int):
    cands = [((B,) * n_in, (B,) * n_out)]
    if n_in != n_qkv or call.arg("dropout_p", 0.0) != 0.0:
        # A mask would need its own (broadcastable) split, and dropout inside the kernel
        # would draw differently per part than on the whole: both run on broadcast.
        return cands
    for d in (0, 1):
        if len({s[d] for s in call.in_shapes}) == 1:  # grouped-query heads differ in size
            cands.append(((Split(d),) * n_in, (Split(d),) * n_out))
    return cands


@register(aten._scaled_dot_product_flash_attention_for_cpu)
def flash_attention_rule(call, axis):
    return _batch_or_head_splits(call, 3, len(call.inputs), 2)


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def flash_attention_backward_rule(call, axis):
    # grad_out, query, key, value, out, logsumexp -> grads of query, key, value
    return _batch_or_head_splits(call, 6, len(call.inputs), 3)
