"""The fused kernels of torch's inference fast path: ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` run one kernel each (``aten._native_multi_head_attention``,
``aten._transformer_encoder_layer_fwd``) in eval mode without gradients, batch first.

Each sample is computed alone, so a batch split (dim 0 of query, key, value or src)
stays split with every weight broadcast: data-parallel evaluation runs torch's own
kernel on each rank's samples. The mask follows ``mask_type``, as the kernels read it:
1 is a padding mask (batch, source) and 2 a merged one (batch, heads, target, source),
both split with the batch; 0 is one (target, source) mask for every sample, broadcast.
Without a ``mask_type`` a mask's meaning is the kernel's guess, so those calls stay
broadcast. Weights split otherwise (tensor parallel) are gathered for the call.
"""
from __future__ import annotations

import torch

from ..sbp import Split, broadcast
from .attention import _input_names
from .registry import register

aten = torch.ops.aten
B = broadcast
_PER_SAMPLE = {"query", "key", "value", "src"}


def _mask_split(call, shape, batch: int) -> bool | None:
    """Whether the mask is split with the batch (True), broadcast (False), or unknown."""
    kind = call.arg("mask_type", None)
    if kind == 0:
        return False
    if kind in (1, 2) and len(shape) >= 2:
        return shape[0] == batch or None
    return None


@register(aten._native_multi_head_attention.default, aten._transformer_encoder_layer_fwd.default)
def fast_path_rule(call):
    n_in, n_out = len(call.inputs), len(call.out_shapes)
    cands = [((B,) * n_in, (B,) * n_out)]
    names = _input_names(call)
    if len(names) != n_in or names[0] not in _PER_SAMPLE or len(call.in_shapes[0]) != 3:
        return cands   # (an unbatched or plain first input: the kernel's own checks)
    batch = call.in_shapes[0][0]
    ins = []
    for name, shape in zip(names, call.in_shapes):
        if name in _PER_SAMPLE:
            if len(shape) != 3 or shape[0] != batch:
                return cands
            ins.append(Split(0))
        elif name == "mask":
            split = _mask_split(call, shape, batch)
            if split is None:
                return cands
            ins.append(Split(0) if split else B)
        else:
            ins.append(B)
    # the attention weights: (batch, ...) when asked for, else empty
    outs = tuple(Split(0) if len(s) >= 2 and s[0] == batch else B for s in call.out_shapes)
    return cands + [(tuple(ins), outs)]
