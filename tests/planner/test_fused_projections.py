"""A fused query-key-value projection (GPT-2's ``c_attn``, nanoGPT's, Falcon's, Phi's:
one weight of 3 x C outputs, its output parted with ``split(C, dim=-1)``) laid out
Megatron's way, ``split(dim, blocks=3)`` (each of the query, key and value weights
split by heads): the parting is local, each part split by heads, and the backward's
``cat`` of their gradients is local too. A plain ``split(dim)`` of the fused weight
puts the query on some ranks and the value on others: parting it moves data."""
import torch
from mp import checks_in_worlds
from test_per_op_reductions import step_counted

B, T, C, H = 2, 4, 8, 4


def _attention():
    """q, k, v from one fused projection, heads by view + transpose, causal attention,
    an output projection; a residual."""
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)

        def forward(self, x):
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2)
                       for t in self.qkv(x).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + self.proj(y.transpose(1, 2).reshape(B, T, C))

    torch.manual_seed(0)
    return Attention()


def check_a_fused_projection_split_in_blocks_parts_locally():
    """Forward: one all-reduce (the output projection's, at the residual add); the
    backward sends no all-to-all and no all-gather. Values and gradients equal one
    process; the fused output is split in 3 blocks, each part split by heads."""
    import copy

    import globaltensor as gt
    from globaltensor.sbp import StridedSplit
    P = gt.placement.all("cpu")
    plain = _attention()

    def megatron(name, t):
        if name.startswith("qkv."):
            return gt.sbp.split(0, blocks=3)
        return gt.sbp.split(1) if name == "proj.weight" else gt.sbp.broadcast

    model = gt.nn.to_global(copy.deepcopy(plain), P, megatron)
    data = torch.randn(B, T, C, generator=torch.Generator().manual_seed(1))
    x = gt.to_global(data, P, gt.sbp.broadcast)
    # auto_parallel's tensor-parallel candidate is this layout
    from globaltensor.nn.auto_candidates import candidate_layouts
    proposed, _ = candidate_layouts(plain, P, (x,))["tensor parallel"]
    assert proposed == {n: (megatron(n, t),) for n, t in plain.named_parameters()}, proposed
    fused = model.qkv(x)
    assert fused.sbp == (StridedSplit(2, 3),), fused.sbp
    assert all(t.sbp == (gt.sbp.split(2),) for t in fused.split(C, dim=2))
    forward, backward = step_counted(model, plain, data, P)
    assert dict(forward.calls) == {"all_reduce": 1}, forward
    assert backward.calls["all_to_all"] == backward.calls["all_gather"] == 0, backward


def check_parts_and_joins_of_blocks():
    """split, split_with_sizes and chunk of a strided split into whole blocks (and not:
    chunks across blocks are boxed), cat of equal splits into blocks, with gradients."""
    import globaltensor as gt
    from globaltensor.sbp import StridedSplit
    P = gt.placement.all("cpu")
    n = P.size
    data = torch.randn(3, 6 * n, generator=torch.Generator().manual_seed(2))
    for blocks, sizes, want in ((3, 2 * n, [gt.sbp.split(1)] * 3),
                                (6, [2 * n, 4 * n], [StridedSplit(1, 2), StridedSplit(1, 4)]),
                                (3, [3 * n, 3 * n], None)):   # (a chunk cuts a block)
        x = gt.to_global(data, P, gt.sbp.broadcast).to_global(sbp=gt.sbp.split(1, blocks=blocks))
        x = x.detach().requires_grad_()
        with gt.debug.comm_stats() as sent:
            parts = x.split(sizes, dim=1)
        for got, expected in zip(parts, data.split(sizes, dim=1)):
            torch.testing.assert_close(got.full(), expected)
        if want is not None:
            assert [p.sbp[0] for p in parts] == want and sent.total_calls == 0, (parts, sent)
        sum((p * (k + 1)).sum() for k, p in enumerate(parts)).backward()
        grad = torch.cat([torch.full_like(e, k + 1.0) for k, e in enumerate(data.split(sizes, dim=1))], 1)
        torch.testing.assert_close(x.grad.full(), grad)
    a, b = (gt.to_global(t, P, gt.sbp.broadcast).to_global(sbp=gt.sbp.split(1))
            for t in data.split(3 * n, dim=1))
    with gt.debug.comm_stats() as sent:
        joined = torch.cat([a, b], dim=1)
    assert joined.sbp == (StridedSplit(1, 2),) and sent.total_calls == 0, (joined.sbp, sent)
    torch.testing.assert_close(joined.full(), data)


CHECKS = ["check_a_fused_projection_split_in_blocks_parts_locally",
          "check_parts_and_joins_of_blocks"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
