"""Module helpers: ``to_global`` (parameters and buffers become GlobalTensors, meta
modules allocate only their parts), ``fully_shard`` (ZeRO-3 / FSDP as an sbp),
``meta_init`` (build with parameters on meta, buffers real), ``full_state_dict``
(whole plain values for torch.save, safetensors, save_pretrained),
``auto_parallel`` (parameter layouts chosen by measuring the model) and ``MoE``
(mixture of experts, the experts split across ranks).

>>> import globaltensor as gt, torch
>>> model = torch.nn.Linear(4, 2)
>>> gt.nn.to_global(model, gt.placement.all("cpu"), gt.sbp.broadcast)   # doctest: +SKIP
"""
from __future__ import annotations

from .attention import packed_attention, zigzag_order
from .auto import AutoPlan, auto_parallel, load_plan
from .meta import meta_init
from .module import to_global
from .moe import MoE
from .sharded import fully_shard
from .state import full_state_dict

__all__ = ["to_global", "fully_shard", "meta_init", "full_state_dict", "auto_parallel",
           "load_plan", "AutoPlan", "MoE", "packed_attention", "zigzag_order"]
