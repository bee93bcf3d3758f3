"""``auto_parallel``'s candidates: whole-model layouts ({parameter name: sbp per axis}
and the batch inputs' sbps) for data, Megatron tensor, fully sharded, context and
expert parallelism and their 2-D hybrids, read from the model's structure (Linear
layers in Megatron's pattern, attention modules or token inputs, ``gt.nn.MoE``).
"""
from __future__ import annotations

import torch

from ..placement import Placement
from ..sbp import Split, broadcast, split
from .moe import MoE


def named_tensors(model: torch.nn.Module):
    """(name, tensor) of every parameter and buffer, each tensor once (tied ones).

    >>> [name for name, _ in named_tensors(torch.nn.Linear(2, 2))]
    ['weight', 'bias']
    """
    seen = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


def candidate_layouts(model, placement: Placement, inputs: tuple) -> dict:
    """Whole-model layouts. On a 1-D placement: data parallel, tensor parallel (when
    Megatron's pattern is found) and fully sharded. On a 2-D placement every axis takes
    part: data parallel and fully sharded over both axes, and the hybrids of the outer
    axis's batch split with the inner axis's tensor parallelism (data x tensor) or of
    ZeRO-3 on the outer axis with tensor parallelism on the inner (torchtitan's FSDP +
    TP). A sequence model (``_sequence_model``) also gets context parallel on the inner
    axis (data x context on 2-D), one with ``gt.nn.MoE`` layers expert parallel (data x
    expert on 2-D). {strategy: ({name: sbp per axis}, the batch inputs' sbps)}.

    >>> candidate_layouts(mlp, gt.placement.all("cpu"), (x,))["data parallel"]  # doctest: +SKIP
    """
    named = list(named_tensors(model))
    rows, cols = _megatron_pairs(model)
    experts = _expert_weights(model, placement)
    if placement.ndim == 1:
        combos = {"data parallel": ("data",), "tensor parallel": ("tensor",),
                  "fully sharded": ("sharded",)}
    elif placement.ndim == 2:
        combos = {"data parallel": ("data", "data"), "fully sharded": ("sharded", "sharded"),
                  "data x tensor parallel": ("data", "tensor"),
                  "fully sharded x tensor parallel": ("sharded", "tensor")}
    else:   # deeper placements: the outer axis only, the others replicate
        rest = ("replicated",) * (placement.ndim - 1)
        combos = {"data parallel": ("data",) + rest, "tensor parallel": ("tensor",) + rest,
                  "fully sharded": ("sharded",) + rest}
    if experts:   # data parallel with every MoE's experts split on the (inner) axis
        combos[("data x " if placement.ndim == 2 else "") + "expert parallel"] = \
            ("data",) * (placement.ndim - 1) + ("expert",)
    if placement.ndim <= 2 and _sequence_model(model, inputs, placement.shape[-1]):
        combos[("data x " if placement.ndim == 2 else "") + "context parallel"] = \
            ("data",) * (placement.ndim - 1) + ("context",)
    plans = {}
    for strategy, kinds in combos.items():
        if "tensor" in kinds and not (rows or cols):
            continue
        axes = [_per_axis(kind, size, experts, rows, cols)
                for kind, size in zip(kinds, placement.shape)]
        layouts = {k: tuple(param(k, t) for param, _ in axes) for k, t in named}
        batch = tuple(_batch_sbp(x, [b for _, b in axes], placement) for x in inputs)
        plans[strategy] = (layouts, batch)
    return plans


