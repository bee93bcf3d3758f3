"""A GPT trained with its sequence split across the ranks (context parallel): every
activation, attention included, holds 1/n of the sequence on each rank, so the
sequence a step can take grows with the number of ranks.

    python -m globaltensor.launch --nproc_per_node 2 examples/long_context.py

The program is the one-process program with the batch laid out ``split(1)`` (the
sequence dim): embeddings, norms and the MLP work on each rank's positions;
``F.scaled_dot_product_attention`` of q, k, v split on the sequence runs as ring
attention (key/value blocks passed rank to rank, causal blocks skipped), never
gathering the sequence; the parameters are broadcast and their gradients summed over
the ranks. Then again with the sequence in zig-zag order (``gt.nn.zigzag_order``: each
rank holds a chunk near the start and one near the end, so the causal ring is
balanced), positions and attention (``gt.nn.packed_attention(..., positions=order)``)
following the original order. It checks every step's loss and the final parameters against one plain
process, and measures what each rank keeps for backward at two sequence lengths: it
grows with the sequence / the ranks (the one-process growth divided by n).
Options: ``--seq``, ``--steps``.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import globaltensor as gt

DIM, HEADS, VOCAB, LAYERS, BATCH = 32, 4, 64, 2, 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        # no key bias: its gradient is zero but for rounding, which AdamW would magnify
        self.qkv = torch.nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(),
                                       torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x, order=None):
        b, t, _ = x.shape
        q, k, v = (y.transpose(1, 2) for y in
                   self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2))
        if order is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:   # the sequence in zig-zag order: causal by the original positions
            out = gt.nn.packed_attention(q, k, v, [0, t], positions=order)
        x = x + self.proj(out.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.norm2(x))


class GPT(torch.nn.Module):
    order = None   # the order of positions the batch comes in (zig-zag), None: in order

    def __init__(self, max_seq: int):
        super().__init__()
        self.tokens, self.positions = torch.nn.Embedding(VOCAB, DIM), torch.nn.Embedding(max_seq, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        at = torch.arange(ids.shape[1]) if self.order is None else self.order
        h = self.tokens(ids) + self.positions(at)
        for block in self.blocks:
            h = block(h, self.order)
        return self.head(h)


def loss_of(model, ids, targets):
    # classes on dim 1 keep the sequence dim whole where it is split: no reshape of it
    return F.cross_entropy(model(ids).transpose(1, 2), targets)


def batch(seq: int, step: int) -> tuple:
    ids = torch.randint(0, VOCAB, (BATCH, seq + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def laid_out(model, ids, targets, placement=None) -> tuple:
    """The batch as ``model`` takes it: in its order of positions (``model.order``),
    and on ``placement`` split on the sequence."""
    if model.order is not None:
        ids, targets = ids[:, model.order], targets[:, model.order]
    if placement is not None:
        ids, targets = (gt.tensor(t, placement=placement, sbp=gt.sbp.split(1))
                        for t in (ids, targets))
    return ids, targets


def train(model, seq: int, steps: int, placement=None) -> list:
    """Losses of ``steps`` AdamW steps; on ``placement``, the batch split on the sequence."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        loss = loss_of(model, *laid_out(model, *batch(seq, step), placement))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def kept_for_backward(model, seq: int, placement=None) -> int:
    """Bytes of this rank's parts that one forward keeps for backward (each storage once)."""
    seen: dict = {}

    def keep(t):
        local = t.to_local() if isinstance(t, gt.GlobalTensor) else t
        if local.device.type != "meta" and local.numel():
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = loss_of(model, *laid_out(model, *batch(seq, 0), placement))
    del loss
    return sum(seen.values())


def say(*args) -> None:
    if gt.get_rank() == 0:
        print(*args, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    n = gt.get_world_size()
    P = gt.placement("cpu", list(range(n)))
    torch.manual_seed(0)
    initial = GPT(2 * args.seq)
    plain = copy.deepcopy(initial)
    want = train(plain, args.seq, args.steps)
    for way in ("in order", "zig-zag order"):
        if way == "zig-zag order" and args.seq % (2 * n):
            say(f"zig-zag order skipped: a sequence of {args.seq} does not cut into 2 x {n} "
                f"equal chunks (--seq a multiple of {2 * n})")
            continue
        model = gt.nn.to_global(copy.deepcopy(initial), P, gt.sbp.broadcast)
        if way == "zig-zag order":   # a balanced causal ring
            model.order = gt.nn.zigzag_order(args.seq, n)
        losses = train(model, args.seq, args.steps, P)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-4,
                                   atol=1e-5)
        whole = gt.nn.full_state_dict(model, ranks=range(n))
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(whole[name], value, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name} differs: {m}")
        say(f"context parallel on {n} ranks, sequence {args.seq} {way}: {args.steps} steps, "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, equal to one process")
    model.order = None
    grow_one = kept_for_backward(plain, 2 * args.seq) - kept_for_backward(plain, args.seq)
    grow = kept_for_backward(model, 2 * args.seq, P) - kept_for_backward(model, args.seq, P)
    say(f"kept for backward, sequence {args.seq} -> {2 * args.seq}: one process "
        f"+{grow_one / 2**20:.2f} MiB, each of {n} ranks +{grow / 2**20:.2f} MiB "
        f"({grow / grow_one:.2f} of it)")


if __name__ == "__main__":
    main()
