"""A small GPT-like model whose feed-forward layers are mixtures of experts
(``gt.nn.MoE``), trained with the experts split across ranks (expert parallel) and the
batch split across the same ranks (data parallel), against one plain process.

    python -m globaltensor.launch --nproc_per_node 2 examples/moe.py
    python -m globaltensor.launch --nproc_per_node 4 examples/moe.py

Each block has causal attention and an MoE feed-forward of 4 experts (top-2, capacity
factor 1.0): each rank holds 4/n whole experts; a token goes to the ranks of its two
experts and comes back (two all-to-alls). The loss adds the load-balancing loss of every
MoE. Two ways, each checked step by step (loss, dropped tokens) and by its final
parameters against the same model on plain tensors in one process:

1. ``expert``: experts split(0), every other parameter broadcast;
2. ``fully_shard``: experts split(0), every other parameter ZeRO-3 sharded
   (``gt.nn.fully_shard`` on each module that is not an MoE's experts).

Options: ``--parts`` (comma-separated), ``--steps``.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import globaltensor as gt

S = gt.sbp.split
DIM, HEADS, HIDDEN, EXPERTS, VOCAB, LAYERS = 32, 4, 64, 4, 64, 2
BATCH, SEQ, AUX, CAPACITY = 8, 16, 0.01, 1.0


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, DIM))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attention = torch.nn.LayerNorm(DIM), Attention()
        self.norm2 = torch.nn.LayerNorm(DIM)
        self.moe = gt.nn.MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=CAPACITY)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.moe(self.norm2(x))


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def aux_loss(self):
        return sum(block.moe.aux_loss for block in self.blocks)

    def dropped(self) -> int:
        return sum(block.moe.last_dropped for block in self.blocks)


def say(*args) -> None:
    if gt.get_rank() == 0:
        print(*args, flush=True)


def batches(steps: int):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        yield ids[:, :-1], ids[:, 1:]


def train(model, steps: int, P=None) -> tuple:
    """Losses and dropped token-expert assignments of each step; ``P``: the batch is
    split(0) on it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, dropped = [], []
    for x, y in batches(steps):
        if P is not None:
            x, y = (gt.tensor(t, placement=P, sbp=S(0)) for t in (x, y))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) + AUX * model.aux_loss()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        dropped.append(model.dropped())
    return losses, dropped


def layout(model, part: str, P) -> None:
    """Experts split(0), the rest broadcast; ``fully_shard``: the rest ZeRO-3."""
    gt.nn.to_global(model, P, gt.nn.MoE.expert_sbp(model))
    if part == "fully_shard":
        for sub in model.modules():
            own = [n for n, p in sub.named_parameters(recurse=False)]
            if own and not isinstance(sub, gt.nn.MoE):   # the experts stay expert parallel
                gt.nn.fully_shard(sub, P)


def check(part: str, got: tuple, want: tuple, model, plain) -> None:
    """Raise on every rank unless losses, dropped counts and final parameters match."""
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-4,
                               atol=1e-5, msg=lambda m: f"{part}: losses differ: {m}")
    if got[1] != want[1]:
        raise AssertionError(f"{part}: dropped {got[1]}, one process dropped {want[1]}")
    whole = gt.nn.full_state_dict(model, ranks=range(gt.get_world_size()))
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(whole[name], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{part}: {name} differs: {m}")
    losses = got[0]
    say(f"moe ({part}): {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
        f"{sum(got[1])} assignments dropped, equal to one process")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="expert,fully_shard")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    n = gt.get_world_size()
    if EXPERTS % n:
        raise SystemExit(f"run with 1, 2 or 4 processes ({EXPERTS} experts)")
    P = gt.placement.all("cpu")
    torch.manual_seed(0)
    initial = GPT()
    plain = copy.deepcopy(initial)
    want = train(plain, args.steps)
    say(f"GPT with MoE ({sum(p.numel() for p in initial.parameters())} parameters, "
        f"{EXPERTS} experts, {EXPERTS // n} per rank) on {n} ranks, against one process:")
    for part in args.parts.split(","):
        if part not in ("expert", "fully_shard"):
            raise SystemExit(f"unknown part {part!r}")
        model = copy.deepcopy(initial)
        layout(model, part, P)
        check(part, train(model, args.steps, P), want, model, plain)


if __name__ == "__main__":
    main()