def _per_axis(kind: str, size: int, experts: set, rows: dict, cols: dict):
    """(parameter sbp of name and tensor, batch input sbp) for one placement axis of
    ``kind`` ("data", "tensor", "sharded", "expert", "context", "replicated")."""
    def param(name, t):
        if kind == "expert":
            return split(0) if name in experts else broadcast
        if kind == "sharded":
            return split(0) if isinstance(t, torch.nn.Parameter) and t.dim() \
                and t.shape[0] >= size else broadcast
        if kind == "tensor":
            module, what = name.rsplit(".", 1) if "." in name else ("", name)
            if module in cols and t.dim() >= 1:   # the output features (bias: dim 0)
                out_dim, blocks = cols[module]
                return split(out_dim if what == "weight" else 0, blocks=blocks)
            if module in rows and what == "weight":   # the input features
                return split(rows[module])
        return broadcast
    if kind == "context":   # the sequence (dim 1 of a batch input) split
        return param, lambda x: split(1) if x.dim() >= 2 else broadcast
    batch = lambda x: broadcast if kind in ("tensor", "replicated") else split(0)
    return param, batch


def _batch_sbp(x, per_axis: list, placement: Placement) -> tuple:
    """A batch input's sbp: split(0) on the axes that split the batch (split(1) on an
    axis that splits the sequence), while that dim still divides among them (else
    broadcast there)."""
    sbp, ranks = [], {}
    for batch, size in zip(per_axis, placement.shape):
        s = batch(x)
        if isinstance(s, Split) and x.dim() > s.dim and \
                x.shape[s.dim] >= ranks.get(s.dim, 1) * size:
            ranks[s.dim] = ranks.get(s.dim, 1) * size
            sbp.append(s)
        else:
            sbp.append(broadcast)
    return tuple(sbp)


def _expert_weights(model, placement: Placement) -> set:
    """Names of the expert weights of every ``gt.nn.MoE`` in ``model`` whose experts
    divide over the (inner) axis of a 1-D or 2-D ``placement`` (empty otherwise):
    split(0) there in expert parallel."""
    if placement.ndim > 2:
        return set()
    return {f"{prefix}.{w}".lstrip(".") for prefix, m in model.named_modules()
            if isinstance(m, MoE) and m.experts % placement.shape[-1] == 0
            for w in ("w1", "w2")}


def _sequence_model(model, inputs: tuple, ranks: int) -> bool:
    """Whether to offer the sequence split (context parallel): the model has an
    attention module, or takes token ids (integers, batch x sequence), and the
    sequence has a position for every rank."""
    tokens = [x for x in inputs if isinstance(x, torch.Tensor) and x.dim() >= 2]
    if not tokens or min(x.shape[1] for x in tokens) < ranks:
        return False
    return any(not x.is_floating_point() for x in tokens) or any(
        "attention" in type(m).__name__.lower() for m in model.modules())


# A fused projection's output holds this many equal blocks at most (query-key-value: 3;
# gate-up: 2): each block is split on its own, so that the parts the forward cuts it
# into (``qkv.split(C, -1)``, ``.view(b, t, 3, heads, hd)``) stay split where they lie.
MAX_FUSED_BLOCKS = 3
# Grouped-query attention's keys and values have up to 8 times fewer heads than its
# queries (Llama 3 70B: 64 and 8): column-parallel too, each rank holding its key heads.
MAX_KV_FRACTION = 8


def _projection(module) -> "tuple[int, int, int] | None":
    """(input features, output features, the weight's output dim) of a projection:
    ``nn.Linear`` (weight (out, in)) or Hugging Face's ``Conv1D`` (GPT-2's, weight
    (in, out)); None for another module."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features, 0
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) \
            and weight.dim() == 2 and getattr(module, "nf", None) == weight.shape[1]:
        return weight.shape[0], weight.shape[1], 1
    return None


def _megatron_pairs(model) -> tuple[dict, dict]:
    """Projections (``_projection``) in Megatron's pattern: (row-parallel {name: the
    weight's input-features dim}, column-parallel {name: (the weight's output-features
    dim, blocks)}). In a ``Sequential`` the projections chain: each pair in turn whose
    widths meet (fc1 -> fc2) is column then row. In another module, the last one that
    the others with one input width feed, and no wider than they, is row-parallel (q, k,
    v into proj; grouped-query attention's k and v narrower), and those are
    column-parallel; one whose output is 2 or 3 times the last's input is a fused
    projection (GPT-2's query-key-value ``c_attn``, a fused gate-up), split in that many
    blocks (``split(dim, blocks=k)``: each rank holds its heads of each). Where the
    pattern spans modules (Bert's: query, key and value in one, the output projection in
    the next; the MLP's two projections in one module each), ``_across_modules`` pairs
    them.

    >>> _megatron_pairs(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)))  # doctest: +SKIP
    ({'1': 1}, {'0': (0, 1)})
    """
    rows, cols, waiting = {}, {}, []
    for prefix, module in model.named_modules():
        layers = [(f"{prefix}.{name}".lstrip("."), shape) for name, m in module.named_children()
                  for shape in [_projection(m)] if shape is not None]
        if len(layers) < 2:
            continue
        if isinstance(module, torch.nn.Sequential):
            k = 0
            while k + 1 < len(layers):
                (a, fa), (b, fb) = layers[k], layers[k + 1]
                if fa[1] == fb[0]:
                    cols[a], rows[b] = (fa[2], 1), 1 - fb[2]
                    k += 2
                else:
                    k += 1
            continue
        if len(layers) == 3 and len({shape[:2] for _, shape in layers}) == 1 \
                and layers[0][1][0] == layers[0][1][1]:
            # three alike, square, and nothing after them here: a query, key and value
            # whose output projection is in another module (not the value fed by the
            # query and key)
            cols.update({name: (shape[2], 1) for name, shape in layers})
            waiting.append((layers[-1][0], layers[0][1][1]))
            continue
        for row_name, row in reversed(layers):   # the last that the others feed
            feeds = {name: (shape, k) for name, shape in layers if name != row_name
                     for k in [_blocks(shape[1], row[0])] if k}
            # (no wider than what feeds it: Phi-3 defines its output projection before
            # its fused query-key-value one, which the output projection does not feed)
            if feeds and len({shape[0] for shape, _ in feeds.values()}) == 1 \
                    and row[1] <= max(shape[1] for shape, _ in feeds.values()):
                rows[row_name] = 1 - row[2]
                cols.update({name: (shape[2], k) for name, (shape, k) in feeds.items()})
                break
    _across_modules(model, rows, cols, waiting)
    return rows, cols


def _across_modules(model, rows: dict, cols: dict, waiting: list) -> None:
    """The pattern where it spans modules, among the projections not laid out yet in
    the modules' order: a query-key-value group's (``waiting``: (its last member, its
    width)) row-parallel projection is the next one taking its width; and a projection
    that widens followed by one that narrows back (Bert's intermediate and output
    ``dense``) are column then row."""
    order = [(name, shape) for name, m in model.named_modules()
             for shape in [_projection(m)] if shape is not None]
    at = {name: k for k, (name, _) in enumerate(order)}
    for last, width in waiting:
        for name, shape in order[at[last] + 1:]:
            if name not in rows and name not in cols and shape[0] == width:
                rows[name] = 1 - shape[2]
                break
    free = [(name, shape) for name, shape in order if name not in rows and name not in cols]
    for (a, fa), (b, fb) in zip(free, free[1:]):
        if a not in rows and fa[1] == fb[0] and fa[1] > fa[0] and fb[1] == fa[0]:
            cols[a], rows[b] = (fa[2], 1), 1 - fb[2]


def _blocks(out_features: int, row_in: int) -> int:
    """How many blocks a column-parallel projection of ``out_features`` that feeds a
    row-parallel one of ``row_in`` input features is split in: 1 where the widths meet
    or the output is a whole fraction of it, at most ``MAX_KV_FRACTION`` (the keys and
    values of grouped-query attention: fewer heads than the queries); k for a fused
    projection (``MAX_FUSED_BLOCKS``); 0 where it does not feed it."""
    if out_features % row_in == 0 and out_features // row_in <= MAX_FUSED_BLOCKS:
        return out_features // row_in
    if row_in % out_features == 0 and row_in // out_features <= MAX_KV_FRACTION:
        return 1
    return 0
